"""A MatMul/Gemm split into the product of most of its input channels and a float product of a few (the
graph edit of :mod:`fp8onnx.techniques.outlier_channels`, which chooses the channels).

``y = x W`` becomes ``x W' + Gather(x, idx) W[idx, :]``: ``W'`` is the weight with rows ``idx`` set to zero
(in place), the second product a MatMul of ``len(idx)`` columns against those rows (times a Gemm's
``alpha``; a Gemm's bias stays in the first product), added to the node's output for every reader. One
Gather per activation serves all of its readers.

requires: each node reads the activation as input 0 (no ``transA``) and a constant 2-D weight as input 1.
ensures: the model computes the same function up to float rounding; a node whose weight another node
also reads is left as it is; the graph's outputs keep their names.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .common import defining_graph, derived_tensor, initializer, insert_at_definition, release
from .known import constant, graph_of, required_input, tensor_shape
from .known import dtype as dtype_of

__all__ = ["keep_channels"]


def keep_channels(x: ir.Value, idx: np.ndarray, nodes: list[ir.Node], name: str) -> list[ir.Node]:
    """The nodes of ``nodes`` split (see the module docstring) with channels ``idx`` of ``x`` kept in float;
    nothing is added when none can be."""
    done = [node for node in nodes if _own_weight(node)]
    if not done:
        return []
    # the Gather goes where x is defined (its readers may sit in subgraphs under it: a merged decoder's If)
    indices = initializer(defining_graph(x), f"fp8onnx/{name}/kept_channels", np.asarray(idx, np.int64))
    tape = ir.tape.Tape()
    gathered = tape.op("Gather", [x, indices], attributes={"axis": -1}, name=f"fp8onnx/{name}/kept_gather")
    gathered.name, gathered.dtype = f"fp8onnx/{name}/kept", dtype_of(x)
    for node in done:
        _split(graph_of(node), node, gathered, idx)
    insert_at_definition(x, list(tape.nodes))
    return done


def _own_weight(node: ir.Node) -> bool:
    """``node``'s weight is a constant initializer that nothing else reads (so it may be changed)."""
    w = required_input(node, 1)
    return (
        w.const_value is not None
        and w.is_initializer()
        and not w.is_graph_output()
        and all(u.node is node for u in w.uses())
    )


def _split(graph: ir.Graph, node: ir.Node, gathered: ir.Value, idx: np.ndarray) -> None:
    w_value = required_input(node, 1)
    source = constant(w_value)
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0
    w = source.numpy()
    rows = w[:, idx].T if transposed else w[idx, :]  # [count, N], a copy
    if node.op_type == "Gemm":
        rows = rows * node.attributes.get_float("alpha", 1.0)
    rows = np.ascontiguousarray(rows.astype(w.dtype))
    del w
    release(source)

    def without_rows(w: np.ndarray) -> np.ndarray:
        w = w.copy()
        if transposed:
            w[:, idx] = 0
        else:
            w[idx, :] = 0
        return w

    # W' computed where it is read (scales, GPTQ, the written file), one tensor at a time: a model calibrated
    # layer by layer never holds its weights whole (an eager copy of each held 1.4 GB more for Qwen2.5 0.5B)
    shape = tensor_shape(source)
    w_value.const_value = derived_tensor(source, without_rows, source.dtype, shape, w_value.name)
    y = node.outputs[0]
    side_w = initializer(graph, f"fp8onnx/{w_value.name}/kept_rows", rows)  # a weight's name is unique
    tape = ir.tape.Tape()
    side = tape.op("MatMul", [gathered, side_w], name=f"fp8onnx/{node.name}/kept_matmul")
    total = tape.op("Add", [y, side], name=f"fp8onnx/{node.name}/kept_add")
    side.name, side.dtype = f"fp8onnx/{node.name}/kept_product", dtype_of(y)
    total.name, total.dtype, total.shape = f"{y.name}/with_kept", dtype_of(y), y.shape  # not under "fp8onnx/":
    add_node = total.producer()  # a reader that quantizes its input must still see it
    for use in list(y.uses()):
        if use.node is not add_node:
            use.node.replace_input_with(use.idx, total)
    if y.is_graph_output():
        outputs = graph.outputs
        outputs[outputs.index(y)] = total
        y.name, total.name = f"{y.name}/without_kept", y.name
    graph.insert_after(node, list(tape.nodes))
