"""Smoothing of activation outliers into the weights (SmoothQuant, Xiao et al. 2023, migrated to FP8).

A few input channels of an LLM's activations carry values 10-100x the others, and a per-tensor
scale sized for them leaves the rest with few grid points. Per input channel k of a quantized
MatMul/Gemm, ``s_k = amax_x[k]^alpha / amax_w[k]^(1 - alpha)`` (``amax_w[k]``: the largest |w| in
row k of the weight, over every layer reading that activation) moves range from the activation into
the weights: ``x' = x / s`` and ``W' = diag(s) W`` compute the same product. ``1/s`` is folded into
the producer where one exists: the scale (and bias) of a LayerNormalization or of ORT's
SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (RMSNorm) whose weights nothing else
reads, or the output columns of a preceding MatMul/Gemm weight (and bias), also through an Add of a
per-channel constant or a Mul (SwiGLU's ``silu(gate) * up`` folds into ``up``); elsewhere a ``Mul``
by ``1/s`` is inserted. The per-channel amax of each activation comes
from one streaming pass over the calibration data (in the graph, memory flat in sample count).

Only activations that feed MatMul/Gemm as input A (reduction over the last axis, no ``transA``) and
whose every quantized reader has a constant weight are smoothed.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph import known
from fp8onnx.graph.plan import Decision, in_main_graph
from fp8onnx.passes.instrument import scaled
from fp8onnx.pipeline.statistics import F32, Statistic, Sums
from fp8onnx.techniques.base import Technique

__all__ = ["Smoothing"]

logger = logging.getLogger(__name__)
_SHAPE_ONLY = ("Shape", "Size")  # readers that see a tensor's shape, not its values
_NORMS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def _groups(decisions: list[Decision], model: ir.Model) -> dict[str, tuple[ir.Value, list[ir.Node]]]:
    """activation name -> (value, the MatMul/Gemm nodes reading it as A with a constant weight)."""
    groups: dict[str, tuple[ir.Value, list[ir.Node]]] = {}
    bad = set()
    for d in decisions:
        node, kinds = d.node, dict(d.inputs)
        x = node.inputs[0]
        if x is None or node.op_type not in ("MatMul", "Gemm") or not in_main_graph(x, model):
            continue
        ok = kinds.get(1) == "weight" and not (node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0)
        w = known.required_input(node, 1) if ok else None
        ok = ok and x.shape is not None and w is not None and len(known.value_shape(w)) == 2  # K from w, not x
        if not ok:
            bad.add(known.name(x))
        groups.setdefault(known.name(x), (x, []))[1].append(node)
    for name in bad:
        groups.pop(name, None)
    return groups


def _weight_rows(node: ir.Node) -> np.ndarray:
    """|W| max per input row k, for y = x W (a transposed Gemm weight is [N, K])."""
    w = np.abs(known.constant(known.required_input(node, 1)).numpy().astype(np.float32))
    return w.max(axis=0) if node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0 else w.max(axis=1)


def _scale_weight(node: ir.Node, s: np.ndarray) -> None:
    w_value = known.required_input(node, 1)
    w = known.constant(w_value).numpy()
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0
    scaled = w * (s[None, :] if transposed else s[:, None]).astype(w.dtype)
    w_value.const_value = ir.tensor(scaled.astype(w.dtype), name=w_value.name)


def _fold_into_norm(x: ir.Value, inv: np.ndarray) -> bool:
    """Fold ``x * inv`` into the norm producing ``x`` (output 0), if its weights are its own."""
    producer = x.producer()
    if producer is None or producer.op_type not in _NORMS or producer.outputs[0] is not x:
        return False
    if producer.attributes.get_int("axis", -1) not in (-1, len(known.value_shape(x)) - 1):
        return False
    index = 2 if producer.op_type == "SkipSimplifiedLayerNormalization" else 1
    params = [producer.inputs[index]]
    if producer.op_type == "LayerNormalization" and len(producer.inputs) > 2 and producer.inputs[2] is not None:
        params.append(producer.inputs[2])
    own = [p for p in params if p is not None and p.const_value is not None and len(list(p.uses())) == 1]
    if len(own) != len(params):
        return False
    for p in own:
        values = known.constant(p).numpy()
        p.const_value = ir.tensor((values * inv.astype(values.dtype)).astype(values.dtype), name=p.name)
    return True


def _only_reader(value: ir.Value, node: ir.Node) -> bool:
    """``node`` is the only reader of ``value``'s numbers (Shape/Size read only its shape)."""
    return not value.is_graph_output() and all(u.node is node or u.node.op_type in _SHAPE_ONLY for u in value.uses())


def _channel_const(value: ir.Value | None, node: ir.Node, k: int) -> bool:
    """A constant read only by ``node`` that varies along the last axis only ([k] or [1, ..., k])."""
    if value is None or value.const_value is None or not value.is_initializer() or not _only_reader(value, node):
        return False
    shape = list(value.const_value.shape)
    return bool(shape) and shape[-1] == k and all(d == 1 for d in shape[:-1])


def _times(value: ir.Value, factor: np.ndarray, axis: int = -1) -> None:
    """Multiply a constant in place by ``factor`` along ``axis``."""
    values = known.constant(value).numpy()
    shape = [1] * values.ndim
    shape[axis] = -1
    value.const_value = ir.tensor(
        (values * factor.reshape(shape).astype(values.dtype)).astype(values.dtype), name=value.name
    )


