"""Gate quantized node inputs: each reads ``x + g * (q - x)``, with ``x`` its float tensor, ``q`` what
it reads now (the quantized tensor) and ``g`` a new scalar graph input.

What for: measuring each node's share of a model's output loss in one onnxruntime session. With every
gate 0 the model computes the float inputs, with gate k at 1 only input k is quantized; the session is
built once and run once per gate (``fp8onnx.workflows.loss_choice``), where a model per node would be
built, checked and loaded once each. The blend with ``g`` at exactly 0 or 1 gives ``x`` or ``q`` up
to one rounding of ``x + (q - x)``.

Rewrite cases, for a gate (node, input index, float tensor ``x``):
  the input is not ``x`` (it was quantized) -> Sub, Mul by the gate input ``fp8onnx/gate/<k>`` (the
      input's float type, shape []), Add, placed after what the input is defined by; the node reads
      the sum
  the input is ``x`` -> refused (a gate on an input that was not quantized measures nothing)
  the node already reads a gate's sum -> unchanged (idempotence)
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from ._in_graph import NODE_PREFIX, _Builder
from .common import insert_at_definition
from .known import dtype as dtype_of
from .known import name as name_of

__all__ = ["GATE_PREFIX", "GateInputsPass"]

logger = logging.getLogger(__name__)

GATE_PREFIX = f"{NODE_PREFIX}gate/"


class GateInputsPass(ir.passes.InPlacePass):
    """requires: every gate names a main-graph node whose input at that index is a float tensor other
    than ``x`` (or a gate's sum already); ensures: each such input reads a gate's sum, and the model
    has one scalar graph input ``GATE_PREFIX + k`` per gate, k in the order given."""

    def __init__(self, gates: list[tuple[str, int, ir.Value]]):
        """``gates``: (node name, input index, the float tensor the input read before quantization)."""
        super().__init__()
        self.gates = list(gates)

    def _node(self, model: ir.Model, name: str) -> ir.Node:
        found = next((n for n in model.graph if n.name == name), None)
        if found is None:
            raise ir.passes.PreconditionError(f"node {name!r} is not in the main graph")
        return found

    def requires(self, model: ir.Model) -> None:
        for name, index, x in self.gates:
            node = self._node(model, name)
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is None or value is x:
                raise ir.passes.PreconditionError(f"input {index} of {name!r} is not quantized: nothing to gate")

    def ensures(self, model: ir.Model) -> None:
        inputs = {v.name for v in model.graph.inputs}
        for k, (name, index, _) in enumerate(self.gates):
            value = self._node(model, name).inputs[index]
            if f"{GATE_PREFIX}{k}" not in inputs or value is None or not name_of(value).startswith(GATE_PREFIX):
                raise ir.passes.PostconditionError(f"input {index} of {name!r} is not gated")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, changed = model.graph, False
        for k, (name, index, x) in enumerate(self.gates):
            node = self._node(model, name)
            q = node.inputs[index]
            if q is None or name_of(q).startswith(GATE_PREFIX):
                continue
            xt = dtype_of(x)
            gate = ir.Value(name=f"{GATE_PREFIX}{k}", type=ir.TensorType(xt), shape=ir.Shape([]))
            graph.inputs.append(gate)
            b = _Builder(graph)
            error = b.op("Sub", [q, x], f"gate/{k}/error", xt, q.shape)
            scaled = b.op("Mul", [error, gate], f"gate/{k}/scaled", xt, q.shape)
            out = b.op("Add", [x, scaled], f"gate/{k}/input", xt, q.shape)
            out.name = f"{GATE_PREFIX}{k}/input"
            insert_at_definition(q, b.take())
            node.replace_input_with(index, out)
            changed = True
        if changed:
            logger.info("gated %d quantized inputs", len(self.gates))
        return ir.passes.PassResult(model, changed)
