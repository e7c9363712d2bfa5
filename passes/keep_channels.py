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

from .common import initializer, insert_at_definition
from .known import dtype as dtype_of
from .known import graph_of, required_input

__all__ = ["keep_channels"]


def keep_channels(x: ir.Value, idx: np.ndarray, nodes: list[ir.Node], name: str) -> list[ir.Node]:
    """The nodes of ``nodes`` split (see the module docstring) with channels ``idx`` of ``x`` kept in float;
    nothing is added when none can be."""
    graph = graph_of(nodes[0])
    indices = initializer(graph, f"fp8onnx/{name}/kept_channels", np.asarray(idx, np.int64))
    tape = ir.tape.Tape()
    gathered = tape.op("Gather", [x, indices], attributes={"axis": -1}, name=f"fp8onnx/{name}/kept_gather")
    gathered.name, gathered.dtype = f"fp8onnx/{name}/kept", dtype_of(x)
    done = [node for node in nodes if _split(graph, node, gathered, idx)]
    if done:
        insert_at_definition(x, list(tape.nodes))
    return done


def _split(graph: ir.Graph, node: ir.Node, gathered: ir.Value, idx: np.ndarray) -> bool:
    w_value = required_input(node, 1)
    if w_value.const_value is None or not w_value.is_initializer() or w_value.is_graph_output():
        return False
    if any(u.node is not node for u in w_value.uses()):
        return False
    w = w_value.const_value.numpy().copy()
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0
    rows = w[:, idx].T if transposed else w[idx, :]  # [count, N]
    if node.op_type == "Gemm":
        rows = rows * node.attributes.get_float("alpha", 1.0)
    if transposed:
        w[:, idx] = 0
    else:
        w[idx, :] = 0
    w_value.const_value = ir.tensor(w, name=w_value.name)
    y = node.outputs[0]
    side_w = initializer(graph, f"fp8onnx/{node.name}/kept_rows", np.ascontiguousarray(rows.astype(w.dtype)))
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
    return True
