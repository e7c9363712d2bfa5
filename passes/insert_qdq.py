"""Insert float8 QuantizeLinear/DequantizeLinear on chosen inputs of MatMul/Gemm (or any) nodes.

Which node inputs to quantize, in which format and with which scale, is decided before this pass
(see ``fp8onnx.quantize``); this pass only rewrites the graph.

Rewrite cases, for a node input ``(node, input index)`` whose input is tensor ``t``:
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
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from ..base.errors import Fp8OnnxError
from ..numerics.formats import Fp8Format, dequantize, quantize
from ..numerics.scaling import expand_blocks
from ._in_graph import (
    NODE_PREFIX,
    _Builder,
    _dynamic_scale,
    _rows_rounded,
    emulated_rounding,
    scale_array,
)
from .common import channels, derived_tensor, initializer, insert_at_definition
from .known import constant, required_input
from .known import dtype as dtype_of
from .known import name as name_of

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


@dataclasses.dataclass(frozen=True, eq=False)
class TensorQuant:
    """How one tensor is quantized.

    ``scale``: a float (per tensor), a 1-D array (per channel along ``axis``, weights only), or
    None for a dynamic scale computed in the graph (activations only): per tensor, or with
    ``axis=-1`` one per row (token), the amax over the last axis. With ``block_size`` (weights
    only), ``scale`` has the weight's shape with ``axis`` cut into blocks of that many elements
    (the last may be shorter): one scale per block (opset 21 DequantizeLinear's ``block_size``); a
    weight of more than two dimensions is blocked as its 2-D view [dim 0, the rest] along ``axis`` of
    that view: a Conv's [M, C/group x kernel] along 1 (``scale`` [M, blocks]), a ConvTranspose's
    [C, M/group x kernel] along 0 (``scale`` [blocks, M/group x kernel]).
    A dynamic scale with ``block_size``: one per row and per ``block_size`` channels (per group).
    ``pow2``: the dynamic scales rounded up to powers of two in the graph (MX-style, E8M0 values), or
    ``"mx"``: OCP MX's rule, 2^(floor(log2 amax) - emax of the format), values above fmax saturating.
    """

    format: Fp8Format
    scale: float | np.ndarray | None
    axis: int | None = None
    block_size: int = 0
    pow2: bool | str = False  # a dynamic scale (``scale`` None) as a power of two in the graph: True up, "mx" OCP

    @property
    def block_axis(self) -> int:
        """``axis`` of a block-scaled tensor (which must have one)."""
        if self.axis is None:
            raise Fp8OnnxError(f"A block-scaled TensorQuant (block_size {self.block_size}) has no axis.")
        return self.axis

    def full_scale(self, shape) -> np.ndarray:
        """The scale as a float32 array broadcasting against a weight of ``shape``: one per element
        with blocks, one per channel along ``axis``, or a scalar."""
        scale = np.asarray(self.scale, np.float32)
        if self.block_size and len(shape) > 2:  # a Conv/ConvTranspose weight's blocks: its 2-D view's
            flat = [shape[0], int(np.prod(shape[1:]))]
            return expand_blocks(scale, flat, self.axis, self.block_size).reshape(shape)
        if self.block_size:
            return expand_blocks(scale, shape, self.block_axis % len(shape), self.block_size)
        if self.axis is not None:
            return scale.reshape([-1 if i == self.axis % len(shape) else 1 for i in range(len(shape))])
        return scale


def is_quantized(value: ir.Value) -> bool:
    """True if ``value`` was produced by a DequantizeLinear or by this pass."""
    producer = value.producer()
    return name_of(value).startswith(NODE_PREFIX) or (producer is not None and producer.op_type == "DequantizeLinear")


MIN_OPSET = 21  # QuantizeLinear with output_dtype (float8 without a zero point)


@dataclasses.dataclass
class QDQResult(ir.passes.PassResult):
    dequantized: dict[str, ir.Value] = dataclasses.field(default_factory=dict)  # weight name -> what reads it now


class InsertQDQPass(ir.passes.InPlacePass):
    """requires: default opset >= 21; every node input names a node of the model with a float input of
    known dtype at that index and a TensorQuant for it. ensures: every such input is read from a
    DequantizeLinear (or, for an emulated format, from the grid-rounding ops or a rounded weight)."""

    def __init__(
        self,
        node_inputs: Iterable[tuple[ir.Node | str, int]],
        quant: Mapping[str, TensorQuant],
        per_axis_blocks: bool = False,
        blocked: Iterable[str] = (),
    ):
        """``node_inputs``: (node or node name, input index) pairs, in the main graph or in subgraphs;
        ``quant``: tensor name -> TensorQuant. ``per_axis_blocks``: block-scaled weights in the
        per-axis form (:meth:`_blocks_per_axis`) instead of a blocked DequantizeLinear, for EPs
        without blocked float8 DequantizeLinear (onnxruntime's CUDA EP), but for the weights named in
        ``blocked`` (those that :class:`~fp8onnx.passes.BlockFp8MatMulPass` reads next)."""
        super().__init__()
        self.node_inputs = list(node_inputs)
        self.quant = dict(quant)
        self.per_axis_blocks = per_axis_blocks
        self.blocked = frozenset(blocked)

    def _resolved(self, model: ir.Model) -> list[tuple[ir.Node, int]]:
        nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
        by_name = {n.name: n for n in nodes}
        present = set(map(id, nodes))
        out = []
        for node, index in self.node_inputs:
            found = by_name.get(node) if isinstance(node, str) else (node if id(node) in present else None)
            if found is None:
                raise ir.passes.PreconditionError(f"node {getattr(node, 'name', node)!r} is not in the model")
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
            value = required_input(node, index)
            emulated = name_of(value).startswith(NODE_PREFIX)  # grid-rounding ops or a rounded weight
            if not (is_quantized(value) or emulated):
                raise ir.passes.PostconditionError(f"input {index} of {node.name!r} is not quantized")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        wanted: dict[ir.Node | str, set[int]] = {}
        for node, index in self.node_inputs:
            wanted.setdefault(node, set()).add(index)
        builder = _Builder(graph)  # constants live in the main graph, visible from every subgraph
        self._per_row: list[tuple[str, int | None, int]] = []  # per-group activations that fell back to per row
        replaced: dict[str, ir.Value] = {}  # tensor name -> what its quantized consumers read
        weights: list[str] = []
        rewired = 0
        for node in list(ir.traversal.RecursiveGraphIterator(graph)):
            by_name = wanted.get(node.name, set()) if node.name is not None else set()
            for index in sorted(wanted.get(node, set()) | by_name):
                value = node.inputs[index]
                if value is None or is_quantized(value):
                    continue
                new = replaced.get(name := name_of(value))
                if new is None:
                    tq = self.quant[name]
                    if value.const_value is not None and value.is_initializer():
                        new = self._weight(builder, value, tq)
                        weights.append(name)
                    else:
                        new = self._activation(builder, value, tq)
                    insert_at_definition(value, builder.take())
                    replaced[name] = new
                node.replace_input_with(index, new)
                rewired += 1
        for name in replaced:
            value = graph.initializers.get(name)
            if value is not None and not value.uses() and not value.is_graph_output() and not value.is_graph_input():
                del graph.initializers[name]
        if rewired:
            logger.info("quantized %d node inputs (%d tensors)", rewired, len(replaced))
        if self._per_row:
            (name, count, group), more = self._per_row[0], len(self._per_row) - 1
            also = f" and {more} more activations" if more else ""
            logger.warning("%r%s: %s channels are not groups of %d; one scale per row there", name, also, count, group)
        dequantized = {name: replaced[name] for name in weights}
        return QDQResult(model, modified=bool(rewired), dequantized=dequantized)

    def _weight(self, b: _Builder, value: ir.Value, tq: TensorQuant) -> ir.Value:
        source, dtype = constant(value), dtype_of(value)
        scale = scale_array(tq.scale, dtype)
        shape, stored = list(source.shape.numpy()), dataclasses.replace(tq, scale=scale)

        def scale32() -> np.ndarray:
            # float32 scales broadcastable to the weight (block scales at full size), computed when the
            # weight is: all of a model's at once would take as much memory as its float32 weights
            return stored.full_scale(shape).astype(np.float32)

        if not tq.format.deployable:
            name = f"{NODE_PREFIX}{value.name}/{tq.format.value}_emulated"

            def emulated(w):
                s = scale32()
                return dequantize(quantize(w, s, tq.format), s, dtype_of(value).numpy())

            return initializer(b.graph, name, derived_tensor(source, emulated, dtype, source.shape, name))
        if tq.block_size and len(shape) > 2:  # Conv/ConvTranspose: blocks of its 2-D view, reshaped back
            flat = [shape[0], int(np.prod(shape[1:]))]
            flat_scale = lambda: scale32().reshape(flat)  # noqa: E731
            x = self._dequantized(b, value, tq, scale, flat_scale, flat, f"{value.name}/dequantized_2d")
            shape_value = b.const(f"{value.name}/shape", np.array(shape, np.int64))
            return b.op("Reshape", [x, shape_value], f"{value.name}/dequantized", dtype, value.shape)
        return self._dequantized(b, value, tq, scale, scale32, shape, f"{value.name}/dequantized")

    def _dequantized(self, b: _Builder, value, tq: TensorQuant, scale, scale32, shape: list, out: str) -> ir.Value:
        """The float8 initializer of ``value`` (seen as ``shape``) and its DequantizeLinear, named ``out``
        (``scale32()``: the float32 scales broadcastable to ``shape``)."""
        if tq.block_size and self.per_axis_blocks and value.name not in self.blocked:
            return self._blocks_per_axis(b, value, tq, scale, scale32, shape, out)
        name = f"{NODE_PREFIX}{value.name}/fp8"
        quantized = lambda w: quantize(w.reshape(shape), scale32(), tq.format)  # noqa: E731
        codes = derived_tensor(value.const_value, quantized, tq.format.ir_type, shape, name)
        q_value = initializer(b.graph, name, codes)
        scale_value = b.const(f"{value.name}/scale", scale)
        attrs = {} if tq.axis is None else {"axis": int(tq.axis)}
        if tq.block_size:
            attrs["block_size"] = int(tq.block_size)
        return b.op("DequantizeLinear", [q_value, scale_value], out, value.dtype, ir.Shape(shape), **attrs)

    def _blocks_per_axis(self, b: _Builder, value, tq: TensorQuant, scale, scale32, shape: list, out: str):
        """A block-scaled 2-D weight as a per-axis DequantizeLinear: the float8 codes stored as rows of one
        block each ([blocks x other dim, block], K padded with zeros to whole blocks), each row with its
        block's scale (axis 0), then Reshape, Transpose and Reshape (and Slice off the padding, Transpose
        a [N, K] weight) back to the weight's layout. Every value is the blocked DequantizeLinear's, bit
        for bit: each is one code times its block's scale."""
        source, block, axis = value.const_value, int(tq.block_size), tq.block_axis % 2
        k, other = int(shape[axis]), int(shape[1 - axis])
        blocks = -(-k // block)

        def rows(w):  # [K, M] padded to [blocks * block, M] -> [blocks, M, block] -> [blocks * M, block]
            w = np.moveaxis(quantize(w.reshape(shape), scale32(), tq.format), axis, 0)
            padded = np.zeros((blocks * block, other), w.dtype)
            padded[:k] = w
            return np.ascontiguousarray(padded.reshape(blocks, block, other).transpose(0, 2, 1)).reshape(-1, block)

        name = f"{NODE_PREFIX}{value.name}/fp8_block_rows"
        codes = initializer(
            b.graph, name, derived_tensor(source, rows, tq.format.ir_type, [blocks * other, block], name)
        )
        per_row = np.ascontiguousarray(np.moveaxis(scale, axis, 0)).reshape(-1)  # [blocks, M] -> one per row
        row_scales = b.const(f"{value.name}/block_scales", per_row)
        x = b.op("DequantizeLinear", [codes, row_scales], f"{value.name}/block_rows", value.dtype, None, axis=0)
        dims = lambda *d: b.const(f"const/shape_{'x'.join(map(str, d))}", np.array(d, np.int64))  # noqa: E731
        x = b.op("Reshape", [x, dims(blocks, other, block)], f"{value.name}/blocks", value.dtype, None)
        x = b.op("Transpose", [x], f"{value.name}/blocks_k_first", value.dtype, None, perm=[0, 2, 1])
        x = b.op("Reshape", [x, dims(blocks * block, other)], f"{value.name}/k_by_other", value.dtype, None)
        if blocks * block != k:
            starts, ends = b.const("const/zero_1d", np.array([0], np.int64)), dims(k)
            x = b.op("Slice", [x, starts, ends], f"{value.name}/unpadded", value.dtype, None)
        if axis == 1:
            x = b.op("Transpose", [x], f"{value.name}/k_last", value.dtype, None, perm=[1, 0])
        x.name, x.shape = f"{NODE_PREFIX}{out}", ir.Shape(shape)
        return x

    def _activation(self, b: _Builder, value: ir.Value, tq: TensorQuant) -> ir.Value:
        name = value.name
        if tq.scale is None and tq.block_size:
            grouped = self._per_group(b, value, tq)
            if grouped is not None:
                return grouped
            tq = dataclasses.replace(tq, block_size=0)  # channels unknown or not a multiple: per row
        per_token = tq.scale is None and tq.axis is not None
        if tq.scale is None:
            scale = _dynamic_scale(b, value, tq.format, f"{name}/dynamic", per_token=per_token, pow2=tq.pow2)
        else:
            scale = b.const(f"{name}/scale", scale_array(tq.scale, dtype_of(value)))
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
        return b.op("DequantizeLinear", [q, scale], f"{name}/dequantized", dtype_of(value), value.shape)

    def _per_group(self, b: _Builder, value: ir.Value, tq: TensorQuant) -> ir.Value | None:
        """One in-graph scale per row and per ``tq.block_size`` consecutive channels of the last axis:
        the rows of ``Reshape(x, [-1, G])`` are quantized per row (per token's ops), then reshaped
        back; None where the last axis is not a known multiple of G."""
        group, count = tq.block_size, channels(value)
        if count is None or count % group:
            self._per_row.append((name_of(value), count, group))  # said once, after the pass
            return None
        name, dtype = name_of(value), dtype_of(value)
        groups = b.op(
            "Reshape",
            [value, b.const(f"const/groups_of_{group}", np.array([-1, group], np.int64))],
            f"{name}/groups",
            dtype,
            ir.Shape([None, group]),
        )
        scale = _dynamic_scale(b, groups, tq.format, f"{name}/dynamic", per_token=True, pow2=tq.pow2)
        if tq.format.deployable:
            back = _rows_rounded(b, groups, scale, tq.format, f"{name}/per_group", f"{name}/per_group")
        else:
            back = emulated_rounding(b, groups, scale, tq.format, f"{name}/per_group/{tq.format.value}")
        shape = b.op("Shape", [value], f"{name}/shape", ir.DataType.INT64)
        return b.op("Reshape", [back, shape], f"{name}/dequantized", dtype, value.shape)
