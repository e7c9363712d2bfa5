"""Make a model report the absolute maximum of chosen tensors, for streaming calibration.

For each tensor ``t`` this adds ``Cast<float>(ReduceMax(Abs(t), keepdims=0))`` and exposes the scalar as
a new graph output ``t + AMAX_SUFFIX``. Calibration then fetches only these scalars from each batch:
no activation leaves the session, so memory does not grow with the number of samples.

Rewrite cases:
  tensor of the main graph, no amax output yet  -> Abs + ReduceMax + Cast + graph output added
  amax output already present                   -> unchanged (idempotent)
  name not in the main graph                    -> ValueError naming it
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import onnx_ir as ir

__all__ = ["AddAmaxOutputsPass", "AMAX_SUFFIX"]

logger = logging.getLogger(__name__)
AMAX_SUFFIX = "__fp8onnx_amax"


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        values.update((v.name, v) for v in node.outputs)
    return values


class AddAmaxOutputsPass(ir.passes.InPlacePass):
    def __init__(self, tensor_names: Iterable[str]):
        super().__init__()
        self.tensor_names = list(dict.fromkeys(tensor_names))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        values = _values_by_name(graph)
        existing = {v.name for v in graph.outputs}
        added = 0
        for name in self.tensor_names:
            if name + AMAX_SUFFIX in existing:
                continue
            value = values.get(name)
            if value is None:
                raise ValueError(f"tensor {name!r} is not produced in the main graph")
            abs_node = ir.node("Abs", [value], name=name + "__fp8onnx_abs")
            red = ir.node("ReduceMax", [abs_node.outputs[0]], {"keepdims": 0}, name=name + "__fp8onnx_reducemax")
            # float32 whatever the tensor's type, which may not even be known here
            cast = ir.node("Cast", [red.outputs[0]], {"to": ir.DataType.FLOAT}, name=name + "__fp8onnx_cast")
            out = cast.outputs[0]
            out.name = name + AMAX_SUFFIX
            out.dtype = ir.DataType.FLOAT
            out.shape = ir.Shape([])
            graph.extend([abs_node, red, cast])
            graph.outputs.append(out)
            added += 1
        if added:
            logger.debug("added %d amax outputs", added)
        return ir.passes.PassResult(model, modified=bool(added))
