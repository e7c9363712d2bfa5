"""Parts of one data source: every third sample held out, the rest to choose on (:class:`Part`); a few
samples spread over all of it (:class:`Spread`).

The accuracy search (``quantize --accuracy-target``) chooses which nodes stay in float on one part of
``--eval`` and confirms its choice on the other, which the choice never saw (SPEC §12). A sample is one
index of a batch's first axis where every array of the batch has it (the batch layout, and feeds
joined along a dynamic batch axis); a batch that cannot be cut so (a feed with no batch axis) counts as
one sample and goes whole to one part.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from fp8onnx.data.feeds import Batch

__all__ = ["EVERY", "Part", "Spread", "count_samples"]

logger = logging.getLogger(__name__)

EVERY = 3  # the held-out part: samples 2, 5, 8, ... (a third); the tuning part: the other two thirds


class Part:
    """``Part(source, held_out=True)``: every ``EVERY``-th sample of ``source`` (by position, from the
    third); ``held_out=False``: all the others.

    requires: ``source`` yields the same batches, in the same order, each time it is read;
    ensures: the two parts are disjoint and together hold every sample once, in the source's order.
    """

    def __init__(self, source, held_out: bool):
        self._source, self.held_out = source, held_out

    def count_batches(self, batch_size: int) -> None:
        return None

    def batches(self, batch_size: int) -> Iterator[Batch]:
        start = 0
        for batch in self._source.batches(batch_size):
            n = _cuttable(batch)
            index = start + np.arange(n if n is not None else 1)
            start = int(index[-1]) + 1 if len(index) else start
            mine = (index % EVERY == EVERY - 1) == self.held_out
            if n is None:
                if mine[0]:
                    yield batch
            elif mine.all():
                yield batch
            elif mine.any():
                labels = None if batch.labels is None else batch.labels[mine]
                yield Batch({k: v[mine] for k, v in batch.feed.items()}, labels)


def _cuttable(batch: Batch) -> int | None:
    """The number of samples along the batch's first axis, where every array (labels too) has that
    axis; None where the batch is one feed that cannot be cut."""
    arrays = list(batch.feed.values()) + ([] if batch.labels is None else [np.asarray(batch.labels)])
    if not arrays or any(a.ndim == 0 for a in arrays):
        return None
    sizes = {int(a.shape[0]) for a in arrays}
    return sizes.pop() if len(sizes) == 1 else None


def count_samples(source, batch_size: int) -> int:
    """How many samples ``source`` holds in the sense of :class:`Part` (one read of the data)."""
    return sum(_cuttable(b) or 1 for b in source.batches(batch_size))


class Spread:
    """Up to ``most`` samples of ``source`` at evenly spaced positions over all of it, in an order whose
    every prefix is spread too (of 256 calibration windows and 64 positions, the first four taken are
    windows 0, 130, 65 and 194: four documents, where the source's first four windows are often one).
    What a measurement that reads only a few samples takes (:mod:`fp8onnx.workflows.loss_choice`).

    requires: ``source`` yields the same batches, in the same order, each time it is read (it is read
    twice: to count, then to take); ensures: each chosen sample once, in batches of up to ``batch_size``
    samples of one shape; a batch that cannot be cut into samples (:func:`_cuttable`) is one sample,
    given whole and alone.
    """

    def __init__(self, source, most: int):
        self._source, self.most = source, most

    def count_batches(self, batch_size: int) -> None:
        return None

    def batches(self, batch_size: int) -> Iterator[Batch]:
        total = count_samples(self._source, batch_size)
        picks: list[int] = np.unique(np.linspace(0, total - 1, min(total, self.most)).round()).astype(int).tolist()
        rank = {picks[j]: r for r, j in enumerate(_prefix_spread(len(picks)))}  # position -> turn
        taken: dict[int, Batch] = {}
        start = 0
        for batch in self._source.batches(batch_size):
            n = _cuttable(batch)
            for at in range(start, start + (n or 1)):
                if at in rank:
                    taken[rank[at]] = batch if n is None else _row(batch, at - start)
            start += n or 1
        group: list[Batch] = []
        for turn in range(len(taken)):
            one = taken[turn]
            if group and (len(group) == batch_size or not _joinable(group[0], one)):
                yield _joined(group)
                group = []
            group.append(one)
        if group:
            yield _joined(group)


def _prefix_spread(n: int) -> list[int]:
    """0 .. n - 1 in bit-reversed (van der Corput) order: every prefix spread over the range."""
    bits = max(1, (n - 1).bit_length())
    order = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits)]
    return [i for i in order if i < n]


def _row(batch: Batch, i: int) -> Batch:
    labels = None if batch.labels is None else batch.labels[i : i + 1]
    return Batch({k: v[i : i + 1] for k, v in batch.feed.items()}, labels)


def _joinable(a: Batch, b: Batch) -> bool:
    """Whether two samples stack into one batch: both cut from cuttable batches, the same arrays and shapes."""
    if _cuttable(a) != 1 or _cuttable(b) != 1 or a.feed.keys() != b.feed.keys():
        return False
    same = all(a.feed[k].shape == b.feed[k].shape for k in a.feed)
    if a.labels is None or b.labels is None:
        return same and a.labels is b.labels
    return same and a.labels.shape == b.labels.shape


def _joined(group: list[Batch]) -> Batch:
    if len(group) == 1:
        return group[0]
    feed = {k: np.concatenate([g.feed[k] for g in group]) for k in group[0].feed}
    labels = None if group[0].labels is None else np.concatenate([np.asarray(g.labels) for g in group])
    return Batch(feed, labels)
