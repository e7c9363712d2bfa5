"""Split a model folder's ``eval.npz`` into two disjoint halves, for choosing and then checking a setting.

``eval_search.npz`` gets the first half of the samples (axis 0) of every array in ``eval.npz``, and
``eval_holdout.npz`` the second half (the middle sample goes to the holdout when the count is odd).
Every key is split the same way, ``labels`` and ``_``-prefixed extras included, so the rows stay
aligned. Use the search half to pick a setting (e.g. ``fp8onnx quantize --eval ... --accuracy-target``)
and the holdout half to verify it on samples the choice never saw.

Writes, next to ``DIR/eval.npz``: eval_search.npz  eval_holdout.npz

Usage: python models/split_eval.py DIR [DIR ...]   (e.g. models/decoder models/minilm models/cnn)
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np


def split(folder: str | pathlib.Path) -> dict[str, dict[str, tuple[int, ...]]]:
    """Write ``eval_search.npz`` and ``eval_holdout.npz`` from ``folder/eval.npz``; return their shapes."""
    folder = pathlib.Path(folder)
    with np.load(folder / "eval.npz", allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    if not arrays:
        raise SystemExit(f"{folder / 'eval.npz'} holds no arrays")
    counts = {key: (a.shape[0] if a.ndim else None) for key, a in arrays.items()}
    if len(set(counts.values())) != 1 or None in counts.values():
        raise SystemExit(f"{folder / 'eval.npz'}: arrays differ in their number of samples (axis 0): {counts}")
    n = next(iter(counts.values()))
    if n < 2:
        raise SystemExit(f"{folder / 'eval.npz'}: {n} sample(s), too few to split")
    half = n // 2
    shapes = {}
    for name, sl in (("eval_search", slice(0, half)), ("eval_holdout", slice(half, n))):
        part = {key: a[sl] for key, a in arrays.items()}
        np.savez_compressed(folder / f"{name}.npz", **part)
        shapes[name] = {key: a.shape for key, a in part.items()}
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", metavar="DIR", help="folder holding eval.npz")
    args = ap.parse_args()
    for folder in args.dirs:
        for name, shapes in split(folder).items():
            print(f"{pathlib.Path(folder) / name}.npz: " + ", ".join(f"{k} {list(s)}" for k, s in shapes.items()))


if __name__ == "__main__":
    main()
