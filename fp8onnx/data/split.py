"""Two disjoint parts of one data source: every third sample held out, the rest to choose on.

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

__all__ = ["EVERY", "Part", "count_samples"]

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
