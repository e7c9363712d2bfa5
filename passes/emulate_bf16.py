"""bfloat16 compute for onnxruntime's CPU EP, which has bfloat16 kernels for few ops (Cast among them).

A graph written with ``--precision bf16`` is for the CUDA EP, whose bfloat16 kernels read bfloat16,
compute in float32 and round each result to bfloat16 (elementwise ops, reductions, cuBLAS with float32
accumulation). :class:`EmulateBfloat16Pass` gives the CPU EP the same numerics with float32 ops: every
bfloat16 value becomes float32, and each node that computes a bfloat16 result rounds it through
``Cast(bfloat16) -> Cast(float)`` (round to nearest even, as the CUDA kernels' conversion). Ops that
only move or select values (Reshape, Transpose, Gather, Concat, ...) cannot leave bfloat16's grid and
are not rounded again. Weights stored in bfloat16 become float32 (exact).

Rewrite cases:
  no bfloat16 value in any graph -> unchanged
  main-graph inputs/outputs in bfloat16 -> kept (a Cast after each input, the rounded value returned)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from .common import derived_tensor
from .known import graph_of

__all__ = ["EmulateBfloat16Pass", "has_bfloat16"]

_BF16, _F32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
# outputs are inputs' values moved or selected: already on bfloat16's grid
_MOVES = {
    "Concat", "Expand", "Flatten", "Gather", "GatherElements", "GatherND", "Identity", "Pad", "Reshape",
    "Slice", "Split", "Squeeze", "Tile", "Transpose", "Unsqueeze", "Where", "Max", "Min", "ReduceMax",
    "ReduceMin", "Relu", "Neg", "Abs", "If", "Loop", "Scan",
}  # fmt: skip


def _graphs(model: ir.Model):
    return (model.graph, *model.graph.subgraphs())


def _rounding(value: ir.Value) -> bool:
    """Whether every reader of ``value`` casts it to float32 (an emulated rounding, or a graph's own
    Cast back)."""
    return all(u.op_type == "Cast" and u.attributes.get_int("to") == _F32 for u, _ in value.uses())


def has_bfloat16(model: ir.Model) -> bool:
    """Whether the model computes anything in bfloat16 that the CPU EP would have to run: a bfloat16
    weight, subgraph value or node result other than a Cast read only by Casts to float32."""
    for graph in _graphs(model):
        if any(v.dtype == _BF16 for v in graph.initializers.values()):
            return True
        if graph is not model.graph and any(v.dtype == _BF16 for v in (*graph.inputs, *graph.outputs)):
            return True
    if any(v.dtype == _BF16 and not _rounding(v) for v in model.graph.inputs):
        return True
    kept = {id(v) for v in model.graph.outputs}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for out in node.outputs:
            if out.dtype == _BF16 and id(out) not in kept and not (node.op_type == "Cast" and _rounding(out)):
                return True
    return False


class EmulateBfloat16Pass(ir.passes.InPlacePass):
    """requires: nothing (value types are inferred where the model does not state them); ensures:
    :func:`has_bfloat16` is false: the only bfloat16 values left are Cast outputs read by Casts to
    float32 (the roundings) and main-graph inputs and outputs (kept as they were)."""

    def ensures(self, model: ir.Model) -> None:
        if has_bfloat16(model):
            raise ir.passes.PostconditionError("a bfloat16 result is left for the CPU EP to compute")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if any(o.dtype is None for n in ir.traversal.RecursiveGraphIterator(model.graph) for o in n.outputs):
            ir.passes.common.ShapeInferencePass(strict_mode=False)(model)  # which results are bfloat16
        if not has_bfloat16(model):
            return ir.passes.PassResult(model, False)
        for graph in _graphs(model):
            for value in graph.initializers.values():
                if value.dtype == _BF16 and value.const_value is not None:
                    source = value.const_value
                    value.const_value = derived_tensor(
                        source, lambda a: np.asarray(a).astype(np.float32), _F32, source.shape, value.name
                    )
                    value.dtype = _F32
            if graph is not model.graph:
                for value in (*graph.inputs, *graph.outputs):
                    if value.dtype == _BF16:
                        value.dtype = _F32
        main_outputs = {id(v) for v in model.graph.outputs}
        for value in list(model.graph.inputs):
            if value.dtype == _BF16:
                self._widen(model.graph, value, None, rounded=value, main_outputs=main_outputs)
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            self._node(model.graph, node, main_outputs)
        return ir.passes.PassResult(model, True)

    def _node(self, main: ir.Graph, node: ir.Node, main_outputs: set[int]) -> None:
        cast_to_bf16 = node.op_type == "Cast" and node.attributes.get_int("to") == _BF16
        if cast_to_bf16 and _rounding(node.outputs[0]):
            return  # already read back in float32
        if not cast_to_bf16:
            for key, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.INT and key in ("to", "dtype") and attr.value == _BF16:
                    node.attributes[key] = ir.AttrInt64(key, int(_F32))
                elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == _BF16:
                    wide = attr.value.numpy().astype(np.float32)
                    node.attributes[key] = ir.AttrTensor(key, ir.tensor(wide, name=attr.value.name))
        for out in node.outputs:
            if out.dtype != _BF16:
                continue
            if cast_to_bf16:
                self._widen(graph_of(node), out, node, rounded=out, main_outputs=main_outputs)
            elif node.op_type in _MOVES and id(out) not in main_outputs:
                out.dtype = _F32
            else:
                out.dtype = _F32
                self._widen(graph_of(node), out, node, rounded=None, main_outputs=main_outputs)

    @staticmethod
    def _widen(graph: ir.Graph, out: ir.Value, node, rounded, main_outputs: set[int]) -> None:
        """Readers of ``out`` read it rounded to bfloat16 and back in float32; a main-graph output keeps
        the bfloat16 value."""
        name = out.name
        tape = ir.tape.Tape()
        if rounded is None:
            rounded = tape.op("Cast", [out], {"to": int(_BF16)}, name=f"{name}/bf16")
            rounded.name, rounded.dtype, rounded.shape = f"{name}/bf16", _BF16, out.shape
        users = [(u, i) for u, i in out.uses() if not tape.nodes or u is not tape.nodes[0]]
        returned = graph is not None and any(v is out for v in graph.outputs) and id(out) not in main_outputs
        if users or returned:
            wide = tape.op("Cast", [rounded], {"to": int(_F32)}, name=f"{name}/bf16_fp32")
            wide.name, wide.dtype, wide.shape = f"{name}/bf16_fp32", _F32, out.shape
            for user, index in users:
                user.replace_input_with(index, wide)
            if returned:
                graph.outputs[[id(v) for v in graph.outputs].index(id(out))] = wide
        if not tape.nodes:
            return
        if node is None:
            graph.insert_before(next(iter(graph)), tape.nodes)
        else:
            graph.insert_after(node, tape.nodes)
        if id(out) in main_outputs and rounded is not out:  # the main graph returns bfloat16, as before
            graph.outputs[[id(v) for v in graph.outputs].index(id(out))] = rounded
            out.name, rounded.name = f"{name}/fp32", name
