"""Insert float8 QuantizeLinear/DequantizeLinear on chosen inputs of MatMul/Gemm (or any) nodes.

Which node inputs to quantize, in which format and with which scale, is decided before this pass
(see ``fp8onnx.quantize``); this pass only rewrites the graph.

Rewrite cases, for a target ``(node, input index)`` whose input is tensor ``t``:
  ``t`` is a float initializer (a weight)  -> a float8 initializer ``t/fp8`` (computed lazily, when the
      model is saved) followed by DequantizeLinear; no QuantizeLinear at run time. The float
      initializer is removed once nothing else reads it.
  ``t`` is computed at run time (an activation) -> QuantizeLinear -> DequantizeLinear, one pair per
      tensor, shared by all of its quantized consumers.
  ``t`` already comes from a DequantizeLinear -> unchanged (this is what makes the pass idempotent).

QuantizeLinear carries ``output_dtype`` and no zero point (opset 21): with a zero point,
onnxruntime's ReluQuantRewrite would delete a Relu in front of it (see ``upgrade_opset``).
Scales are scalar initializers of the tensor's own float type, so DequantizeLinear gives back
the type the consumer had.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from ..formats import Fp8Format, quantize

__all__ = ["InsertQDQPass", "TensorQuant", "scale_array", "NODE_PREFIX"]

logger = logging.getLogger(__name__)
NODE_PREFIX = "fp8onnx/"


@dataclasses.dataclass(frozen=True)
class TensorQuant:
    """How one tensor is quantized: its float8 format and its QuantizeLinear scale."""

    format: Fp8Format
    scale: float


def scale_array(scale: float, dtype: ir.DataType) -> np.ndarray:
    """The scale as a scalar of the tensor's float type, kept finite and positive in that type."""
    np_dtype = dtype.numpy()
    info = np.finfo(np_dtype) if np_dtype != np.dtype("bfloat16") else np.finfo(np.float32)
    return np.asarray(np.clip(scale, info.smallest_normal, info.max), dtype=np_dtype)


def _lazy_quantized(source: ir.TensorProtocol, tq: TensorQuant, scale: np.ndarray, name: str) -> ir.LazyTensor:
    def compute() -> ir.Tensor:
        return ir.tensor(quantize(source.numpy(), scale.astype(np.float32), tq.format), name=name)

    return ir.LazyTensor(compute, dtype=tq.format.ir_type, shape=ir.Shape(source.shape), name=name)


class InsertQDQPass(ir.passes.InPlacePass):
    def __init__(
        self,
        targets: Iterable[tuple[str, int]],
        quant: Mapping[str, TensorQuant],
    ):
        """``targets``: (node name, input index) pairs; ``quant``: tensor name -> TensorQuant."""
        super().__init__()
        self.targets = list(targets)
        self.quant = dict(quant)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        wanted: dict[str, set[int]] = {}
        for node_name, index in self.targets:
            wanted.setdefault(node_name, set()).add(index)
        dequantized: dict[str, ir.Value] = {}  # tensor name -> its DequantizeLinear output
        rewired = 0
        for node in list(graph):
            for index in sorted(wanted.get(node.name, ())):
                value = node.inputs[index]
                if value is None:
                    continue
                producer = value.producer()
                if producer is not None and producer.op_type == "DequantizeLinear":
                    continue
                dq = dequantized.get(value.name)
                if dq is None:
                    tq = self.quant[value.name]
                    if value.const_value is not None and value.is_initializer():
                        new_nodes, dq = self._weight_dq(graph, value, tq)
                    else:
                        new_nodes, dq = self._activation_qdq(graph, value, tq)
                    graph.insert_before(node, new_nodes)
                    dequantized[value.name] = dq
                node.replace_input_with(index, dq)
                rewired += 1
        self._drop_unused_float_weights(graph, dequantized)
        if rewired:
            logger.info("inserted float8 Q/DQ on %d inputs (%d tensors)", rewired, len(dequantized))
        return ir.passes.PassResult(model, modified=bool(rewired))

    def _scale_init(self, graph: ir.Graph, value: ir.Value, tq: TensorQuant) -> tuple[ir.Value, np.ndarray]:
        arr = scale_array(tq.scale, value.dtype)
        scale = ir.Value(name=f"{NODE_PREFIX}{value.name}/scale", const_value=ir.tensor(arr), shape=ir.Shape([]))
        scale.dtype = value.dtype
        graph.register_initializer(scale)
        return scale, arr

    def _weight_dq(self, graph: ir.Graph, value: ir.Value, tq: TensorQuant) -> tuple[list[ir.Node], ir.Value]:
        scale, arr = self._scale_init(graph, value, tq)
        name = f"{NODE_PREFIX}{value.name}/fp8"
        tensor = _lazy_quantized(value.const_value, tq, arr, name)
        q_value = ir.Value(name=name, const_value=tensor, shape=ir.Shape(value.const_value.shape))
        q_value.dtype = tq.format.ir_type
        graph.register_initializer(q_value)
        dq = ir.node("DequantizeLinear", [q_value, scale], name=f"{NODE_PREFIX}{value.name}/DequantizeLinear")
        self._type_output(dq.outputs[0], f"{NODE_PREFIX}{value.name}/dequantized", value)
        return [dq], dq.outputs[0]

    def _activation_qdq(self, graph: ir.Graph, value: ir.Value, tq: TensorQuant) -> tuple[list[ir.Node], ir.Value]:
        scale, _ = self._scale_init(graph, value, tq)
        q = ir.node(
            "QuantizeLinear",
            [value, scale],
            {"output_dtype": int(tq.format.onnx_type), "saturate": 1},
            name=f"{NODE_PREFIX}{value.name}/QuantizeLinear",
        )
        q_out = q.outputs[0]
        q_out.name = f"{NODE_PREFIX}{value.name}/quantized"
        q_out.dtype = tq.format.ir_type
        q_out.shape = value.shape
        dq = ir.node("DequantizeLinear", [q_out, scale], name=f"{NODE_PREFIX}{value.name}/DequantizeLinear")
        self._type_output(dq.outputs[0], f"{NODE_PREFIX}{value.name}/dequantized", value)
        return [q, dq], dq.outputs[0]

    @staticmethod
    def _type_output(out: ir.Value, name: str, like: ir.Value) -> None:
        out.name = name
        out.dtype = like.dtype
        out.shape = like.shape

    @staticmethod
    def _drop_unused_float_weights(graph: ir.Graph, dequantized: Mapping[str, ir.Value]) -> None:
        for name in dequantized:
            value = graph.initializers.get(name)
            if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
                continue
            del graph.initializers[name]
