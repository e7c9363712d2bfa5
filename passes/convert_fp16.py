"""Convert a float32 model to the FP16 baseline (or to bfloat16), keeping float32 inputs and outputs (a drop-in).

The conversion itself is onnxruntime's ``onnxruntime.transformers.float16`` converter: of the
converters we tried it is the one whose results load and run on real exported models (SPEC §7).
It keeps ops that have no float16 kernel in float32 (its default block list) and inserts Casts.

Weights held in external data are not read in: the converter is given the graph with references
to them (it only changes a tensor's declared type when it holds no bytes), and each weight it turns
to float16 becomes a lazy tensor, converted with the converter's own rounding when the model is
saved. So a model larger than memory converts too.

Shape and scale computations stay in float32: every node on the path that computes Resize's
roi/scales/sizes, Upsample's scales or Range's inputs (back to a Shape/Size or a constant) is kept out
of the conversion. In float16 such a path rounds (a ViT's bicubic Resize of its position embeddings
got outer-axis scales that were no longer exactly 1, which onnxruntime refuses at run time).

bfloat16 (``ConvertFloat16Pass(ir.DataType.BFLOAT16, keep=...)``): the same converter decides where the
Casts go (``keep`` names more nodes to leave in float32: those the target provider has no bfloat16 kernel
for), then every float16 type becomes bfloat16 and every converted weight is rounded from its float32
original (round to nearest even, ml_dtypes), not from its float16 rounding.

Rewrite cases:
  float32 initializers or computed values present -> converted; a new model is returned
  nothing in float32 left (already converted)     -> unchanged (``modified`` is False)
"""

from __future__ import annotations

import contextlib
import logging

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common
from onnx import TensorProto, helper
from onnxruntime.transformers import float16 as ort_float16

from .common import derived_tensor, proto_graphs

__all__ = ["ConvertFloat16Pass", "Float16Error"]


class Float16Error(ValueError):
    """onnxruntime's float16 converter wrote a graph no loader takes (names read but never defined)."""


logger = logging.getLogger(__name__)


def _has_float32_compute(model: ir.Model) -> bool:
    graph = model.graph
    if any(v.dtype == ir.DataType.FLOAT for v in graph.initializers.values()):
        return True
    boundary = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type == "Cast":
            continue  # the converter's own boundary casts
        for out in node.outputs:
            if out.dtype == ir.DataType.FLOAT and out.name not in boundary:
                return True
    return False


