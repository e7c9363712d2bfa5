"""The recipe's techniques, in order, and their statistics measured in the fewest passes.

Order: smoothing first (it changes the weights and the activations that scales are then measured
on), so its statistics take a pass of their own; then one pass for the activation ranges and every
other technique's statistics together (GPTQ's X^T X, bias correction's mean inputs), all of them
of the same float model; then, once the scales are assigned, GPTQ rounds the weights and bias
correction shifts the biases by what the stored weights lost. A recipe therefore reads its data at
most twice, and once without smoothing.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph import known
from fp8onnx.graph.plan import Decision
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.pipeline.calibration import Stats, ranges_stats
from fp8onnx.pipeline.statistics import Ranges, measure
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.techniques.base import Technique, stored_values
from fp8onnx.techniques.bias_correction import BiasCorrection
from fp8onnx.techniques.gptq import GPTQ
from fp8onnx.techniques.outlier_channels import OutlierChannels
from fp8onnx.techniques.smoothing import Smoothing

__all__ = ["measure_techniques", "settling", "techniques_for"]

logger = logging.getLogger(__name__)


def techniques_for(
    config: QuantizeConfig, model: ir.Model, decisions: list[Decision], before_scales: bool
) -> list[Technique]:
    """The techniques ``config`` asks for, in the order they apply: those that change the
    activations (``before_scales``: smoothing), or the rest. Each reads the graph as it is when it is
    made, so the rest are made after the first have applied (GPTQ's X^T X is of the smoothed input)."""
    techniques: list[Technique] = []
    if before_scales:
        if config.smooth is not None:
            quantized = {id(d.node) for d in decisions if any(kind == "weight" for _, kind in d.inputs)}

            def per_channel(node):  # a producer's weight: per output channel, or not quantized at all
                return id(node) not in quantized or config.weight_per_channel(node.op_type)

            techniques.append(Smoothing(model, decisions, config.smooth, per_channel))
        if config.keep_channels:
            techniques.append(OutlierChannels(model, decisions, config.keep_channels))
        return techniques
    originals = None
    if config.weight_rounding == "gptq":
        gptq = GPTQ(model, decisions)
        techniques.append(gptq)
        originals = gptq.originals
    if config.bias_correction:
        techniques.append(BiasCorrection(model, decisions, originals))
    return techniques


def measure_techniques(
    model: ir.Model,
    techniques: list[Technique],
    data,
    run: RunOptions,
    ranges: Ranges | Stats | None = None,
    settle=None,
    sequential: bool = False,
) -> Stats | None:
    """Measure the statistics of ``techniques`` (and ``ranges``, the activation ranges when they are
    to be measured) in one pass of ``data`` through ``model``; returns the activation statistics
    (``ranges`` as they were when loaded from a file, or None).

    requires: ``data`` unless no technique needs statistics. ensures: every technique's statistics
    measured, none applied."""
    statistics = [s for t in techniques for s in t.statistics()]
    for technique in techniques:
        if technique.statistics() and data is None:
            raise Fp8OnnxError(f"{technique.option} needs --calib DATA ({technique.needs}).")
    if not isinstance(ranges, Ranges):
        if not statistics:
            return ranges
        logger.info(
            "one pass over the calibration data for %s", ", ".join(t.name for t in techniques if t.statistics())
        )
        measure(model, statistics, data, run, "calibration", settle, sequential)
        return ranges
    what = ", ".join(["activation ranges"] + [t.name for t in techniques if t.statistics()])
    logger.info("one pass over the calibration data for %s", what)
    done = measure(model, [ranges, *statistics], data, run, "calibration", settle, sequential)
    return ranges_stats(ranges, done)


def settling(decisions: list[Decision], quant: dict, techniques: list[Technique], sequential: bool):
    """(the quantized layers' node names, ``settle``) for a layer-by-layer pass, or None where
    nothing needs it; ``quant``: the weights' TensorQuant (their scales come from the weights alone).

    ``settle(node names, statistic outputs measured so far)`` is called after each segment and fires
    each technique's :meth:`~fp8onnx.techniques.base.Technique.on_segment_end`. With ``sequential`` it
    returns, by name, the weights of the quantized layers among those nodes as they will be stored (a
    technique's, e.g. GPTQ's once its X^T X is measured, else the nearest value on their grid), for the
    segments after them to read. Otherwise the techniques act alone (GPTQ rounds every weight whose X^T X
    is complete, so that the sums of a segment are dropped once it has run)."""

    layers = {
        known.name(d.node): [known.required_input(d.node, i) for i, kind in d.inputs if kind == "weight"]
        for d in decisions
        if any(kind == "weight" for _, kind in d.inputs)
    }
    if not sequential:
        if not any(t.settles for t in techniques):
            return None

        def drop_as_you_go(names: list[str], measured: set[str]) -> dict:
            for t in techniques:
                t.on_segment_end(quant, measured, [])
            return {}

        return list(layers), drop_as_you_go
    done: set[str] = set()

    def settle(names: list[str], measured: set[str]) -> dict:
        pending = [w for name in names for w in layers.get(name, ()) if w.name not in done and w.name in quant]
        settled = [t.on_segment_end(quant, measured, [known.name(w) for w in pending]) for t in techniques]
        by_technique = {name: value for s in settled for name, value in s.stored.items()}
        waiting = set().union(*(s.waiting for s in settled))  # their statistics are still to come
        stored = {}
        for weight in pending:
            name = known.name(weight)
            if name in waiting:
                continue
            rounded = by_technique.get(name)
            if rounded is None:  # no technique rounds it: the nearest value on its grid
                w = known.constant(weight).numpy()
                rounded = ir.tensor(stored_values(w, quant[name]).astype(w.dtype), name=name)
            stored[name] = rounded
            done.add(name)
        return stored

    return list(layers), settle
