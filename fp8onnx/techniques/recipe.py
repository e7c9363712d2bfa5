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

from fp8onnx.config import QuantizeConfig
from fp8onnx.errors import Fp8OnnxError
from fp8onnx.graph.plan import Decision
from fp8onnx.pipeline.calibration import Stats, ranges_stats
from fp8onnx.pipeline.statistics import Ranges, measure
from fp8onnx.runtime import RunOptions
from fp8onnx.techniques.base import Technique, stored_values
from fp8onnx.techniques.bias_correction import BiasCorrection
from fp8onnx.techniques.gptq import GPTQ
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
        return techniques
    originals = None
    if config.weight_rounding == "gptq":
        techniques.append(GPTQ(model, decisions))
        originals = techniques[-1].originals
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
    measuring = isinstance(ranges, Ranges)
    if not statistics and not measuring:
        return ranges
    what = ", ".join((["activation ranges"] if measuring else []) + [t.name for t in techniques if t.statistics()])
    logger.info("one pass over the calibration data for %s", what)
    done = measure(model, ([ranges] if measuring else []) + statistics, data, run, "calibration", settle, sequential)
    return ranges_stats(ranges, done) if measuring else ranges


def settling(decisions: list[Decision], quant: dict, techniques: list[Technique], sequential: bool):
    """(the quantized layers' node names, ``settle``) for a layer-by-layer pass, or None where
    nothing needs it; ``quant``: the weights' TensorQuant (their scales come from the weights alone).

    ``settle(node names, statistic outputs measured so far)`` is called after each segment. With
    ``sequential`` it rounds the weights of the quantized layers among those nodes as they will be
    stored (GPTQ's rounding once its X^T X is measured, else the nearest value on their grid) and
    returns them by name, for the segments after them to read. Otherwise it has GPTQ round every
    weight whose X^T X is complete, so that the sums of a segment are dropped once it has run."""

    gptq = next((t for t in techniques if isinstance(t, GPTQ) and t.targets), None)
    layers = {
        d.node.name: [d.node.inputs[i] for i, kind in d.inputs if kind == "weight"]
        for d in decisions
        if any(kind == "weight" for _, kind in d.inputs)
    }
    if not sequential:
        if gptq is None:
            return None
        return list(layers), lambda names, measured: gptq.round_ready(quant, measured, last_when_written=True) or {}
    done: set[str] = set()

    def settle(names: list[str], measured: set[str]) -> dict:
        stored = {}
        for weight in (w for name in names for w in layers.get(name, ())):
            if weight.name in done or weight.name not in quant:
                continue
            rounded = gptq.round_now(quant, weight.name, measured) if gptq is not None else False
            if rounded is None:
                continue  # its X^T X is still to come
            if rounded is False:
                w = weight.const_value.numpy()
                rounded = ir.tensor(stored_values(w, quant[weight.name]).astype(w.dtype), name=weight.name)
            stored[weight.name] = rounded
            done.add(weight.name)
        return stored

    return list(layers), settle
