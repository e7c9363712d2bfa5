"""Progress bars (tqdm to stderr) that library code can ask for and the CLI switches on.

tqdm is a dependency, but a machine that only has the project on PYTHONPATH (the lent GPU machine)
may lack it: then there is simply no bar.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import TypeVar

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - exercised only where tqdm is missing
    tqdm = None

T = TypeVar("T")
_open: weakref.WeakSet = weakref.WeakSet()  # bars whose loop has not ended (an error may have left it mid-way)


def progress_bar(items: Iterable[T], *, total: int | None, desc: str, unit: str, enable: bool) -> Iterator[T]:
    if not enable or tqdm is None:
        yield from items
        return
    with tqdm(items, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True) as bar:
        _open.add(bar)
        yield from bar


def close_all() -> None:
    """Clear every bar still on screen, so that a message printed next starts on a clean line."""
    for bar in list(_open):
        bar.close()