class ConvertFloat16Pass(ir.passes.FunctionalPass):
    """requires: nothing (a model without float32 compute is returned as it is; ``requires`` records
    the graph's inputs and outputs); ensures: graph inputs and outputs keep their names and types (a
    drop-in for the float32 model)."""

    def __init__(self, dtype: ir.DataType = ir.DataType.FLOAT16, keep: tuple[str, ...] = ()):
        super().__init__()
        if dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            raise ValueError(f"ConvertFloat16Pass converts to float16 or bfloat16, not {dtype}")
        self.dtype, self.keep = dtype, tuple(keep)
        self._io: list[tuple[str | None, ir.DataType | None]] = []

    def requires(self, model: ir.Model) -> None:
        self._io = [(v.name, v.dtype) for v in (*model.graph.inputs, *model.graph.outputs)]

    def ensures(self, model: ir.Model) -> None:
        now = [(v.name, v.dtype) for v in (*model.graph.inputs, *model.graph.outputs)]
        if now != self._io:
            raise ir.passes.PostconditionError(f"graph inputs/outputs changed: {self._io} -> {now}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not _has_float32_compute(model):
            return ir.passes.PassResult(model.clone(), modified=False)
        external = {
            name: v.const_value
            for name, v in model.graph.initializers.items()
            if isinstance(v.const_value, ir.ExternalTensor)
        }
        proto = ir.to_proto(model)
        blocked = _name_shape_paths(proto) + list(self.keep)
        with _value_info_from_dims():
            proto = ort_float16.convert_float_to_float16(
                proto,
                keep_io_types=True,
                disable_shape_infer=False,
                op_block_list=ort_float16.DEFAULT_OP_BLOCK_LIST,
                node_block_list=blocked,
            )
        _skip_float16_round_trips(proto, set(blocked))
        broken = _unloadable(proto.graph, set())
        if broken:
            raise Float16Error(
                f"onnxruntime's float16 converter wrote an invalid graph ({len(broken)} values, e.g. {broken[0]}); "
                "it mishandles If branches that read the same outer values, as Optimum's merged decoders do"
            )
        converted = ir.from_proto(proto)
        bf16 = self.dtype == ir.DataType.BFLOAT16
        # weights in external data are given back (the converter only changed their declared type); in
        # bfloat16 every converted weight is rounded from its float32 original
        sources = {**external, **(_float32_initializers(model) if bf16 else {})}
        for graph in (converted.graph, *converted.graph.subgraphs()):
            for name, value in graph.initializers.items():
                source = sources.get(name)
                if source is None:
                    continue
                if value.dtype == ir.DataType.FLOAT16:  # converted: done when saved, one tensor at a time
                    to = _to_bfloat16 if bf16 else ort_float16.convert_np_to_float16  # fp16: the converter's clamping
                    source = derived_tensor(source, to, self.dtype, source.shape, source.name)
                value.const_value = source
        if bf16:
            _retype(converted, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
        logger.info("converted the model to %s (inputs and outputs kept as they were)", self.dtype.name.lower())
        # The converter appends its input Casts at the end of the node list.
        ir.passes.common.TopologicalSortPass()(converted)
        ir.passes.common.RemoveUnusedNodesPass()(converted)  # round trips no longer read
        return ir.passes.PassResult(converted, modified=True)


def _to_bfloat16(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, np.float32).astype(ml_dtypes.bfloat16)


def _float32_initializers(model: ir.Model) -> dict[str, ir.TensorProtocol]:
    """Every float32 weight of the model (main graph and subgraphs) by name, as it was before conversion."""
    return {
        name: v.const_value
        for graph in (model.graph, *model.graph.subgraphs())
        for name, v in graph.initializers.items()
        if v.dtype == ir.DataType.FLOAT and v.const_value is not None
    }


def _retype(model: ir.Model, old: ir.DataType, new: ir.DataType) -> None:
    """Every ``old`` type in the model becomes ``new``: values, Cast targets, ``dtype`` attributes and
    constant tensors held in attributes (ConstantOfShape's value; their values rounded to ``new``). A
    weight still in ``old`` (one the converter added) is converted through float32."""
    graphs = (model.graph, *model.graph.subgraphs())
    for graph in graphs:
        for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
            if value.dtype == old:
                if value.const_value is not None and value.const_value.dtype == old:
                    array = value.const_value.numpy().astype(np.float32)
                    value.const_value = ir.tensor(array.astype(new.numpy()), dtype=new, name=value.name)
                value.dtype = new
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for out in node.outputs:
            if out.dtype == old:
                out.dtype = new
        for key, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.INT and key in ("to", "dtype") and attr.value == old:
                node.attributes[key] = ir.AttrInt64(key, int(new))
            elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == old:
                array = attr.value.numpy().astype(np.float32).astype(new.numpy())
                node.attributes[key] = ir.AttrTensor(key, ir.tensor(array, dtype=new, name=attr.value.name))


# op -> the inputs that carry shapes, scales or sizes rather than data
_SHAPE_INPUTS = {"Resize": (1, 2, 3), "Upsample": (1,), "Range": (0, 1, 2)}
_SHAPE_SOURCES = ("Shape", "Size")  # their outputs do not depend on the data's values: stop there


def _name_shape_paths(proto) -> list[str]:
    """Names of the nodes (named here when unnamed) that compute shape/scale inputs, in every graph."""
    blocked: list[str] = []
    for graph in proto_graphs(proto.graph):
        producer = {out: node for node in graph.node for out in node.output}
        stack = [
            node.input[i]
            for node in graph.node
            for i in _SHAPE_INPUTS.get(node.op_type, ())
            if node.domain in ("", "ai.onnx") and i < len(node.input) and node.input[i]
        ]
        seen = set()
        while stack:
            node = producer.get(stack.pop())
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if not node.name:
                node.name = f"fp8onnx_shape_path_{len(blocked)}"
            blocked.append(node.name)
            if node.op_type not in _SHAPE_SOURCES:
                stack.extend(i for i in node.input if i)
    return blocked


def _unloadable(graph, outer: set[str]) -> list[str]:
    """What no loader takes in a graph or a subgraph under it: names read or returned that nothing in
    scope defines, names a second node defines again (the converter writes a Cast of an outer value once
    for every branch that reads it)."""
    produced = [o for n in graph.node for o in n.output if o]
    defined = outer | {v.name for v in graph.input} | {t.name for t in graph.initializer} | set(produced)
    problems = [f"{i!r} read, never defined" for n in graph.node for i in n.input if i and i not in defined]
    problems += [f"{v.name!r} returned, never defined" for v in graph.output if v.name not in defined]
    seen: set[str] = set()
    for name in produced:
        if name in seen or name in outer:
            problems.append(f"{name!r} defined twice")
        seen.add(name)
    for node in graph.node:
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                problems += _unloadable(sub, defined)
    return problems


def _skip_float16_round_trips(proto, blocked: set[str]) -> None:
    """The converter hands even a kept-float32 node's output to the next kept node through
    Cast(float16) -> Cast(float32), which rounds: on shape paths, read the float32 value directly."""
    for graph in proto_graphs(proto.graph):
        producer = {out: node for node in graph.node for out in node.output}
        for node in graph.node:
            indices = range(len(node.input)) if node.name in blocked else _SHAPE_INPUTS.get(node.op_type, ())
            for i in indices:
                if i < len(node.input) and node.input[i]:
                    node.input[i] = _float32_source(node.input[i], producer, blocked)


def _float32_source(name: str, producer: dict, blocked: set[str]) -> str:
    """The float32 value behind ``name`` when it is a kept node's output sent through float16 and back."""
    back = producer.get(name)
    if back is None or back.op_type != "Cast" or _to(back) != TensorProto.FLOAT:
        return name
    half = producer.get(back.input[0])
    if half is None or half.op_type != "Cast" or _to(half) != TensorProto.FLOAT16:
        return name
    origin = producer.get(half.input[0])
    return half.input[0] if origin is not None and origin.name in blocked else name


def _to(cast) -> int | None:
    return next((a.i for a in cast.attribute if a.name == "to"), None)


@contextlib.contextmanager
def _value_info_from_dims():
    """The converter builds each converted weight's type from its data; a weight left in external
    data has none in the proto, so it is built from the declared dims (the same type)."""
    original = ort_float16.make_value_info_from_tensor
    ort_float16.make_value_info_from_tensor = lambda t: helper.make_tensor_value_info(t.name, t.data_type, t.dims)
    try:
        yield
    finally:
        ort_float16.make_value_info_from_tensor = original
