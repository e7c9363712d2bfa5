"""Helpers shared by the passes."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from .known import graph_of

logger = logging.getLogger(__name__)


def defining_graph(value: ir.Value) -> ir.Graph:
    """The graph where ``value`` is defined: its producer's, or the one that owns it (a graph input, an
    initializer). What is added there every reader of ``value`` can read, subgraphs under it included."""
    producer = value.producer()
    return graph_of(producer) if producer is not None else graph_of(value)


def insert_at_definition(value: ir.Value, nodes: Sequence[ir.Node]) -> None:
    """Right after the node that computes ``value``, or first in the graph that owns it (graph inputs,
    initializers): every consumer, in that graph or in a subgraph under it, can then read the result."""
    producer = value.producer()
    if producer is not None:
        graph_of(producer).insert_after(producer, nodes)
        return
    owner = defining_graph(value)
    first = next(iter(owner), None)
    if first is None:
        owner.extend(nodes)
    else:
        owner.insert_before(first, nodes)


def initializer(graph: ir.Graph, name: str, tensor) -> ir.Value:
    """The initializer ``name`` of ``graph``, registered from ``tensor`` (an array or an onnx_ir
    tensor, lazy or not) unless the graph already has one by that name: the one way passes add
    constants."""
    existing = graph.initializers.get(name)
    if existing is not None:
        return existing
    if isinstance(tensor, np.ndarray):
        tensor = ir.tensor(tensor, name=name)
    value = ir.Value(name=name, const_value=tensor, shape=ir.Shape(tensor.shape))
    value.dtype = tensor.dtype
    graph.register_initializer(value)
    return value


def derived_tensor(source, compute, dtype: ir.DataType, shape, name: str | None) -> ir.LazyTensor:
    """``compute(source as NumPy)``, evaluated only when the model is saved (one tensor at a time);
    ``source`` is unmapped right after, so a large model is never resident whole."""

    def evaluate():
        try:
            return ir.tensor(compute(source.numpy()), name=name)
        finally:
            release(source)

    return ir.LazyTensor(evaluate, dtype=dtype, shape=ir.Shape(shape), name=name)


def transposed(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """A 2-D ``tensor`` transposed, contiguous: what a LazyTensor of a [N, K] weight computes."""
    return ir.tensor(np.ascontiguousarray(tensor.numpy().T))


def release(tensor) -> None:
    """Unmap a memory-mapped (external-data) tensor, so that its pages leave this process's resident
    memory; a large model is then never resident whole. Harmless for other tensors."""
    if isinstance(tensor, ir.ExternalTensor):
        try:
            tensor.release()
        except BufferError:  # a NumPy view of it is still alive somewhere: it stays mapped
            logger.debug("tensor %r is still referenced; left mapped", tensor.name)


def reduction_size(node: ir.Node) -> int | None:
    """K of a MatMul/Gemm ``y = x W`` with a 2-D weight: the rows of a [K, N] weight (the columns of a
    transposed Gemm's [N, K]); None for anything else (a Gemm with transA, a weight of unknown shape)."""
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or w.shape is None or len(w.shape) != 2:
        return None
    if node.op_type == "MatMul":
        k = w.shape[0]
    elif node.op_type == "Gemm" and not node.attributes.get_int("transA", 0):
        k = w.shape[1 if node.attributes.get_int("transB", 0) else 0]
    else:
        return None
    return k if isinstance(k, int) else None


def channels(value: ir.Value) -> int | None:
    """The size of ``value``'s last axis: from its shape, else from a MatMul/Gemm that multiplies it by a
    2-D weight (:func:`reduction_size`), which shape inference often cannot see through (e.g. an
    attention output after a Reshape to a computed shape); None where neither tells."""
    dims = value.shape
    if dims is not None and len(dims) and isinstance(dims[-1], int):
        return dims[-1]
    return next((k for node, index in value.uses() if index == 0 and (k := reduction_size(node)) is not None), None)


def output_channel_axis(node: ir.Node, index: int, rank: int) -> int | None:
    """The output-channel axis of weight input ``index`` of a MatMul/Gemm/Conv/ConvTranspose (the axis
    of per-channel scales), or None for a vector or a non-weight input."""
    if rank < 2:
        return None
    if node.op_type == "Conv":
        return 0 if index == 1 else None  # weight [M, C/group, k...]: M output channels
    if node.op_type == "ConvTranspose":
        return 1 if index == 1 else None  # weight [C, M/group, k...]: M/group output channels per group
    if node.op_type == "Gemm":
        trans = node.attributes.get_int("transB" if index == 1 else "transA", 0)
        return (0 if trans else 1) if index == 1 else (1 if trans else 0)
    if node.op_type == "MatMul":
        return rank - 1 if index == 1 else rank - 2
    return None


def proto_graphs(root):
    """``root`` (a GraphProto or FunctionProto) and every If/Loop/Scan body under it, as protos."""
    stack = [root]
    while stack:
        graph = stack.pop()
        yield graph
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def check_initializers(model: ir.Model) -> None:
    """Postcondition shared by passes that remove or replace initializers: every constant a node of
    the main graph reads is still an initializer of it (or a graph input)."""
    graph = model.graph
    for node in graph:
        for value in node.inputs:
            if value is None or value.producer() is not None or value.is_graph_input():
                continue
            registered = graph.initializers.get(value.name) if value.name is not None else None
            if value.const_value is not None and registered is not value:
                raise ir.passes.PostconditionError(f"node {node.name!r} reads {value.name!r}, no longer an initializer")


def keep_only_outputs(model: ir.Model, names) -> None:
    """Make ``names`` the model's only outputs and drop every node that none of them needs: an
    instrumented copy for statistics then computes no more than those (e.g. not a language model's
    logits, the largest tensor of a batch). Subgraph nodes go with the node that owns them."""
    import onnx_ir.passes.common

    wanted = set(names)
    kept = [v for v in model.graph.outputs if v.name in wanted]
    model.graph.outputs.clear()
    model.graph.outputs.extend(kept)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
