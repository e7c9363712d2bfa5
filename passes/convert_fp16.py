"""Convert a float32 model to the FP16 baseline, keeping float32 inputs and outputs (a drop-in).

The conversion itself is onnxruntime's ``onnxruntime.transformers.float16`` converter: of the
converters we tried it is the one whose results load and run on real exported models (SPEC §7).
It keeps ops that have no float16 kernel in float32 (its default block list) and inserts Casts.

Rewrite cases:
  float32 initializers or computed values present -> converted; a new model is returned
  nothing in float32 left (already converted)     -> unchanged (``modified`` is False)
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnx_ir.external_data
import onnx_ir.passes.common
from onnxruntime.transformers.float16 import convert_float_to_float16

__all__ = ["ConvertFloat16Pass"]

logger = logging.getLogger(__name__)


def _has_float32_compute(model: ir.Model) -> bool:
    graph = model.graph
    if any(v.dtype == ir.DataType.FLOAT for v in graph.initializers.values()):
        return True
    boundary = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type == "Cast":
            continue  # the converter's own boundary casts
        for out in node.outputs:
            if out.dtype == ir.DataType.FLOAT and out.name not in boundary:
                return True
    return False


class ConvertFloat16Pass(ir.passes.FunctionalPass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not _has_float32_compute(model):
            return ir.passes.PassResult(model.clone(), modified=False)
        source = model.clone()
        ir.external_data.load_to_model(source)  # the converter reads raw tensor bytes from the proto
        proto = convert_float_to_float16(ir.to_proto(source), keep_io_types=True, disable_shape_infer=False)
        logger.info("converted the model to float16 (inputs and outputs kept as they were)")
        converted = ir.from_proto(proto)
        # The converter appends its input Casts at the end of the node list.
        ir.passes.common.TopologicalSortPass()(converted)
        return ir.passes.PassResult(converted, modified=True)
