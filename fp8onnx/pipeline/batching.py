"""Calibration's batch size from a memory budget: run the first sample alone, measure what it
fetched and the memory it added (in one process, or layer by layer), and size the batches to
``--batch-memory``."""

from __future__ import annotations

import logging

import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.data.feeds import input_specs
from fp8onnx.graph.run_settings import DEFAULT_BATCH
from fp8onnx.pipeline.segments import run_segmented

logger = logging.getLogger(__name__)


def _memory_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _run_peak(session, outputs: list[str], feed: dict) -> tuple[int, int]:
    """(bytes fetched, bytes by which the run raised the resident set above where it started) of one
    run. The second is 0 where Linux's peak counter cannot be reset; memory the heap already held
    and reused does not show in it, so it is a lower bound."""
    start = _memory_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # resets VmHWM to the current resident set
    except OSError:
        start = None
    try:
        values = session.run(outputs, feed)
    except Exception as exc:
        raise Fp8OnnxError(f"Calibration batch 0 failed in onnxruntime: {first_line(exc)}") from exc
    peak = _memory_kib("VmHWM") if start is not None else None
    return sum(v.nbytes for v in values), 0 if peak is None or start is None else max(0, peak - start) << 10


def _segmented_values(model, outputs, feed, budget, provider) -> tuple[int, int]:
    """Bytes one layer-by-layer run fetches, twice: onnxruntime's buffers and their NumPy copies are
    alive together (its resident growth would count the segments' weights, so it is not measured)."""
    fetched: list[int] = []
    run_segmented(
        model,
        outputs,
        [feed],
        lambda _, v: fetched.extend(a.nbytes for a in v.values()),
        budget=budget,
        provider=provider,
    )
    return 2 * sum(fetched), 0


def auto_batch_size(measure, source, budget: int) -> tuple[int, str]:
    """Samples per calibration run when the user chose none: :data:`DEFAULT_BATCH`, or fewer when one
    sample's run (``measure(feed)`` on the first sample -> (bytes fetched, resident growth)) would
    take more than ``budget`` bytes at that size.

    One sample costs whichever is larger: the statistics it fetched (with histograms every measured
    tensor comes back whole: 111 MiB a 128-token window on SmolLM2-135M) or the resident memory its
    run added (onnxruntime's own activations, e.g. attention scores of long sequences).
    Returns (batch size, how it was chosen, for the summary)."""
    probe = next(iter(source.batches(1)), None)
    if probe is None:
        return DEFAULT_BATCH, _samples(DEFAULT_BATCH)
    try:
        fetched, grown = measure(probe.feed)
    except Fp8OnnxError as exc:  # e.g. an input whose first axis is not the batch: keep the default
        logger.info("calibration batches of %d samples: one sample alone did not run (%s)", DEFAULT_BATCH, exc)
        return DEFAULT_BATCH, _samples(DEFAULT_BATCH)
    per_sample = max(grown, fetched, 1) / max(probe.size, 1)
    size = int(max(1, min(DEFAULT_BATCH, budget // per_sample)))
    logger.info(
        "calibration batches of %d samples: one sample's run took %.0f MiB (fetched %.0f MiB), budget %d MiB",
        size,
        per_sample / 2**20,
        fetched / max(probe.size, 1) / 2**20,
        budget >> 20,
    )
    if size == DEFAULT_BATCH:
        return size, _samples(size)
    return size, f"{_samples(size)}, sized to --batch-memory {budget >> 20} MiB at {per_sample / 2**20:.0f} MiB each"


def _samples(n: int) -> str:
    return f"{n} sample" + ("" if n == 1 else "s")


def _batched_inputs(model: ir.Model) -> bool:
    """Whether every input has a dynamic first axis, so that a run of one sample is a smaller batch."""
    specs = input_specs(model)
    return bool(specs) and all(s.rank > 0 and s.shape[0] is None for s in specs)
