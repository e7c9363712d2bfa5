"""Progress bars (tqdm to stderr) that library code can ask for and the CLI switches on."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress_bar(items: Iterable[T], *, total: int | None, desc: str, unit: str, enable: bool) -> Iterator[T]:
    if not enable:
        yield from items
        return
    with tqdm(items, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True) as bar:
        yield from bar
