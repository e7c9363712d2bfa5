"""Convert a float32 model to the FP16 baseline, keeping float32 inputs and outputs (a drop-in).

The conversion itself is onnxruntime's ``onnxruntime.transformers.float16`` converter: of the
converters we tried it is the one whose results load and run on real exported models (SPEC §7).
It keeps ops that have no float16 kernel in float32 (its default block list) and inserts Casts.

Weights held in external data are not read in: the converter is given the graph with references
to them (it only changes a tensor's declared type when it holds no bytes), and each weight it turns
to float16 becomes a lazy tensor, converted with the converter's own rounding when the model is
saved. So a model larger than memory converts too.

Rewrite cases:
  float32 initializers or computed values present -> converted; a new model is returned
  nothing in float32 left (already converted)     -> unchanged (``modified`` is False)
"""

from __future__ import annotations

import contextlib
import logging

import onnx_ir as ir
import onnx_ir.passes.common
from onnx import helper
from onnxruntime.transformers import float16 as ort_float16

from ._common import derived_tensor

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
        external = {
            name: v.const_value
            for name, v in model.graph.initializers.items()
            if isinstance(v.const_value, ir.ExternalTensor)
        }
        with _value_info_from_dims():
            proto = ort_float16.convert_float_to_float16(
                ir.to_proto(model), keep_io_types=True, disable_shape_infer=False
            )
        logger.info("converted the model to float16 (inputs and outputs kept as they were)")
        converted = ir.from_proto(proto)
        for name, source in external.items():
            value = converted.graph.initializers[name]
            if value.dtype == ir.DataType.FLOAT16:  # converted: done when saved, with the converter's clamping
                source = derived_tensor(
                    source, ort_float16.convert_np_to_float16, ir.DataType.FLOAT16, source.shape, source.name
                )
            value.const_value = source
        # The converter appends its input Casts at the end of the node list.
        ir.passes.common.TopologicalSortPass()(converted)
        return ir.passes.PassResult(converted, modified=True)


@contextlib.contextmanager
def _value_info_from_dims():
    """The converter builds each converted weight's type from its data; a weight left in external
    data has none in the proto, so it is built from the declared dims (the same type)."""
    original = ort_float16.make_value_info_from_tensor
    ort_float16.make_value_info_from_tensor = lambda t: helper.make_tensor_value_info(t.name, t.data_type, t.dims)
    try:
        yield
    finally:
        ort_float16.make_value_info_from_tensor = original