def _fold(x: ir.Value, inv: np.ndarray, per_channel, depth: int = 0) -> str | None:
    """Fold ``x * inv`` (per channel of the last axis) into what computes ``x``: the weights of a
    norm, the columns of a MatMul/Gemm weight (and its bias), through an Add of a per-channel constant
    or a Mul (SwiGLU's ``silu(gate) * up``: into ``up``'s columns). Returns what it was folded into,
    or None with nothing changed."""
    producer = x.producer()
    if producer is None or producer.outputs[0] is not x or depth > 4:
        return None
    op, k = producer.op_type, len(inv)
    where = f"{op} {producer.name!r}"
    if op in _NORMS:
        return where if _fold_into_norm(x, inv) else None
    if producer.domain not in ("", "ai.onnx"):
        return None
    if op in ("MatMul", "Gemm") and len(producer.inputs) >= 2:
        if not per_channel(producer):  # 1/s per column would widen a per-tensor weight's range
            return None
        w = producer.inputs[1]
        if w is None or w.const_value is None or not w.is_initializer() or not _only_reader(w, producer):
            return None
        if len(w.const_value.shape) != 2 or (op == "Gemm" and producer.attributes.get_int("transA", 0) != 0):
            return None
        axis = 0 if op == "Gemm" and producer.attributes.get_int("transB", 0) != 0 else 1
        if w.const_value.shape[axis] != k:
            return None
        bias = producer.inputs[2] if op == "Gemm" and len(producer.inputs) > 2 else None
        if bias is not None and not _channel_const(bias, producer, k):
            return None
        _times(w, inv, axis)
        if bias is not None:
            _times(bias, inv)
        return f"the columns of {where}"
    if op in ("Add", "Mul") and len(producer.inputs) == 2:
        a, b = producer.inputs
        for const, other in ((a, b), (b, a)):
            if const is None or other is None or other.const_value is not None:
                continue
            if _channel_const(const, producer, k):
                if op == "Mul":  # (v * c) / s = v * (c / s)
                    _times(const, inv)
                    return where
                inner = _fold(other, inv, per_channel, depth + 1) if _only_reader(other, producer) else None
                if inner:  # (v + c) / s = v / s + c / s
                    _times(const, inv)
                    return f"{inner} through {where}"
                return None
        if op == "Mul" and a is not None and b is not None and a is not b and a.const_value is None:
            for v in (b, a):  # (u * v) / s = u * (v / s)
                inner = (
                    _fold(v, inv, per_channel, depth + 1)
                    if v.const_value is None and _only_reader(v, producer)
                    else None
                )
                if inner:
                    return f"{inner} through {where}"
    return None


def _amax_per_channel(x: ir.Value, add) -> list[ir.Value]:
    axes = np.array(list(range(len(known.value_shape(x)) - 1)), np.int64)
    x32 = add("Cast", [add("Abs", [x], "abs")], "f32", to=int(F32))
    return [add("ReduceMax", [x32, axes], "amax", dtype=F32, keepdims=0)]


class Smoothing(Technique):
    """Smooth every eligible activation (module docstring). ``per_channel(node)``: whether a
    MatMul/Gemm's weight is quantized per output channel (or not at all); only such a producer takes
    ``1/s`` into its columns, since per column it would widen a per-tensor weight's range.

    requires: calibration data (the per-channel amax of each activation), measured before the
    activation ranges. ensures: the model computes the same function up to float rounding; each
    smoothed activation's readers read ``x / s``."""

    name = "smoothing"
    option = "--smooth"
    needs = "the per-channel amax of each activation"
    before_scales = True

    def __init__(self, model: ir.Model, decisions: list[Decision], alpha: float, per_channel=lambda node: True):
        if not 0 <= alpha <= 1:
            raise Fp8OnnxError(f"--smooth must be in [0, 1], got {alpha!r}.")
        self.model, self.alpha, self.per_channel = model, alpha, per_channel
        self.groups = _groups(decisions, model)
        builders = dict.fromkeys(self.groups, _amax_per_channel)
        self.amax = Sums(builders, "channel amax", combine=np.maximum) if builders else None
        self.done: dict[str, str] = {}  # activation name -> how (``"folded into <norm>"`` or ``"Mul inserted"``)

    def statistics(self) -> list[Statistic]:
        return [self.amax] if self.amax else []

    def apply(self, quant=None) -> str | None:
        done = self.smooth()
        folded = sum(how.startswith("folded") for how in done.values())
        return (
            f"smoothed {len(done)} activations into their weights (alpha {self.alpha:g}; {folded} folded "
            "into the norm or MatMul that computes them)"
        )

    def smooth(self) -> dict[str, str]:
        if self.amax is None:
            return {}
        model, alpha, amax, done = self.model, self.alpha, self.amax.result, self.done
        for name, (x, nodes) in self.groups.items():
            ax = amax[name][0]
            aw = np.max([_weight_rows(n) for n in nodes], axis=0)
            s = np.where((ax > 0) & (aw > 0), ax**alpha / np.maximum(aw, 1e-12) ** (1 - alpha), 1.0)
            s = np.clip(s, 1e-5, 1e5)  # a dead channel keeps s = 1
            for node in nodes:
                _scale_weight(node, s)
            inv = (1.0 / s).astype(np.float32)
            readers = {id(u.node) for u in x.uses() if u.node.op_type not in _SHAPE_ONLY}
            only_group = readers == {id(n) for n in nodes} and not x.is_graph_output()
            folded = _fold(x, inv, self.per_channel) if only_group else None  # no other reader sees x / s
            if folded:
                done[name] = f"folded into {folded}"
                continue
            scaled(model.graph, x, inv, name, nodes)
            done[name] = "Mul inserted"
        logger.info("smoothed %d activations (alpha %g)", len(done), alpha)
        return done
