"""Fixed-bin histograms of |x| for percentile and MSE scaling, merged batch by batch.

Bins are 1/64 of an octave wide, from 2**-150 (below every float32 subnormal) to 2**129, taken
exactly from ``np.frexp``: the same bins for every batch and every tensor, so merging is adding
counts and memory does not depend on the data. Zeros are counted apart. Float8 grids are also
uniform within an octave, so 64 sub-bins resolve every float8 step (at most 16 per octave).
"""

from __future__ import annotations

import numpy as np

__all__ = ["LogHistogram"]

_SUB = 64
_EXP_MIN, _EXP_MAX = -150, 130  # frexp exponents covered
NUM_BINS = (_EXP_MAX - _EXP_MIN) * _SUB


class LogHistogram:
    def __init__(self) -> None:
        self.counts = np.zeros(NUM_BINS, dtype=np.int64)
        self.zeros = 0

    @property
    def total(self) -> int:
        return int(self.counts.sum()) + self.zeros

    def update(self, x: np.ndarray) -> None:
        """Add the finite values of ``x`` (NaN and Inf are left out)."""
        a = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        a = a[np.isfinite(a)]
        positive = a[a > 0]
        self.zeros += int(a.size - positive.size)
        if positive.size:
            self.counts += np.bincount(_bin_index(positive), minlength=NUM_BINS)

    def sparse(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(zeros, indices of the non-empty bins, their counts): what a worker sends back."""
        idx = np.flatnonzero(self.counts)
        return self.zeros, idx, self.counts[idx]

    def add_sparse(self, part: tuple[int, np.ndarray, np.ndarray]) -> None:
        """Merge another histogram's :meth:`sparse` form (integer counts: exact in any order)."""
        zeros, idx, counts = part
        self.zeros += int(zeros)
        self.counts[idx] += counts

    @staticmethod
    def edges(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lower and upper edges of the given bins."""
        exp, sub = np.divmod(np.asarray(index), _SUB)
        base = np.ldexp(1.0, exp + _EXP_MIN - 1)
        return base * (1 + sub / _SUB), base * (1 + (sub + 1) / _SUB)

    def nonzero(self) -> tuple[np.ndarray, np.ndarray]:
        """Centres and counts of the non-empty bins (zeros first, at value 0)."""
        idx = np.flatnonzero(self.counts)
        lo, hi = self.edges(idx)
        centres = np.concatenate([[0.0], (lo + hi) / 2]) if self.zeros else (lo + hi) / 2
        counts = np.concatenate([[self.zeros], self.counts[idx]]) if self.zeros else self.counts[idx]
        return centres, counts.astype(np.float64)

    def percentile(self, p: float) -> float:
        """Upper edge of the bin holding the p-th percentile of |x| (0.0 for an all-zero tensor)."""
        total = self.total
        if total == 0:
            return 0.0
        target = p / 100.0 * total
        if target <= self.zeros:
            return 0.0
        i = int(np.searchsorted(np.cumsum(self.counts) + self.zeros, target))
        return float(self.edges(np.array(min(i, NUM_BINS - 1)))[1])

    def to_json(self) -> dict:
        idx = np.flatnonzero(self.counts)
        return {"zeros": self.zeros, "bins": [int(i) for i in idx], "counts": [int(c) for c in self.counts[idx]]}

    @classmethod
    def from_json(cls, doc: dict) -> LogHistogram:
        h = cls()
        h.zeros = int(doc["zeros"])
        h.counts[np.asarray(doc["bins"], dtype=np.int64)] = np.asarray(doc["counts"], dtype=np.int64)
        return h


def _bin_index(positive: np.ndarray) -> np.ndarray:
    mant, exp = np.frexp(positive)  # positive = mant * 2**exp, mant in [0.5, 1)
    sub = np.minimum(((mant * 2 - 1) * _SUB).astype(np.int64), _SUB - 1)
    return (np.clip(exp, _EXP_MIN, _EXP_MAX - 1).astype(np.int64) - _EXP_MIN) * _SUB + sub
