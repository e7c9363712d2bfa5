"""Streaming calibration: per-tensor statistics of activations, batch by batch.

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
import functools
import json
import logging
import math
import os
import pathlib
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.errors import Fp8OnnxError, first_line
from fp8onnx.numerics.histogram import NUM_BINS, LogHistogram
from fp8onnx.passes import AMAX_SUFFIX, VALUE_SUFFIX, AddAmaxOutputsPass, release
from fp8onnx.passes._common import keep_only_outputs
from fp8onnx.phases import phase
from fp8onnx.pipeline.batching import _batched_inputs, _run_peak, _samples, _segmented_values, auto_batch_size
from fp8onnx.pipeline.segments import run_segmented, run_segmented_on
from fp8onnx.progress import progress_bar
from fp8onnx.runtime import (
    WEIGHT_MEMORY,
    RunOptions,
    session_for_model,
    weight_bytes,
)

__all__ = ["WEIGHT_MEMORY", "Stats", "collect_amax", "weight_amax"]

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
        from fp8onnx.graph.model_io import write_text_atomic

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
            raise Fp8OnnxError(f"{where} is not readable JSON ({exc}).") from None
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

    def fail(self, key: str, what: str, value) -> None:
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

    def histogram(self, value, key: str) -> LogHistogram:
        if not isinstance(value, dict):
            self.fail(key, "a mapping with zeros, bins and counts", value)
        self.count_value(value.get("zeros"), f"{key}['zeros']")
        bins, counts = value.get("bins"), value.get("counts")
        for name, items in (("bins", bins), ("counts", counts)):
            if not isinstance(items, list):
                self.fail(f"{key}[{name!r}]", "a list of integers", items)
            for i, item in enumerate(items):
                self.count_value(item, f"{key}[{name!r}][{i}]")
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
    arr = np.abs(value.const_value.numpy().astype(np.float32))
    release(value.const_value)  # read once: unmap it, so a large model never sits in memory whole
    if arr.size == 0:
        return 0.0 if axis is None else np.zeros(arr.shape[axis], np.float64)
    if not np.isfinite(arr).all():
        raise Fp8OnnxError(f"Weight {value.name!r} contains NaN or Inf values; refusing to quantize a corrupt tensor.")
    if axis is None:
        return float(arr.max())
    others = tuple(i for i in range(arr.ndim) if i != axis % arr.ndim)
    return arr.max(axis=others).astype(np.float64)


class _Running:
    """Running per-tensor maximum (NaN/Inf batches counted and skipped) and histograms."""

    def __init__(self, names: list[str], histograms: bool):
        self.amax = dict.fromkeys(names, 0.0)
        self.nonfinite: dict[str, int] = {}
        self.hist = {n: LogHistogram() for n in names} if histograms else {}

    def add(self, name: str, amax) -> None:
        a = float(amax)
        if math.isfinite(a):
            self.amax[name] = max(self.amax[name], a)
        else:
            self.nonfinite[name] = self.nonfinite.get(name, 0) + 1

    def add_summary(self, summary: dict) -> None:
        """One batch's :func:`summarize` d outputs, merged in batch order."""
        for key, part in summary.items():
            if key.endswith(AMAX_SUFFIX):
                self.add(key[: -len(AMAX_SUFFIX)], part)
            else:
                self.hist[key[: -len(VALUE_SUFFIX)]].add_sparse(part)


def summarize(values: dict[str, np.ndarray]) -> dict:
    """One batch's instrumented outputs (``t + AMAX_SUFFIX``, ``t + VALUE_SUFFIX``) reduced to what
    the running statistics merge: amax scalars and sparse histogram counts. The same function runs
    in this process and on Ray workers (:mod:`fp8onnx.pipeline.distributed`): merged in batch order, the
    statistics are the same bit for bit."""
    summary = {}
    for key, array in values.items():
        if key.endswith(AMAX_SUFFIX):
            summary[key] = float(array)
        elif key.endswith(VALUE_SUFFIX):
            hist = LogHistogram()
            hist.update(array)
            summary[key] = hist.sparse()
    return summary


