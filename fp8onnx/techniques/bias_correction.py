"""Bias correction: remove the mean output shift that FP8 weights introduce (Nagel et al., 2019).

For y = x W + b, rounding W to ``Wq`` shifts the output's mean by ``E[x] (Wq - W)``; adding
``E[x] (W - Wq)`` to the bias cancels it on the calibration data's mean input. ``E[x]`` per input
channel is measured in the graph in one pass over the calibration data (only one vector per layer
leaves onnxruntime: a :class:`~fp8onnx.pipeline.statistics.Sums`). Applies to Gemm (input C), MatMul followed by an
Add of a 1-D constant (the bias ORT fuses), and Conv with a bias (group 1 or grouped); the
correction of a Conv is ``sum over c, kh, kw of E[x_c] (W - Wq)[o, c, kh, kw]`` (padding ignored).
Layers without a bias, or whose bias another node also reads, are left as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from fp8onnx.graph import known
from fp8onnx.graph.plan import Decision, in_main_graph
from fp8onnx.passes import TensorQuant, bias_of
from fp8onnx.pipeline.statistics import F32, Statistic, Sums
from fp8onnx.techniques.base import Technique, stored_values

__all__ = ["BiasCorrection"]

logger = logging.getLogger(__name__)


def _bias(node: ir.Node) -> tuple[ir.Node, int] | None:
    if node.op_type == "Conv":
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is None or bias.const_value is None:
            return None
        return (node, 2) if len(known.value_shape(bias)) == 1 else None
    return bias_of(node)


def _channel_axis(node: ir.Node, rank: int) -> int:
    return 1 if node.op_type == "Conv" else rank - 1


def _shift(node: ir.Node, w: np.ndarray, wq: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """E[x] (W - Wq): the bias change, shape [N] (outputs)."""
    delta = (w - wq).astype(np.float64)
    if node.op_type == "Conv":  # [O, C/g, k...]: group g's outputs read its block of input channels
        groups = node.attributes.get_int("group", 1)
        per = delta.shape[1]
        means = mean.reshape(groups, per)
        spatial = delta.reshape(delta.shape[0], per, -1).sum(axis=2)  # [O, C/g]
        group_of = np.arange(delta.shape[0]) // (delta.shape[0] // groups)
        return (spatial * means[group_of]).sum(axis=1)
    if node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0:
        delta = delta.T
    return mean @ delta  # [K] @ [K, N]


class BiasCorrection(Technique):
    """Shift the bias of each quantized layer with a constant bias by ``E[x] (W - Wq)``, ``W`` the
    float weight and ``Wq`` the weight as it will be stored (GPTQ's rounding where it ran, else the
    nearest grid value of its final scales). Runs after any change of the weights themselves,
    before the biases are reshaped or quantized.

    requires: calibration data (each layer's mean input). ensures: each corrected layer's output
    mean on that data equals the float layer's, up to rounding."""

    name = "bias correction"
    option = "--bias-correction"
    needs = "the mean input of each layer"

    def __init__(self, model: ir.Model, decisions: list[Decision], originals: dict | None = None):
        self.model = model
        self.originals = {} if originals is None else originals  # weight name -> float values (GPTQ's)
        self.layers: list[tuple[ir.Node, ir.Value, ir.Value, tuple[ir.Node, int]]] = []
        for d in decisions:
            node, kinds = d.node, dict(d.inputs)
            holder = _bias(node)
            x = node.inputs[0]
            if kinds.get(1) != "weight" or holder is None:
                continue
            w = known.required_input(node, 1)
            if w.const_value is None or (node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0):
                continue
            bias = known.required_input(*holder)
            if len(list(bias.uses())) != 1 or x is None or x.shape is None or not in_main_graph(x, model):
                continue
            self.layers.append((node, x, w, holder))
        builders: dict[str, Callable[[ir.Value, Callable], list[ir.Value]]] = {}
        for node, x, _, _ in self.layers:
            builders.setdefault(known.name(x), _mean_of(node))
        self.means = Sums(builders, "input means") if builders else None

    def statistics(self) -> list[Statistic]:
        return [self.means] if self.means else []

    def apply(self, quant: dict[str, TensorQuant]) -> str | None:
        corrected = self.correct(quant)
        return f"bias correction of {len(corrected)} layers (mean input from the calibration data)"

    def correct(self, quant: dict[str, TensorQuant]) -> list[str]:
        """Returns the names of the layers corrected."""
        if self.means is None:
            return []
        sums = self.means.result
        corrected = []
        for node, x, w, (holder, index) in self.layers:
            name = known.name(w)
            if name not in quant or not quant[name].format.deployable:
                continue
            total, size = sums[known.name(x)]
            mean = total / (float(size) / total.shape[0])
            stored = known.constant(w).numpy().astype(np.float32)  # GPTQ's rounding, if it ran: on the grid
            original = self.originals.get(name)
            weight = stored if original is None else original.numpy().astype(np.float32)
            shift = _shift(node, weight, stored_values(stored, quant[name]), mean)
            bias = known.required_input(holder, index)
            values = known.constant(bias).numpy()
            bias.const_value = ir.tensor((values.astype(np.float64) + shift).astype(values.dtype), name=bias.name)
            corrected.append(known.name(node))
        logger.info("bias correction shifted %d biases", len(corrected))
        return corrected


def _mean_of(node: ir.Node):
    """In-graph sum over every axis but the channel axis, and the element count."""

    def build(x: ir.Value, add) -> list[ir.Value]:
        rank = len(known.value_shape(x))
        axis = _channel_axis(node, rank)
        axes = np.array([i for i in range(rank) if i != axis], np.int64)
        x32 = add("Cast", [x], "f32", to=int(F32))
        total = add("ReduceSum", [x32, axes], "sum", dtype=F32, keepdims=0)
        return [total, add("Size", [x], "size", dtype=ir.DataType.INT64, shape=[])]

    return build
