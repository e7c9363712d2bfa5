"""What onnx_ir types as optional but a model at this point has: the one place that narrows it, each
with a check that says, in one sentence, which node or tensor lacked it.

onnx_ir types ``Node.name``/``Value.name`` as ``str | None`` (a model may leave them out; a prepared
model has every one, fp8onnx.graph.prepare's NameFixPass), a graph initializer's name too (a graph keys
its initializers by name and refuses a nameless one), a node's inputs as ``Value | None`` (an optional
input left out), and a value's ``shape``, ``dtype`` and ``const_value`` as optional (unknown, or not a
constant). And where its hints disagree with each other: a tensor's ``shape`` is a ``ShapeProtocol``, while
``ir.ExternalTensor`` asks for an ``ir.Shape`` (what every onnx_ir tensor holds): :func:`tensor_shape`.
"""

from __future__ import annotations

import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.passes.known import name, tensor_shape  # the same narrowing as the passes'

__all__ = ["constant", "name", "required_input", "tensor_shape", "value_dtype", "value_shape"]


def constant(value: ir.Value) -> ir.TensorProtocol:
    """The constant tensor of ``value`` (an initializer's, a weight's)."""
    if value.const_value is None:
        raise Fp8OnnxError(f"Tensor {value.name!r} has no constant value.")
    return value.const_value


def required_input(node: ir.Node, index: int) -> ir.Value:
    """Input ``index`` of ``node``, one its operator requires."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        raise Fp8OnnxError(f"{node.op_type} node {node.name!r} has no input {index} (a required one).")
    return value


def value_shape(value: ir.Value) -> ir.Shape:
    """The shape of ``value`` (inferred, or declared), one a step needs (its rank, its sizes)."""
    if value.shape is None:
        raise Fp8OnnxError(f"Tensor {value.name!r} has no shape (shape inference could not tell it).")
    return value.shape


def value_dtype(value: ir.Value) -> ir.DataType:
    """The element type of ``value`` (inferred, or declared), one a step needs (to write a tensor of it)."""
    if value.dtype is None:
        raise Fp8OnnxError(f"Tensor {value.name!r} has no element type (shape inference could not tell it).")
    return value.dtype
