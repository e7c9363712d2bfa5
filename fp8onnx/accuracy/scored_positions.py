"""A task's logits at the positions it scores only: LAMBADA scores a target of one to three tokens after a
context of about 80, HellaSwag an ending after its context, yet a language model computes its vocabulary
projection (lm_head) at every position. ``compare`` on a task file feeds each model the positions its labels
mark, and each model gathers those rows of the projection's input first (``GatherND`` with ``batch_dims=1``):
the projection, its logits and compare's own scoring of them then cover the scored positions alone.

The scores do not change: every labelled position's logits are the same products over the same rows (the
last digits may differ, as a matrix product's blocking does with its row count), and an item's accuracy and
perplexity read those positions only. What does change: the output statistics (top-1 agreement, relative L2,
cosine) cover the scored positions, not every position; compare's notes say so.

A model is trimmed where its logits come from MatMuls whose first inputs are [batch, seq, width] (one, or a
split projection's products added: kept channels), through nothing but per-element steps with constant
other inputs (a Cast, a soft cap's Div/Tanh/Mul, a bias); every model of the run must be, or none is. On a
model of SmolLM2-135M's size the projection is about a fifth of the work; on Gemma 3 270M's (262,144
tokens) about three fifths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from fp8onnx.accuracy.metrics import POSITIONS
from fp8onnx.data.datasource import DataSource
from fp8onnx.data.feeds import Batch
from fp8onnx.passes import ScoredRowsPass, scored_projections

__all__ = ["POSITIONS", "ScoredPositions", "trimmable", "trimmed"]


def trimmable(model: ir.Model, logits: str = "logits") -> bool:
    """Whether :func:`trimmed` can trim ``model`` (nothing changed)."""
    return scored_projections(model, logits, POSITIONS) is not None


def trimmed(model: ir.Model, logits: str = "logits") -> bool:
    """Give ``model`` the input :data:`POSITIONS` and gather those rows of its vocabulary projection's input
    (:class:`fp8onnx.passes.ScoredRowsPass`), so that ``logits`` is [batch, scored, vocabulary]; False (the
    model untouched) where it cannot be (:func:`trimmable`)."""
    return ScoredRowsPass(logits, POSITIONS)(model).modified


@dataclasses.dataclass
class ScoredPositions:
    """A task's data source whose batches carry :data:`POSITIONS` (each sample's labelled positions, -1 past
    its own) and labels at those positions only ([batch, scored], -1 where padded)."""

    source: DataSource

    def __getattr__(self, name):
        return getattr(self.source, name)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        for batch in self.source.batches(batch_size):
            yield dataclasses.replace(batch, **scored(batch.feed, batch.labels))


def scored(feed: dict, labels: np.ndarray | None) -> dict:
    """The feed with :data:`POSITIONS` and the labels at those positions, from labels [batch, seq]."""
    labels = np.asarray(labels)
    kept = labels >= 0
    width = max(1, int(kept.sum(axis=1).max(initial=0)))
    positions = np.full((labels.shape[0], width), -1, np.int64)
    picked = np.full((labels.shape[0], width), -1, labels.dtype)
    for row in range(labels.shape[0]):
        at = np.flatnonzero(kept[row])
        positions[row, : len(at)], picked[row, : len(at)] = at, labels[row, at]
    return {"feed": {**feed, POSITIONS: positions[..., None]}, "labels": picked}
