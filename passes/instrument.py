"""Nodes added to a model to measure it or to rescale a tensor, built with onnx_ir's Tape: the graph edits
of the error budget and sensitivity (shadows of a node and their error sums), of calibration statistics
(reductions of a tensor to graph outputs) and of smoothing (a per-channel Mul). The callers decide what
to measure or scale; every node they add comes from here.

requires: the values named exist in the graph given; ensures: nothing the model computes changes (a
shadow or a reduction only reads, and a scaled tensor feeds only the readers handed over); each
function's nodes are inserted where their inputs are defined, so they run in order.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .common import initializer, insert_at_definition
from .known import dtype as dtype_of
from .known import graph_of, required_input

__all__ = ["Reductions", "error_outputs", "range_only", "scaled", "shadow_of"]

_F32 = int(ir.DataType.FLOAT)


def _name_outputs(tape: ir.tape.Tape, prefix: str) -> None:
    for n, v in enumerate(v for node in tape.nodes for v in node.outputs):
        v.name = v.name or f"{prefix}_{n}"


def shadow_of(node: ir.Node, suffix: str = "fp8onnx_shadow") -> ir.Node:
    """The same op on the same inputs, right after ``node``; its output is compared with ``node``'s."""
    tape = ir.tape.Tape()
    tape.op_multi_out(
        node.op_type,
        list(node.inputs),
        dict(node.attributes),
        domain=node.domain,
        name=f"{node.name}/{suffix}",
        num_outputs=len(node.outputs),
    )
    shadow = tape.nodes[0]
    for out, ref in zip(shadow.outputs, node.outputs):
        out.name = f"{ref.name}/{suffix}"
        if ref.dtype is not None:  # else left untyped: a Tensor(None) type would not serialize
            out.dtype = ref.dtype
        out.shape = ref.shape
    graph_of(node).insert_after(node, shadow)
    return shadow


def error_outputs(graph: ir.Graph, node: ir.Node, shadow: ir.Node, kind: str, energy: bool) -> tuple[str, str | None]:
    """Graph outputs: sum((y' - y)^2) of the shadow's output y' against ``node``'s y, and with ``energy``
    sum(y^2), in float32; returns their names."""
    tape = ir.tape.Tape()
    y = tape.op("Cast", [node.outputs[0]], {"to": _F32})
    diff = tape.op("Sub", [tape.op("Cast", [shadow.outputs[0]], {"to": _F32}), y])
    err = tape.op("ReduceSum", [tape.op("Mul", [diff, diff])], {"keepdims": 0})
    outputs = [err]
    energy_value = tape.op("ReduceSum", [tape.op("Mul", [y, y])], {"keepdims": 0}) if energy else None
    _name_outputs(tape, f"{shadow.name}/err")
    err.name = f"{node.name}/fp8onnx_budget_err_{kind}"
    if energy_value is not None:
        energy_value.name = f"{node.name}/fp8onnx_budget_energy"
        outputs.append(energy_value)
    for v in outputs:
        v.dtype, v.shape = ir.DataType.FLOAT, ir.Shape([])
    graph.insert_after(shadow, tape.nodes)
    graph.outputs.extend(outputs)
    return err.name, (energy_value.name if energy_value is not None else None)


