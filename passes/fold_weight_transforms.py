"""Fold Identity, Cast and Transpose applied to a float initializer into a new initializer.

Exporters often feed a MatMul/Gemm its weight through ``Transpose(W)`` or ``Cast(W)``; folded, the
weight is an initializer again and can be stored in float8. The folded tensor is computed lazily
(when the model is saved), so a large weight is not copied in memory ahead of time.

Rewrite cases, for a node ``n = op(W)`` with ``W`` a float initializer:
  Identity               -> consumers of ``n`` read ``W``
  Transpose(perm)        -> a new initializer ``W`` transposed, named like ``n``'s output
  Cast(to a float type)  -> a new initializer ``W`` cast, named like ``n``'s output
  chains (Cast(Transpose(W)))       -> folded one node at a time until none is left
  ``n``'s output is a graph output, or nothing it feeds is a MatMul/Gemm (directly or through
      another foldable node)        -> unchanged
  ``W`` has other readers           -> kept for them; unused initializers are removed
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from .common import check_initializers
from .known import constant, required_input, tensor_shape
from .known import dtype as dtype_of
from .known import name as name_of

__all__ = ["FoldWeightTransformsPass"]

logger = logging.getLogger(__name__)
_FOLDABLE = ("Identity", "Cast", "Transpose")
_TARGETS = ("MatMul", "Gemm")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _feeds_a_matmul(value: ir.Value, depth: int = 0) -> bool:
    for use in value.uses():
        node = use.node
        if node.op_type in _TARGETS and node.domain in ("", "ai.onnx"):
            return True
        if node.op_type in _FOLDABLE and depth < 8 and _feeds_a_matmul(node.outputs[0], depth + 1):
            return True
    return False


def _foldable(node: ir.Node) -> bool:
    if node.op_type not in _FOLDABLE or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
        return False
    src, out = node.inputs[0], node.outputs[0]
    if src is None or src.const_value is None or not src.is_initializer() or src.is_graph_input():
        return False
    if src.dtype not in _FLOATS or out.is_graph_output():
        return False
    if node.op_type == "Cast" and ir.DataType(node.attributes.get_int("to", 0)) not in _FLOATS:
        return False
    return _feeds_a_matmul(out)


def _compute(node: ir.Node, source: ir.TensorProtocol) -> Callable[[], np.ndarray]:
    if node.op_type == "Transpose":
        perm = node.attributes.get_ints("perm", None)
        return lambda: np.transpose(source.numpy(), perm)
    to = ir.DataType(node.attributes.get_int("to"))
    return lambda: source.numpy().astype(to.numpy())


def _named(compute: Callable[[], np.ndarray], name: str | None) -> ir.TensorProtocol:
    return ir.tensor(compute(), name=name)


def _folded_shape(node: ir.Node, shape: ir.Shape) -> ir.Shape:
    dims = list(shape.dims)
    if node.op_type == "Transpose":
        perm = node.attributes.get_ints("perm", None) or list(reversed(range(len(dims))))
        dims = [dims[p] for p in perm]
    return ir.Shape(dims)


class FoldWeightTransformsPass(ir.passes.InPlacePass):
    """requires: nothing (any model); ensures: no Identity, Cast or Transpose of a float initializer
    that feeds a MatMul/Gemm is left in the main graph, and every constant a node reads is still an
    initializer."""

    def ensures(self, model: ir.Model) -> None:
        left = next((n for n in model.graph if _foldable(n)), None)
        if left is not None:
            raise ir.passes.PostconditionError(f"{left.op_type} {left.name!r} on a weight is still there")
        check_initializers(model)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        folded = 0
        changed = True
        while changed:
            changed = False
            for node in list(graph):
                if not _foldable(node):
                    continue
                src, out = required_input(node, 0), node.outputs[0]
                if node.op_type == "Identity":
                    out.replace_all_uses_with(src)
                    graph.remove(node, safe=True)
                else:
                    compute = _compute(node, constant(src))
                    shape = _folded_shape(node, tensor_shape(constant(src)))
                    dtype = dtype_of(src) if node.op_type == "Transpose" else ir.DataType(node.attributes.get_int("to"))
                    name = out.name
                    tensor = ir.LazyTensor(functools.partial(_named, compute, name), dtype=dtype, shape=shape)
                    new = ir.Value(name=f"{name}__folded", const_value=tensor, shape=shape)
                    new.dtype = dtype
                    out.replace_all_uses_with(new)
                    graph.remove(node, safe=True)
                    new.name = name
                    graph.register_initializer(new)
                if not src.uses() and not src.is_graph_output():
                    graph.initializers.pop(name_of(src), None)
                folded += 1
                changed = True
        if folded:
            logger.info("folded %d Identity/Cast/Transpose nodes on weights into initializers", folded)
        return ir.passes.PassResult(model, modified=bool(folded))
