"""What onnx_ir types as optional but a pass, at the point it asks, knows is there: the one place in
passes/ that narrows it, each with a check that says, in one sentence, which node or tensor lacked it.

onnx_ir types ``Node.name``/``Value.name`` as ``str | None`` (a prepared model names every one), a
node's inputs as ``Value | None`` (an optional input left out), a node's or value's ``graph`` as
``Graph | None`` (a node not yet inserted, a value of no graph), and a value's ``shape``, ``dtype`` and
``const_value`` as optional (unknown, or not a constant). Where its hints are wrong: a tensor's
``shape`` is a ``ShapeProtocol`` while ``ir.ExternalTensor``/``ir.LazyTensor`` ask for an ``ir.Shape``
(:func:`tensor_shape`), and ``Attributes.get_int(key, 0)`` in a truth test infers its default's type
from the test (``bool``): the passes compare it with 0 instead. fp8onnx.graph.known could import these.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["constant", "dim", "dtype", "graph_of", "name", "required_input", "shape", "tensor_shape"]


def _what(item: ir.Node | ir.Value) -> str:
    return f"{item.op_type} node {item.name!r}" if isinstance(item, ir.Node) else f"tensor {item.name!r}"


def name(item: ir.Node | ir.Value) -> str:
    """The name of a node or value (a prepared model's, an initializer's: every one has one)."""
    if item.name is None:
        kind = f"a {item.op_type} node" if isinstance(item, ir.Node) else "a tensor"
        raise ir.passes.PreconditionError(f"{kind} has no name; fp8onnx.graph.prepare names every one.")
    return item.name


def constant(value: ir.Value) -> ir.TensorProtocol:
    """The constant tensor of ``value`` (an initializer's, a weight's)."""
    if value.const_value is None:
        raise ir.passes.PreconditionError(f"Tensor {value.name!r} has no constant value.")
    return value.const_value


def dtype(value: ir.Value) -> ir.DataType:
    """The element type of ``value`` (one whose type inference or its initializer gave)."""
    if value.dtype is None:
        raise ir.passes.PreconditionError(f"Tensor {value.name!r} has no known element type.")
    return value.dtype


def shape(value: ir.Value) -> ir.Shape:
    """The shape of ``value`` (one whose shape inference or its initializer gave)."""
    if value.shape is None:
        raise ir.passes.PreconditionError(f"Tensor {value.name!r} has no known shape.")
    return value.shape


def dim(value: ir.Value, axis: int) -> int:
    """Dimension ``axis`` of ``value``'s shape, a number (an initializer's always is)."""
    size = shape(value)[axis]
    if not isinstance(size, int):
        raise ir.passes.PreconditionError(f"Tensor {value.name!r} has a symbolic dimension {axis} ({size}).")
    return size


def required_input(node: ir.Node, index: int) -> ir.Value:
    """Input ``index`` of ``node``, one its operator requires."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        raise ir.passes.PreconditionError(f"{node.op_type} node {node.name!r} has no input {index} (a required one).")
    return value


def graph_of(item: ir.Node | ir.Value) -> ir.Graph:
    """The graph that holds a node, or that owns a value (a graph input's, an initializer's)."""
    if item.graph is None:
        raise ir.passes.PreconditionError(f"The {_what(item)} belongs to no graph.")
    return item.graph


def tensor_shape(tensor: ir.TensorProtocol) -> ir.Shape:
    """The shape of a tensor as an ``ir.Shape`` (onnx_ir's tensors hold one; its protocol promises less)."""
    if isinstance(tensor.shape, ir.Shape):
        return tensor.shape
    return ir.Shape(tensor.shape.numpy())  # a tensor's shape is static