def range_only(graph: ir.Graph, node: ir.Node, shadow: ir.Node, picked: list[int], quant: dict) -> dict[str, str]:
    """The shadow reads x + (DQ(Q(x)) - x) where x is clipped or below the format's smallest normal, x
    elsewhere, for each input in ``picked`` (``quant``: the TensorQuant of each, static scales); graph
    outputs count the clipped, below-normal and all elements of the first. Returns their names."""
    tape = ir.tape.Tape()
    counts: dict[str, ir.Value] = {}
    for i in picked:
        x, xq = required_input(node, i), shadow.inputs[i]
        tq = quant[x.name]
        s, fmt = np.float32(tq.scale), tq.format
        base = f"{shadow.name}/{i}"

        def const(name, value, base=base):
            return tape.initializer(ir.tensor(np.asarray(value, np.float32), name=f"{base}/{name}"))

        x32 = tape.op("Cast", [x], {"to": _F32})
        e = tape.op("Sub", [tape.op("Cast", [xq], {"to": _F32}), x32])
        ax = tape.op("Abs", [x32])
        # beyond the largest value by more than rounding to it (half its step): saturated, not rounded
        top = fmt.fmax * (1 + 2.0 ** -(fmt.mantissa_bits + 1)) * s
        over = tape.op("Greater", [ax, const("top", top)])
        tiny = tape.op("Less", [ax, const("normal", 2.0**fmt.min_normal_exponent * s)])
        under = tape.op("And", [tiny, tape.op("Greater", [ax, const("zero", 0.0)])])
        out_of_range = tape.op("Or", [over, under])
        kept = tape.op("Where", [out_of_range, e, const("nothing", 0.0)])
        xr = tape.op("Cast", [tape.op("Add", [x32, kept])], {"to": int(dtype_of(x))})
        shadow.replace_input_with(i, xr)
        if not counts:
            for key, flag in (("clipped", over), ("below_normal", under)):
                counts[key] = tape.op("ReduceSum", [tape.op("Cast", [flag], {"to": _F32})], {"keepdims": 0})
            counts["elements"] = tape.op("Cast", [tape.op("Size", [x])], {"to": _F32})
    _name_outputs(tape, f"{shadow.name}/range")
    graph.insert_before(shadow, tape.nodes)
    for init in tape.initializers:
        graph.register_initializer(init)
    names = {}
    for key, value in counts.items():
        value.name = f"{node.name}/fp8onnx_budget_{key}"
        value.dtype, value.shape = ir.DataType.FLOAT, ir.Shape([])
        graph.outputs.append(value)
        names[key] = value.name
    return names


class Reductions:
    """``add(op_type, inputs, suffix, dtype=None, shape=None, **attrs)`` makes one node (named
    ``prefix/suffixN``, its output too) and returns its output; NumPy arrays among the inputs become
    initializers. :meth:`insert` puts the nodes right after ``value``'s definition."""

    def __init__(self, graph: ir.Graph, prefix: str):
        self.graph, self.prefix, self.tape = graph, prefix, ir.tape.Tape()

    def add(self, op_type, inputs, suffix, dtype=None, shape=None, **attrs) -> ir.Value:
        k, p = len(self.tape.nodes), self.prefix
        inputs = list(inputs)
        for i, v in enumerate(inputs):
            if isinstance(v, np.ndarray):
                inputs[i] = initializer(self.graph, f"{p}/c{k}_{i}", v)
        out = self.tape.op(op_type, inputs, attrs or None, name=f"{p}/{suffix}{k}")
        out.name = f"{p}/{suffix}{k}"
        if dtype is not None:
            out.dtype = dtype
        if shape is not None:
            out.shape = ir.Shape(shape)
        return out

    def insert(self, value: ir.Value) -> None:
        insert_at_definition(value, list(self.tape.nodes))


def scaled(graph: ir.Graph, x: ir.Value, factor: np.ndarray, name: str, readers: list[ir.Node]) -> ir.Value:
    """``x * factor`` (a per-channel constant in x's type) computed right after x, read by ``readers``
    (input 0) instead of x; returns the product. The node is ``fp8onnx/NAME/smooth``, its output
    ``NAME/smoothed`` (not under "fp8onnx/": that marks values InsertQDQPass takes as already quantized)."""
    xt = dtype_of(x)
    const = initializer(graph, f"fp8onnx/{name}/smooth_inv", factor.astype(xt.numpy()))
    tape = ir.tape.Tape()
    out = tape.op("Mul", [x, const], name=f"fp8onnx/{name}/smooth")
    out.name = f"{name}/smoothed"
    out.dtype, out.shape = xt, x.shape
    insert_at_definition(x, list(tape.nodes))
    for node in readers:
        node.replace_input_with(0, out)
    return out
