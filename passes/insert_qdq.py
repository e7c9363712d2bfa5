"""Insert float8 QuantizeLinear/DequantizeLinear on chosen inputs of MatMul/Gemm (or any) nodes.

Which node inputs to quantize, in which format and with which scale, is decided before this pass
(see ``fp8onnx.quantize``); this pass only rewrites the graph.

Rewrite cases, for a target ``(node, input index)`` whose input is tensor ``t``:
  ``t`` is a float initializer (a weight) -> a float8 initializer ``fp8onnx/t/fp8`` (computed lazily,
      when the model is saved) followed by DequantizeLinear, per tensor or per channel (``axis``);
      no QuantizeLinear at run time. The float initializer is removed once nothing else reads it.
  ``t`` is computed at run time (an activation) -> QuantizeLinear -> DequantizeLinear, one pair per
      tensor, shared by all of its quantized consumers. The scale is a constant (static, from
      calibration) or computed in the graph from the batch's absolute max (dynamic, FP8-AMAX):
      ``Clip(Where(s == s, s, safe), tiny, huge)`` with ``s = ReduceMax(Abs(t)) / fmax``, so an
      all-zero, NaN or Inf batch never yields a zero, NaN or Inf scale.
  the format is emulated (E3M4, no ONNX type) -> no Q/DQ: weights are stored already rounded to the
      grid (in float), activations go through float ops that round to the grid
      (:func:`emulated_rounding`); bit for bit the same values as ml_dtypes' cast.
  ``t`` already comes from a DequantizeLinear or from this pass -> unchanged (idempotence).

New nodes go where ``t`` is defined (after its producer, or first in the graph owning it), so one
pair serves consumers in the main graph and in If/Loop/Scan bodies alike; scales and float8
weights are initializers of the main graph, visible from every subgraph.

QuantizeLinear carries ``output_dtype`` and no zero point (opset 21): with a zero point,
onnxruntime's ReluQuantRewrite would delete a Relu in front of it (see ``upgrade_opset``).
Scales have the tensor's own float type, so DequantizeLinear gives back the type the consumer had.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from ..numerics.formats import Fp8Format, dequantize, quantize
from ..numerics.scaling import SAFE_AMAX, amax_to_scale, expand_blocks
from ._common import derived_tensor, initializer, insert_at_definition

__all__ = [
    "NODE_PREFIX",
    "InsertQDQPass",
    "QDQResult",
    "TensorQuant",
    "emulated_rounding",
    "is_quantized",
    "scale_array",
]

logger = logging.getLogger(__name__)
NODE_PREFIX = "fp8onnx/"
_F32 = ir.DataType.FLOAT


@dataclasses.dataclass(frozen=True, eq=False)
class TensorQuant:
    """How one tensor is quantized.

    ``scale``: a float (per tensor), a 1-D array (per channel along ``axis``, weights only), or
    None for a dynamic scale computed in the graph (activations only): per tensor, or with
    ``axis=-1`` one per row (token), the amax over the last axis. With ``block_size`` (weights
    only), ``scale`` has the weight's shape with ``axis`` cut into blocks of that many elements
    (the last may be shorter): one scale per block (opset 21 DequantizeLinear's ``block_size``).
    A dynamic scale with ``block_size``: one per row and per ``block_size`` channels (per group).
    ``pow2``: the dynamic scales rounded up to powers of two in the graph (MX-style, E8M0 values).
    """

    format: Fp8Format
    scale: float | np.ndarray | None
    axis: int | None = None
    block_size: int = 0
    pow2: bool = False  # a dynamic scale (``scale`` None) rounded up to a power of two in the graph

    def full_scale(self, shape) -> np.ndarray:
        """The scale as a float32 array broadcasting against a weight of ``shape``: one per element
        with blocks, one per channel along ``axis``, or a scalar."""
        scale = np.asarray(self.scale, np.float32)
        if self.block_size:
            return expand_blocks(scale, shape, self.axis % len(shape), self.block_size)
        if self.axis is not None:
            return scale.reshape([-1 if i == self.axis % len(shape) else 1 for i in range(len(shape))])
        return scale


def is_quantized(value: ir.Value) -> bool:
    """True if ``value`` was produced by a DequantizeLinear or by this pass."""
    producer = value.producer()
    return value.name.startswith(NODE_PREFIX) or (producer is not None and producer.op_type == "DequantizeLinear")


def scale_array(scale, dtype: ir.DataType) -> np.ndarray:
    """The scale in the tensor's float type, kept finite and positive in that type."""
    lo, hi = _scale_range(dtype)
    return np.asarray(np.clip(np.asarray(scale, np.float64), lo, hi), dtype=dtype.numpy())


def _scale_range(dtype: ir.DataType) -> tuple[float, float]:
    np_dtype = dtype.numpy()
    info = np.finfo(np.float32) if np_dtype == np.dtype("bfloat16") else np.finfo(np_dtype)
    return float(info.smallest_normal), float(info.max)


class _Builder:
    """Adds nodes and constants to one graph, with names under ``fp8onnx/``."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.nodes: list[ir.Node] = []

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return initializer(self.graph, f"{NODE_PREFIX}{name}", array)

    def op(self, op_type: str, inputs, name: str, dtype: ir.DataType | None = None, shape=None, **attrs) -> ir.Value:
        node = ir.node(op_type, inputs, attrs or None, name=f"{NODE_PREFIX}{name}")
        out = node.outputs[0]
        out.name = f"{NODE_PREFIX}{name}"
        out.dtype = dtype
        out.shape = shape
        self.nodes.append(node)
        return out

    def cast(self, value: ir.Value, to: ir.DataType, name: str) -> ir.Value:
        return value if value.dtype == to else self.op("Cast", [value], name, to, value.shape, to=int(to))

    def take(self) -> list[ir.Node]:
        nodes, self.nodes = self.nodes, []
        return nodes


def emulated_rounding(b: _Builder, x: ir.Value, scale: ir.Value, fmt: Fp8Format, prefix: str) -> ir.Value:
    """Float ops computing ``dequantize(quantize(x, scale, fmt), scale)`` for a format without an ONNX type.

    v = clip(x / scale, +-fmax); e = max(floor(log2|v|), emin), corrected by one where log2 rounding
    missed an exact power of two; step = 2**(e - mantissa bits); round half to even on that step.
    """

    def op(op_type: str, inputs, name: str, dtype: ir.DataType = _F32, **attrs) -> ir.Value:
        return b.op(op_type, inputs, f"{prefix}/{name}", dtype, x.shape, **attrs)

    def const(name: str, value: float) -> ir.Value:
        return b.const(f"const/{name}", np.array(value, np.float32))

    def as_float(flag: ir.Value, name: str) -> ir.Value:
        return op("Cast", [flag], name, to=int(_F32))

    xf, sf = b.cast(x, _F32, f"{prefix}/x_f32"), b.cast(scale, _F32, f"{prefix}/scale_f32")
    two = const("two", 2.0)
    v = op("Div", [xf, sf], "scaled")
    v = op("Clip", [v, const(f"{fmt.value}/-fmax", -fmt.fmax), const(f"{fmt.value}/fmax", fmt.fmax)], "saturated")
    a = op("Abs", [v], "abs")
    e0 = op("Floor", [op("Mul", [op("Log", [a], "ln"), const("inv_ln2", 1 / math.log(2))], "log2")], "e0")
    p = op("Pow", [two, e0], "p")
    too_big = as_float(op("Greater", [p, a], "p_gt_a", ir.DataType.BOOL), "dec")
    too_small = as_float(op("LessOrEqual", [op("Mul", [p, two], "2p"), a], "2p_le_a", ir.DataType.BOOL), "inc")
    e = op("Sub", [op("Add", [e0, too_small], "e1"), too_big], "e2")
    e = op("Max", [e, const(f"{fmt.value}/emin", fmt.min_normal_exponent)], "e")
    step = op("Pow", [two, op("Sub", [e, const(f"{fmt.value}/mbits", fmt.mantissa_bits)], "e_step")], "step")
    q = op("Mul", [op("Round", [op("Div", [v, step], "units")], "rounded"), step], "grid")
    y = op("Mul", [q, sf], "emulated_f32")
    return b.cast(y, x.dtype, f"{prefix}/emulated")


def _power_of_two_above(b: _Builder, s: ir.Value, prefix: str) -> ir.Value:
    """The smallest power of two >= ``s`` (float32, positive), exactly: ``2^ceil(log2 s)`` from Log, then
    one step down or up where Log's rounding put the exponent one off (at exact powers of two)."""
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    shape = s.shape
    log2 = b.op("Mul", [b.op("Log", [s], f"{prefix}/ln", _F32, shape), b.const("const/inv_ln2", f32(1 / np.log(2)))],
                f"{prefix}/log2", _F32, shape)  # fmt: skip
    p = b.op("Pow", [b.const("const/two", f32(2.0)), b.op("Ceil", [log2], f"{prefix}/exponent", _F32, shape)],
             f"{prefix}/pow2_guess", _F32, shape)  # fmt: skip
    below = b.op("Less", [p, s], f"{prefix}/pow2_below", ir.DataType.BOOL, shape)
    p = b.op("Where", [below, b.op("Add", [p, p], f"{prefix}/pow2_double", _F32, shape), p],
             f"{prefix}/pow2_up", _F32, shape)  # fmt: skip
    half = b.op("Mul", [p, b.const("const/half", f32(0.5))], f"{prefix}/pow2_half", _F32, shape)
    enough = b.op("GreaterOrEqual", [half, s], f"{prefix}/pow2_half_enough", ir.DataType.BOOL, shape)
    return b.op("Where", [enough, half, p], f"{prefix}/pow2", _F32, shape)


def _dynamic_scale(
    b: _Builder, x: ir.Value, fmt: Fp8Format, prefix: str, per_token: bool = False, pow2: bool = False
) -> ir.Value:
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    abs_x = b.op("Abs", [x], f"{prefix}/abs", x.dtype, x.shape)
    if per_token:  # [..., K] -> [..., 1]: one scale per row
        last = b.const("const/axes_last", np.array([-1], np.int64))
        amax = b.op("ReduceMax", [abs_x, last], f"{prefix}/amax", x.dtype, None, keepdims=1)
    else:
        amax = b.op("ReduceMax", [abs_x], f"{prefix}/amax", x.dtype, ir.Shape([]), keepdims=0)
    shape = amax.shape
    s = b.op(
        "Mul",
        [b.cast(amax, _F32, f"{prefix}/amax_f32"), b.const(f"const/{fmt.value}/inv_fmax", f32(1 / fmt.fmax))],
        f"{prefix}/raw_scale",
        _F32,
        shape,
    )
    is_number = b.op("Equal", [s, s], f"{prefix}/not_nan", ir.DataType.BOOL, shape)
    s = b.op(
        "Where",
        [is_number, s, b.const(f"const/{fmt.value}/safe_scale", f32(amax_to_scale(SAFE_AMAX, fmt)))],
        f"{prefix}/finite_scale",
        _F32,
        shape,
    )
    if pow2:  # the smallest power of two at least amax / fmax: E8M0-representable, no element clipped
        s = _power_of_two_above(b, s, prefix)
    lo, hi = _scale_range(x.dtype)
    same = x.dtype == _F32
    s = b.op(
        "Clip",
        [s, b.const(f"const/scale_min/{x.dtype.name}", f32(lo)), b.const(f"const/scale_max/{x.dtype.name}", f32(hi))],
        f"{prefix}/scale" if same else f"{prefix}/scale_f32",
        _F32,
        shape,
    )
    return s if same else b.cast(s, x.dtype, f"{prefix}/scale")


def _rows_rounded(b: _Builder, x: ir.Value, scale: ir.Value, fmt: Fp8Format, prefix: str, out: str) -> ir.Value:
    """``x / scale`` cast to ``fmt`` (saturating), back to ``x``'s type, times ``scale``: exactly
    QuantizeLinear/DequantizeLinear's values for a per-row ``scale`` (which is not a per-axis Q/DQ),
    in ops every EP runs. Nodes ``<prefix>_scaled``, ``_fp8``, ``_float`` and ``out``."""
    scaled = b.op("Div", [x, scale], f"{prefix}_scaled", x.dtype, x.shape)
    q = b.op("Cast", [scaled], f"{prefix}_fp8", fmt.ir_type, x.shape, to=int(fmt.onnx_type), saturate=1)
    return b.op("Mul", [b.cast(q, x.dtype, f"{prefix}_float"), scale], out, x.dtype, x.shape)


MIN_OPSET = 21  # QuantizeLinear with output_dtype (float8 without a zero point)


@dataclasses.dataclass
class QDQResult(ir.passes.PassResult):
    dequantized: dict[str, ir.Value] = dataclasses.field(default_factory=dict)  # weight name -> what reads it now


class InsertQDQPass(ir.passes.InPlacePass):
    """requires: default opset >= 21; every target is a node of the model with a float input of known
    dtype at that index and a TensorQuant for it. ensures: every target input is read from a
    DequantizeLinear (or, for an emulated format, from the grid-rounding ops or a rounded weight)."""

    def __init__(self, targets: Iterable[tuple[ir.Node | str, int]], quant: Mapping[str, TensorQuant]):
        """``targets``: (node or node name, input index) pairs, in the main graph or in subgraphs;
        ``quant``: tensor name -> TensorQuant."""
        super().__init__()
        self.targets = list(targets)
        self.quant = dict(quant)

    def _resolved(self, model: ir.Model) -> list[tuple[ir.Node, int]]:
        nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
        by_name = {n.name: n for n in nodes}
        present = set(map(id, nodes))
        out = []
        for node, index in self.targets:
            found = by_name.get(node) if isinstance(node, str) else (node if id(node) in present else None)
            if found is None:
                raise ir.passes.PreconditionError(f"target node {getattr(node, 'name', node)!r} is not in the model")
            out.append((found, index))
        return out

    def requires(self, model: ir.Model) -> None:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset < MIN_OPSET:
            raise ir.passes.PreconditionError(
                f"default opset {opset} < {MIN_OPSET}: float8 QuantizeLinear needs output_dtype (run UpgradeOpsetPass)"
            )
        for node, index in self._resolved(model):
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is None:
                raise ir.passes.PreconditionError(f"node {node.name!r} has no input {index}")
            if not is_quantized(value):
                if value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
                    raise ir.passes.PreconditionError(f"input {value.name!r} of {node.name!r} is {value.dtype}")
                if value.name not in self.quant:
                    raise ir.passes.PreconditionError(f"no TensorQuant for tensor {value.name!r}")

    def ensures(self, model: ir.Model) -> None:
        for node, index in self._resolved(model):
            value = node.inputs[index]
            emulated = value.name.startswith(NODE_PREFIX)  # grid-rounding ops or a rounded weight
            if not (is_quantized(value) or emulated):
                raise ir.passes.PostconditionError(f"input {index} of {node.name!r} is not quantized")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        wanted: dict[ir.Node | str, set[int]] = {}
        for node, index in self.targets:
            wanted.setdefault(node, set()).add(index)
        builder = _Builder(graph)  # constants live in the main graph, visible from every subgraph
        replaced: dict[str, ir.Value] = {}  # tensor name -> what its quantized consumers read
        weights: list[str] = []
        rewired = 0
        for node in list(ir.traversal.RecursiveGraphIterator(graph)):
            for index in sorted(wanted.get(node, set()) | wanted.get(node.name, set())):
                value = node.inputs[index]
                if value is None or is_quantized(value):
                    continue
                new = replaced.get(value.name)
                if new is None:
                    tq = self.quant[value.name]
                    if value.const_value is not None and value.is_initializer():
                        new = self._weight(builder, value, tq)
                        weights.append(value.name)
                    else:
                        new = self._activation(builder, value, tq)
                    insert_at_definition(value, builder.take())
                    replaced[value.name] = new
                node.replace_input_with(index, new)
                rewired += 1
        for name in replaced:
            value = graph.initializers.get(name)
            if value is not None and not value.uses() and not value.is_graph_output() and not value.is_graph_input():
                del graph.initializers[name]
        if rewired:
            logger.info("quantized %d node inputs (%d tensors)", rewired, len(replaced))
        dequantized = {name: replaced[name] for name in weights}
        return QDQResult(model, modified=bool(rewired), dequantized=dequantized)

    def _weight(self, b: _Builder, value: ir.Value, tq: TensorQuant) -> ir.Value:
        source = value.const_value
        scale = scale_array(tq.scale, value.dtype)
        scale32 = dataclasses.replace(tq, scale=scale).full_scale(list(source.shape)).astype(np.float32)
        if not tq.format.deployable:
            name = f"{NODE_PREFIX}{value.name}/{tq.format.value}_emulated"
            tensor = derived_tensor(
                source,
                lambda w: dequantize(quantize(w, scale32, tq.format), scale32, value.dtype.numpy()),
                value.dtype,
                source.shape,
                name,
            )
            return initializer(b.graph, name, tensor)
        name = f"{NODE_PREFIX}{value.name}/fp8"
        q_value = initializer(
            b.graph,
            name,
            derived_tensor(source, lambda w: quantize(w, scale32, tq.format), tq.format.ir_type, source.shape, name),
        )
        scale_value = b.const(f"{value.name}/scale", scale)
        attrs = {} if tq.axis is None else {"axis": int(tq.axis)}
        if tq.block_size:
            attrs["block_size"] = int(tq.block_size)
        return b.op(
            "DequantizeLinear", [q_value, scale_value], f"{value.name}/dequantized", value.dtype, value.shape, **attrs
        )

    def _activation(self, b: _Builder, value: ir.Value, tq: TensorQuant) -> ir.Value:
        name = value.name
        if tq.scale is None and tq.block_size and tq.format.deployable:
            grouped = self._per_group(b, value, tq)
            if grouped is not None:
                return grouped
            tq = dataclasses.replace(tq, block_size=0)  # channels unknown or not a multiple: per row
        per_token = tq.scale is None and tq.axis is not None
        if tq.scale is None:
            scale = _dynamic_scale(b, value, tq.format, f"{name}/dynamic", per_token=per_token, pow2=tq.pow2)
        else:
            scale = b.const(f"{name}/scale", scale_array(tq.scale, value.dtype))
        if not tq.format.deployable:
            return emulated_rounding(b, value, scale, tq.format, f"{name}/{tq.format.value}")
        if per_token:
            # Per-row scales are not a per-axis Q/DQ; blocked QuantizeLinear would be (it runs on ORT
            # 1.32's CPU EP), but its float8 support on the CUDA EP is unverified. Div, Cast(saturate)
            # and Mul compute exactly QuantizeLinear/DequantizeLinear's values and run on both EPs.
            return _rows_rounded(b, value, scale, tq.format, f"{name}/per_token", f"{name}/dequantized")
        q = b.op(
            "QuantizeLinear",
            [value, scale],
            f"{name}/quantized",
            tq.format.ir_type,
            value.shape,
            output_dtype=int(tq.format.onnx_type),
            saturate=1,
        )
        return b.op("DequantizeLinear", [q, scale], f"{name}/dequantized", value.dtype, value.shape)

    def _per_group(self, b: _Builder, value: ir.Value, tq: TensorQuant) -> ir.Value | None:
        """One in-graph scale per row and per ``tq.block_size`` consecutive channels of the last axis:
        the rows of ``Reshape(x, [-1, G])`` are quantized per row (per token's ops), then reshaped
        back; None where the last axis is not a known multiple of G."""
        channels = value.shape[-1] if value.shape is not None and len(value.shape) else None
        group = tq.block_size
        if not isinstance(channels, int) or channels % group:
            logger.info("%r: %s channels are not groups of %d; one scale per row instead", value.name, channels, group)
            return None
        name = value.name
        groups = b.op(
            "Reshape",
            [value, b.const(f"const/groups_of_{group}", np.array([-1, group], np.int64))],
            f"{name}/groups",
            value.dtype,
            ir.Shape([None, group]),
        )
        scale = _dynamic_scale(b, groups, tq.format, f"{name}/dynamic", per_token=True, pow2=tq.pow2)
        back = _rows_rounded(b, groups, scale, tq.format, f"{name}/per_group", f"{name}/per_group")
        shape = b.op("Shape", [value], f"{name}/shape", ir.DataType.INT64)
        return b.op("Reshape", [back, shape], f"{name}/dequantized", value.dtype, value.shape)
