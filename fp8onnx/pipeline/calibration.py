"""Streaming calibration: per-tensor statistics of activations, batch by batch, and their file.

The model is instrumented with ``AddAmaxOutputsPass`` so that onnxruntime returns each tensor's
absolute maximum as one scalar per batch; only a running maximum is kept. With histograms
(percentile and mse scaling), each batch's tensor is also read once into a fixed-bin
:class:`~fp8onnx.numerics.histogram.LogHistogram` and dropped. Memory therefore does not depend on the
number of calibration samples. A model whose weights exceed ``weight_memory`` runs layer by layer
(:mod:`fp8onnx.pipeline.segments`), so it does not depend on the model's size either. Statistics are saved
as JSON (``fp8onnx calibrate``) and reused by ``fp8onnx quantize --stats``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Iterable
from typing import NoReturn

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.graph import known
from fp8onnx.graph.model_io import write_text_atomic
from fp8onnx.graph.run_settings import WEIGHT_MEMORY, RunOptions
from fp8onnx.numerics.histogram import NUM_BINS, LogHistogram
from fp8onnx.passes import release
from fp8onnx.pipeline.statistics import Measured, Ranges, measure

__all__ = ["WEIGHT_MEMORY", "Stats", "block_amax", "collect_amax", "ranges_stats", "weight_amax"]

logger = logging.getLogger(__name__)
STATS_VERSION = 2


@dataclasses.dataclass
class Stats:
    """Per-tensor statistics of activations over a calibration set."""

    amax: dict[str, float]
    num_batches: int = 0
    num_samples: int = 0
    nonfinite: dict[str, int] = dataclasses.field(default_factory=dict)  # batches whose amax was NaN/Inf
    hist: dict[str, LogHistogram] = dataclasses.field(default_factory=dict)  # empty unless asked for
    # How the batches were sized (not saved: the statistics do not depend on it), e.g.
    # "16 samples" or "6 samples (one took 170 MiB; --batch-memory 1024 MiB)".
    batching: str = dataclasses.field(default="", compare=False)

    def to_json(self) -> dict:
        return {
            "fp8onnx_stats_version": STATS_VERSION,
            "num_batches": self.num_batches,
            "num_samples": self.num_samples,
            "amax": self.amax,
            "nonfinite_batches": self.nonfinite,
            "histograms": {k: h.to_json() for k, h in self.hist.items()},
        }

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Stats:
        """Read a statistics file, validated against its schema before anything is built from it:
        every problem is one sentence with the key path (e.g. ``amax['x']``)."""
        path = pathlib.Path(path)
        where = f"Statistics file {str(path)!r}"
        if path.exists() and not path.is_file():
            raise Fp8OnnxError(f"{where} is not a regular file.")
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise Fp8OnnxError(f"{where} does not exist.") from None
        except RecursionError:
            raise Fp8OnnxError(f"{where} is not readable JSON (nested too deeply).") from None
        except (OSError, ValueError) as exc:
            raise Fp8OnnxError(f"{where} is not readable JSON ({exc}).") from exc
        if not isinstance(doc, dict) or doc.get("fp8onnx_stats_version") != STATS_VERSION:
            raise Fp8OnnxError(f"{where} was not written by `fp8onnx calibrate`.")
        check = _Schema(where)
        amax = check.mapping(doc, "amax", check.amax, required=True)
        return cls(
            amax=amax,
            num_batches=check.count(doc, "num_batches"),
            num_samples=check.count(doc, "num_samples"),
            nonfinite=check.mapping(doc, "nonfinite_batches", check.count_value),
            hist=check.mapping(doc, "histograms", check.histogram),
        )


class _Schema:
    """Type checks of a statistics document; errors name the file and the key path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, what: str, value) -> NoReturn:
        shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
        raise Fp8OnnxError(f"{self.where}: {key} must be {what}, got {shown[:60]}.")

    def count_value(self, value, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.fail(key, "a non-negative integer", value)
        return value

    def count(self, doc: dict, key: str) -> int:
        return self.count_value(doc.get(key, 0), key)

    def amax(self, value, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            self.fail(key, "a finite non-negative number", value)
        return float(value)

    def count_list(self, items, key: str) -> list:
        if not isinstance(items, list):
            self.fail(key, "a list of integers", items)
        for i, item in enumerate(items):
            self.count_value(item, f"{key}[{i}]")
        return items

    def histogram(self, value, key: str) -> LogHistogram:
        if not isinstance(value, dict):
            self.fail(key, "a mapping with zeros, bins and counts", value)
        self.count_value(value.get("zeros"), f"{key}['zeros']")
        bins = self.count_list(value.get("bins"), f"{key}['bins']")
        counts = self.count_list(value.get("counts"), f"{key}['counts']")
        if len(bins) != len(counts):
            self.fail(f"{key}['counts']", f"as long as {key}['bins'] ({len(bins)})", len(counts))
        if any(b >= NUM_BINS for b in bins) or len(set(bins)) != len(bins):
            self.fail(f"{key}['bins']", f"distinct bin indices below {NUM_BINS}", max(bins))
        return LogHistogram.from_json(value)

    def mapping(self, doc: dict, key: str, item, required: bool = False) -> dict:
        value = doc.get(key, None if required else {})
        if not isinstance(value, dict):
            self.fail(key, "a mapping of tensor name to value", value)
        return {str(k): item(v, f"{key}[{k!r}]") for k, v in value.items()}


def weight_amax(value: ir.Value, axis: int | None = None):
    """Absolute maximum of a constant tensor, or per slice along ``axis``.

    A weight holding NaN or Inf is corrupt (or a trap): it is refused rather than quantized."""
    tensor = known.constant(value)
    arr = np.abs(tensor.numpy().astype(np.float32))
    release(tensor)  # read once: unmap it, so a large model never sits in memory whole
    if arr.size == 0:
        return 0.0 if axis is None else np.zeros(arr.shape[axis], np.float64)
    if not np.isfinite(arr).all():
        raise Fp8OnnxError(f"Weight {value.name!r} contains NaN or Inf values; refusing to quantize a corrupt tensor.")
    if axis is None:
        return float(arr.max())
    others = tuple(i for i in range(arr.ndim) if i != axis % arr.ndim)
    return arr.max(axis=others).astype(np.float64)


def block_amax(value: ir.Value, axis: int, block: int) -> np.ndarray:
    """Absolute maximum of a 2-D constant tensor per block of ``block`` elements along ``axis`` (the
    last block may be shorter): shape of the tensor with ``axis`` divided into blocks. A tensor of
    more dimensions (a Conv weight) is taken as its 2-D view [dim 0, the rest] (``axis`` 1)."""
    tensor = known.constant(value)
    arr = np.abs(tensor.numpy().astype(np.float32))
    release(tensor)
    if arr.ndim > 2:
        arr = arr.reshape(arr.shape[0], -1)
    if not np.isfinite(arr).all():
        raise Fp8OnnxError(f"Weight {value.name!r} contains NaN or Inf values; refusing to quantize a corrupt tensor.")
    moved = np.moveaxis(arr, axis, 0)
    n = moved.shape[0]
    padded = np.zeros((-(-n // block) * block, *moved.shape[1:]), np.float32)
    padded[:n] = moved
    amax = padded.reshape(-1, block, *moved.shape[1:]).max(axis=1)
    return np.moveaxis(amax, 0, axis).astype(np.float64)


def collect_amax(
    model: ir.Model,
    tensor_names: Iterable[str],
    data,
    *,
    histograms: bool = False,
    run: RunOptions | None = None,
) -> Stats:
    """Run ``model`` over ``data`` (see :func:`fp8onnx.data.datasource.as_data`): running amax per tensor, and
    with ``histograms`` a fixed-bin histogram of |x| per tensor (one :class:`~fp8onnx.pipeline.statistics.Ranges`
    measured by the pipeline, :func:`~fp8onnx.pipeline.statistics.measure`).

    A model with more than ``weight_memory`` bytes of weights is run layer by layer
    (:mod:`fp8onnx.pipeline.segments`), holding at most about that much of its weights at once."""
    names = list(dict.fromkeys(tensor_names))
    if not names:
        return Stats(amax={})
    ranges = Ranges(names, histograms)
    source = as_data(data, input_specs(model), model)
    done = measure(model, [ranges], source, run or RunOptions(), "calibration")
    return ranges_stats(ranges, done)


def ranges_stats(ranges: Ranges, done: Measured) -> Stats:
    """The :class:`Stats` of a measured :class:`~fp8onnx.pipeline.statistics.Ranges`, with the
    warnings a user should see (NaN/Inf batches, all-zero tensors)."""
    stats = Stats(ranges.amax, done.num_batches, done.num_samples, ranges.nonfinite, ranges.hist, done.batching)
    for name, count in stats.nonfinite.items():
        logger.warning("tensor %r had NaN/Inf values in %d calibration batches; they were ignored", name, count)
    zero = [n for n, a in stats.amax.items() if a == 0.0 or not math.isfinite(a)]
    if zero:
        logger.info("%d tensors were all zero during calibration; they get a safe default scale", len(zero))
    return stats