def collect_amax(
    model: ir.Model,
    tensor_names: Iterable[str],
    data,
    *,
    histograms: bool = False,
    run: RunOptions | None = None,
) -> Stats:
    """Run ``model`` over ``data`` (see :func:`fp8onnx.data.datasource.as_data`): running amax per tensor, and
    with ``histograms`` a fixed-bin histogram of |x| per tensor.

    A model with more than ``weight_memory`` bytes of weights is run layer by layer
    (:mod:`fp8onnx.pipeline.segments`), holding at most about that much of its weights at once."""
    run = run or RunOptions()
    provider, progress, weight_memory = run.provider, run.progress, run.weight_memory
    names = list(dict.fromkeys(tensor_names))
    stats = Stats(amax={n: 0.0 for n in names})
    if not names:
        return stats
    with phase("instrument the graph"):
        instrumented = model.clone()
        AddAmaxOutputsPass(names, values=histograms)(instrumented)
        outputs = [n + AMAX_SUFFIX for n in names] + ([n + VALUE_SUFFIX for n in names] if histograms else [])
        keep_only_outputs(instrumented, outputs)  # statistics only: not the model's own outputs
    running = _Running(names, histograms)
    source = as_data(data, input_specs(model), model)

    def counted(batches):
        for batch in batches:
            stats.num_batches += 1
            stats.num_samples += batch.size
            yield batch

    def batched(measure=None):
        """(batch count or None, the counted batches): sized by ``measure`` on one sample when the
        user chose no --batch-size and every input has a batch axis, else ``run.batch``."""
        if measure is not None and run.batch_size is None and _batched_inputs(model):
            with phase("size the batches"):
                size, stats.batching = auto_batch_size(measure, source, run.batch_memory)
        else:
            size, stats.batching = run.batch, _samples(run.batch)
        return source.count_batches(size), counted(source.batches(size))

    if weight_bytes(model) > weight_memory:
        bar = functools.partial(progress_bar, unit="batch", enable=progress)
        # With histograms, fetching every measured tensor dominates: one sample's segmented run tells
        # how much. Without, the statistics are scalars and one segment's activations are what a batch costs.
        measure = lambda feed: _segmented_values(instrumented, outputs, feed, weight_memory, provider)  # noqa: E731
        _, batches = batched(measure if histograms else None)
        show = lambda it, n, desc: bar(it, total=n, desc=desc)  # noqa: E731
        feeds = (b.feed for b in batches)
        if run.distributed:  # each segment's batches shared by Ray workers
            from fp8onnx.pipeline.distributed import shared_pool

            pool = shared_pool(run.workers, run.ray_address)
            merge = lambda _, summary: running.add_summary(summary)  # noqa: E731
            with pool:
                run_segmented_on(
                    pool,
                    instrumented,
                    outputs,
                    feeds,
                    summarize,
                    merge,
                    budget=weight_memory,
                    provider=provider,
                    progress=show,
                )
        else:
            merge = lambda _, values: running.add_summary(summarize(values))  # noqa: E731
            run_segmented(instrumented, outputs, feeds, merge, budget=weight_memory, provider=provider, progress=show)
    elif run.distributed:
        from fp8onnx.pipeline.distributed import fetch, statistics_pool

        with phase("Ray workers"):
            pool = statistics_pool(run, instrumented, "The calibration model")
        with pool:
            # one sample measured on a worker: the budget is a worker's
            total, batches = batched(lambda feed: next(iter(pool.map(_run_peak, [(outputs, feed)]))))
            with phase("run the calibration batches"):
                work = ((outputs, b.feed, summarize, "Calibration") for b in batches)
                summaries = pool.map(fetch, work)
                for summary in progress_bar(summaries, total=total, desc="calibrating", unit="batch", enable=progress):
                    running.add_summary(summary)
    else:
        # ORT's arena kept growing over the first batches when whole tensors are fetched for histograms
        # (peak RSS 12% higher at 1,024 than at 128 samples on all-MiniLM-L6-v2); without it RSS is flat.
        with phase("onnxruntime session"):
            session = session_for_model(
                instrumented, provider, "The calibration model", arena=not histograms, instrumented=True
            )
        total, batches = batched(lambda feed: _run_peak(session, outputs, feed))
        with phase("run the calibration batches"):
            for batch in progress_bar(batches, total=total, desc="calibrating", unit="batch", enable=progress):
                try:
                    values = session.run(outputs, batch.feed)
                except Exception as exc:
                    raise Fp8OnnxError(
                        f"Calibration batch {stats.num_batches - 1} failed in onnxruntime: {first_line(exc)}"
                    ) from None
                running.add_summary(summarize(dict(zip(outputs, values))))
    if stats.num_batches == 0:
        raise Fp8OnnxError("The calibration data gave no batches.")
    stats.amax, stats.nonfinite, stats.hist = running.amax, running.nonfinite, running.hist
    for name, count in stats.nonfinite.items():
        logger.warning("tensor %r had NaN/Inf values in %d calibration batches; they were ignored", name, count)
    zero = [n for n, a in stats.amax.items() if a == 0.0 or not math.isfinite(a)]
    if zero:
        logger.info("%d tensors were all zero during calibration; they get a safe default scale", len(zero))
    return stats
