"""Give chosen biases a [1, N] shape so that onnxruntime's BiasQuantization leaves them alone.

Why: at its default optimisation level (and already at "basic") onnxruntime's CPU EP rewrites the
constant 1-D bias of a Gemm whose A and B come from DequantizeLinear into int32 with scale
``scale_A * scale_B``, saturating; it also first fuses MatMul + Add into such a Gemm. When
``|bias| / (scale_A * scale_B)`` exceeds 2**31 the bias is silently clipped (seen with small
activations and weights: a bias of -0.13 became -3e-4). The rewrite only takes 1-D biases
(onnxruntime's ``bias_quantization.cc``); a [1, N] bias broadcasts to the same result.
``fp8onnx.quantize`` applies this pass only where the overflow would happen.

Rewrite cases, for a chosen node (the [1, N] copy is a main-graph initializer, visible everywhere):
  Gemm with a constant 1-D C                    -> C replaced by a [1, N] copy (``<C>/row``)
  MatMul (output rank >= 2) whose only consumer is an Add with a constant 1-D other input
                                                -> that input replaced by a [1, N] copy
  anything else (no bias, bias not constant, already 2-D) -> unchanged
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import onnx_ir as ir

from .common import initializer
from .known import constant, required_input, tensor_shape
from .known import dtype as dtype_of
from .known import name as name_of

__all__ = ["ShieldBiasPass", "bias_of"]

logger = logging.getLogger(__name__)


def bias_of(node: ir.Node) -> tuple[ir.Node, int] | None:
    """(node holding the bias, input index) of a Gemm's C or of the Add after a MatMul, if 1-D constant."""
    if node.op_type == "Gemm":
        holder, index = node, 2
    elif node.op_type == "MatMul":
        out = node.outputs[0]
        uses = list(out.uses())
        if len(uses) != 1 or uses[0].node.op_type != "Add" or out.shape is None or len(out.shape) < 2:
            return None
        holder, index = uses[0].node, 1 - uses[0].idx
    else:
        return None
    bias = holder.inputs[index] if len(holder.inputs) > index else None
    if bias is None or bias.const_value is None or len(bias.const_value.shape) != 1:
        return None
    return holder, index


def _as_row(source: ir.TensorProtocol) -> ir.TensorProtocol:
    return ir.tensor(source.numpy().reshape(1, -1))


class ShieldBiasPass(ir.passes.InPlacePass):
    """requires: nothing (targets without a bias are left alone); ensures: no target keeps a 1-D
    constant bias (each one now reads a [1, N] copy)."""

    def __init__(self, nodes: Iterable[ir.Node | str]):
        """``nodes``: the MatMul/Gemm nodes (or their names) whose bias to reshape, in any graph."""
        super().__init__()
        nodes = list(nodes)
        self.nodes = [n for n in nodes if isinstance(n, ir.Node)]
        self.node_names = {n for n in nodes if isinstance(n, str)}

    def ensures(self, model: ir.Model) -> None:
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if (node in self.nodes or node.name in self.node_names) and bias_of(node) is not None:
                raise ir.passes.PostconditionError(f"node {node.name!r} still has a 1-D bias")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        changed = 0
        for node in list(ir.traversal.RecursiveGraphIterator(graph)):
            if node not in self.nodes and node.name not in self.node_names:
                continue
            found = bias_of(node)
            if found is None:
                continue
            holder, index = found
            bias = required_input(holder, index)
            source = constant(bias)
            shape = ir.Shape([1, tensor_shape(source)[0]])
            tensor = ir.LazyTensor(functools.partial(_as_row, source), dtype=dtype_of(bias), shape=shape)
            holder.replace_input_with(index, initializer(graph, f"{name_of(bias)}/row", tensor))
            if not bias.uses() and not bias.is_graph_output() and not bias.is_graph_input():
                graph.initializers.pop(name_of(bias), None)
            changed += 1
        if changed:
            logger.info("reshaped %d biases to [1, N] (onnxruntime BiasQuantization would clip them)", changed)
        return ir.passes.PassResult(model, modified=bool(changed))
