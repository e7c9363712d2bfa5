"""Make a model report the absolute maximum of chosen tensors, for streaming calibration.

For each tensor ``t`` this adds ``Cast<float>(ReduceMax(Abs(t), keepdims=0))`` and exposes the scalar as
a new graph output ``t + AMAX_SUFFIX``. The new nodes go right after the node that computes ``t``
(first in the graph for a graph input), so a graph cut into segments for layer-by-layer calibration
measures each tensor in the segment that computes it. Calibration then fetches only these scalars
from each batch: no activation leaves the session, so memory does not grow with the number of samples.

With ``values=True`` the tensor itself is also exposed, cast to float32, as ``t + VALUE_SUFFIX``:
histogram calibration (percentile, mse) reads one batch of it at a time and keeps only counts.

Rewrite cases:
  tensor of the main graph, no amax output yet  -> Abs + ReduceMax + Cast + graph output added
  values=True, no value output yet              -> Cast + graph output added
  amax output already present                   -> unchanged (idempotent)
  name not in the main graph                    -> PreconditionError naming it (requires)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import onnx_ir as ir

from .common import insert_at_definition

__all__ = ["AMAX_SUFFIX", "VALUE_SUFFIX", "AddAmaxOutputsPass"]

logger = logging.getLogger(__name__)
AMAX_SUFFIX = "__fp8onnx_amax"
VALUE_SUFFIX = "__fp8onnx_value"


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs if v.name is not None}
    for node in graph:
        values.update((v.name, v) for v in node.outputs if v.name is not None)
    return values  # a nameless value: no name asks for it


def _float_output(tape: ir.tape.Tape, graph: ir.Graph, value: ir.Value, name: str) -> None:
    """Cast ``value`` to float32 on ``tape`` (its own type may not even be known) and make it a graph
    output."""
    out = tape.op("Cast", [value], {"to": ir.DataType.FLOAT}, name=name + "__cast")
    out.name = name
    out.dtype = ir.DataType.FLOAT
    out.shape = ir.Shape([]) if name.endswith(AMAX_SUFFIX) else value.shape
    graph.outputs.append(out)


class AddAmaxOutputsPass(ir.passes.InPlacePass):
    """requires: every named tensor is computed in (or is an input of) the main graph.
    ensures: each has an ``AMAX_SUFFIX`` graph output (and a ``VALUE_SUFFIX`` one with ``values``)."""

    def __init__(self, tensor_names: Iterable[str], *, values: bool = False):
        super().__init__()
        self.tensor_names = list(dict.fromkeys(tensor_names))
        self.values = values

    def requires(self, model: ir.Model) -> None:
        values = _values_by_name(model.graph)
        missing = next((n for n in self.tensor_names if n not in values), None)
        if missing is not None:
            raise ir.passes.PreconditionError(f"tensor {missing!r} is not produced in the main graph")

    def ensures(self, model: ir.Model) -> None:
        outputs = {v.name for v in model.graph.outputs}
        suffixes = (AMAX_SUFFIX, VALUE_SUFFIX) if self.values else (AMAX_SUFFIX,)
        for name in self.tensor_names:
            for suffix in suffixes:
                if name + suffix not in outputs:
                    raise ir.passes.PostconditionError(f"no graph output {name + suffix!r}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        values = _values_by_name(graph)
        existing = {v.name for v in graph.outputs}
        added = 0
        for name in self.tensor_names:
            value = values.get(name)
            if value is None:
                raise ValueError(f"tensor {name!r} is not produced in the main graph")
            tape = ir.tape.Tape()
            if name + AMAX_SUFFIX not in existing:
                absolute = tape.op("Abs", [value], name=name + "__fp8onnx_abs")
                amax = tape.op("ReduceMax", [absolute], {"keepdims": 0}, name=name + "__fp8onnx_reducemax")
                _float_output(tape, graph, amax, name + AMAX_SUFFIX)
            if self.values and name + VALUE_SUFFIX not in existing:
                _float_output(tape, graph, value, name + VALUE_SUFFIX)
            if tape.nodes:
                insert_at_definition(value, list(tape.nodes))
                added += 1
        if added:
            logger.debug("instrumented %d tensors", added)
        return ir.passes.PassResult(model, modified=bool(added))
