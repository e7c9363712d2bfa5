"""Move the bias of chosen Gemm nodes into an Add after them: ``Gemm(A, B, C)`` -> ``Add(Gemm(A, B), beta*C)``.

Why: at its default optimisation level onnxruntime's CPU ``BiasQuantization`` rewrites the float bias
of a Gemm whose A and B come from DequantizeLinear into int32 with scale ``scale_A * scale_B``,
saturating: when ``|C| / (scale_A * scale_B)`` exceeds 2**31 the bias is silently clipped (seen with
small activations: a bias of -0.13 became -3e-4). ``fp8onnx.quantize`` applies this pass to the Gemm
nodes where that would happen; an Add has no such rewrite.

Rewrite cases, for a named Gemm node:
  bias C present   -> Gemm without C (beta dropped) followed by Add(beta*C); the Add output takes the
                      Gemm's output name, so consumers and graph outputs are unchanged
  no bias          -> unchanged
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

__all__ = ["SplitGemmBiasPass"]

logger = logging.getLogger(__name__)


class SplitGemmBiasPass(ir.passes.InPlacePass):
    def __init__(self, node_names: Iterable[str]):
        super().__init__()
        self.node_names = set(node_names)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        split = 0
        for node in list(graph):
            if (
                node.op_type != "Gemm"
                or node.name not in self.node_names
                or len(node.inputs) < 3
                or node.inputs[2] is None
            ):
                continue
            bias = node.inputs[2]
            beta = node.attributes.get_float("beta", 1.0)
            if beta != 1.0:
                if bias.const_value is None:
                    continue
                source = bias.const_value
                scaled = ir.LazyTensor(
                    lambda s=source, b=beta: ir.tensor(
                        (s.numpy() * np.asarray(b, s.numpy().dtype)).astype(s.numpy().dtype)
                    ),
                    dtype=bias.dtype,
                    shape=ir.Shape(source.shape),
                )
                new_bias = ir.Value(name=f"{bias.name}/times_beta", const_value=scaled, shape=ir.Shape(source.shape))
                new_bias.dtype = bias.dtype
                graph.register_initializer(new_bias)
                bias = new_bias
            out = node.outputs[0]
            node.resize_inputs(2)
            node.attributes.pop("beta", None)
            add = ir.node("Add", [out, bias], name=f"{node.name}/bias")
            add.outputs[0].dtype, add.outputs[0].shape = out.dtype, out.shape
            out.replace_all_uses_with(add.outputs[0], replace_graph_outputs=True)
            add.replace_input_with(0, out)
            name = out.name
            out.name = f"{name}/no_bias"
            add.outputs[0].name = name
            graph.insert_after(node, add)
            split += 1
        if split:
            logger.info("moved the bias of %d Gemm nodes into an Add", split)
        return ir.passes.PassResult(model, modified=bool(split))
