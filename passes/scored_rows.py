"""A language model's logits at given rows only: the input ``rows`` [batch, scored, 1] (int64) picks, per
sample, the positions whose logits are wanted, and every MatMul that produces the logits' rows (its
vocabulary projection, or a split projection's products: kept channels) gathers those rows of its input
first (``GatherND``, ``batch_dims=1``). The projection then runs on the scored rows alone: a task's targets,
about 2 of LAMBADA's 80 positions, instead of every position (:mod:`fp8onnx.accuracy.scored_positions`).

requires: the logits come from MatMuls whose first inputs are [batch, seq, width], through per-element steps
whose other inputs are constant (a Cast, a soft cap's Div/Tanh/Mul, a bias; an Add may join two products);
opset 12 or later (``batch_dims``). ensures: ``logits``' row ``j`` of sample ``b`` is the model's row
``rows[b, j]`` before the pass (a negative row counts from the end); a model the pass cannot take is left as
it is (:func:`scored_projections` says which beforehand).
"""

from __future__ import annotations

import onnx_ir as ir

from .known import name as name_of
from .known import required_input

__all__ = ["ScoredRowsPass", "scored_projections"]

# Steps between the projection and the logits that act on each element alone (their other inputs constant).
_PER_ELEMENT = frozenset({"Cast", "Identity", "Tanh", "Mul", "Div", "Add", "Sub"})
_MIN_OPSET = 12  # GatherND's batch_dims


def _constant(value: ir.Value | None) -> bool:
    if value is None or value.const_value is not None:
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


def scored_projections(model: ir.Model, logits: str, rows: str) -> list[ir.Node] | None:
    """The MatMuls whose rows become output ``logits``' rows, or None where the pass cannot take the model
    (a step on the way that is not per element, an input ``rows`` already there, an opset before 12)."""
    graph = model.graph
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    start = next((v for v in graph.outputs if v.name == logits), None)
    if start is None or opset < _MIN_OPSET or any(v.name == rows for v in graph.inputs):
        return None
    found: list[ir.Node] = []
    todo = [start]
    while todo:
        node = todo.pop().producer()
        if node is None or node.graph is not graph:
            return None
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            first = node.inputs[0]
            if first is None or (first.shape is not None and len(first.shape) != 3):
                return None
            if node not in found:
                found.append(node)
            continue
        if node.op_type not in _PER_ELEMENT or node.domain not in ("", "ai.onnx"):
            return None
        varying = [v for v in node.inputs if v is not None and not _constant(v)]
        if not varying or (len(varying) > 1 and node.op_type not in ("Add", "Sub")):
            return None
        todo += varying
    return found or None


class ScoredRowsPass(ir.passes.InPlacePass):
    """A language model's logits at the rows its input ``rows`` names (see the module docstring).

    requires: the logits come from MatMuls through per-element steps (:func:`scored_projections`), opset 12
    or later. ensures: ``logits`` is [batch, scored, vocabulary], row ``j`` of sample ``b`` the model's row
    ``rows[b, j]`` before the pass; ``result.modified`` is False, the model untouched, where it cannot be taken."""

    def __init__(self, logits: str, rows: str):
        super().__init__()
        self.logits, self.rows = logits, rows

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        projections = scored_projections(model, self.logits, self.rows)
        if projections is None:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        rows = ir.Value(name=self.rows, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "scored", 1]))
        graph.inputs.append(rows)
        for i, node in enumerate(projections):
            hidden = required_input(node, 0)
            tape = ir.tape.Tape()
            picked = tape.op("GatherND", [hidden, rows], attributes={"batch_dims": 1}, name=f"{self.rows}/{i}")
            picked.name = f"{name_of(hidden)}/scored"
            if hidden.dtype is not None:
                picked.dtype = hidden.dtype
            graph.insert_before(node, list(tape.nodes))
            node.replace_input_with(0, picked)
        for value in graph.outputs:  # the scored axis replaces seq on what the projection produces
            if value.name == self.logits and value.shape is not None and len(value.shape) == 3:
                value.shape = ir.Shape([value.shape[0], "scored", value.shape[2]])
        return ir.passes.PassResult(model, modified=True)
