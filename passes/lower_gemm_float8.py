"""Lower quantized MatMul/Gemm to onnxruntime's ``com.microsoft.GemmFloat8`` (FP8 tensor cores, CUDA).

A float8 Q/DQ graph runs on the CUDA EP as dequantize + FP16/FP32 GEMM; GemmFloat8 multiplies the
float8 tensors themselves (cuBLASLt, compute capability >= 8.9). Semantics and the NumPy reference
used by the CPU tests are in ``fp8onnx.numerics.gemm_float8_ref``.

Rewrite cases, for a MatMul/Gemm whose input A is ``DequantizeLinear(QuantizeLinear(x))`` and whose
weight is ``DequantizeLinear(W)`` of a per-tensor float8 initializer, both E4M3FN:
  -> ``GemmFloat8(A8, W8t, "", scaleA, scaleB)`` with transA=0, transB=1 (A [M, K], B [N, K]: the TN
     layout cuBLASLt needs for float8; onnxruntime's schema has no layout attribute besides), float16
     output and no scaleY (cuBLASLt takes an output scale only for a float8 output); A8 is reshaped to
     2-D when batched and the result reshaped back; W8t is the float8 weight laid out [N, K]; a Gemm's
     bias becomes an Add (times beta); a Cast restores the original output type. Scales are cast to
     float32.
Left as Q/DQ, with the reason in ``skipped`` (node name -> reason): per-channel weight scales,
weights that are not 2-D, Gemm with transA=1, FNUZ or emulated formats (no CUDA kernel), mixed
E4M3/E5M2 (onnxruntime issue 20869), E5M2 x E5M2 (not a cuBLASLt float8 combination), inputs not in
the Q/DQ form above.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from ..numerics.formats import Fp8Format
from .common import initializer, transposed
from .known import constant, dim, required_input
from .known import dtype as dtype_of
from .known import name as name_of
from .known import shape as shape_of

__all__ = ["MS_DOMAIN", "LowerGemmFloat8Pass"]

logger = logging.getLogger(__name__)
MS_DOMAIN = "com.microsoft"
_CUDA_FP8 = tuple(f.ir_type for f in Fp8Format if f.cuda_ok and not f.integer)


def _dq_of(value: ir.Value | None) -> ir.Node | None:
    producer = value.producer() if value is not None else None
    return producer if producer is not None and producer.op_type == "DequantizeLinear" else None


def _reason(node: ir.Node) -> str | None:
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0:
        return "Gemm with transA=1"
    act_dq, w_dq = _dq_of(node.inputs[0]), _dq_of(node.inputs[1])
    if act_dq is None or w_dq is None:
        return "inputs are not both DequantizeLinear outputs"
    a8 = required_input(act_dq, 0)
    q = a8.producer()
    if q is None or q.op_type != "QuantizeLinear":
        return "input A does not come from QuantizeLinear"
    w8, w_scale = required_input(w_dq, 0), required_input(w_dq, 1)
    if w8.const_value is None or len(shape_of(w8)) != 2:
        return "the weight is not a 2-D float8 initializer"
    if w_scale.const_value is None or w_scale.const_value.size != 1:
        return "per-channel weight scales (GemmFloat8 takes one scale per input)"
    fa, fw = a8.dtype, w8.dtype
    if fa not in _CUDA_FP8 or fw not in _CUDA_FP8:
        return "format without a CUDA float8 GEMM (only e4m3fn and e5m2)"
    if fa != fw:
        return "mixed E4M3/E5M2 inputs (onnxruntime issue 20869)"
    if fa == ir.DataType.FLOAT8E5M2:
        return "E5M2 x E5M2 (cuBLASLt's float8 GEMM needs at least one E4M3 input)"
    return None


def _weight_nk(graph: ir.Graph, node: ir.Node, w8: ir.Value) -> tuple[ir.Value, int, int]:
    """(the float8 weight as [N, K], N, K): a Gemm's with transB as it is, else its transpose, computed
    when the model is written (a new initializer ``<weight>/nk``)."""
    k, n = dim(w8, 0), dim(w8, 1)  # MatMul weight [K, N]; Gemm: [K, N] or [N, K] with transB
    if node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0:
        return w8, k, n
    source = constant(w8)
    tensor = ir.LazyTensor(functools.partial(transposed, source), dtype=dtype_of(w8), shape=ir.Shape([n, k]))
    return initializer(graph, f"{w8.name}/nk", tensor), n, k


@dataclasses.dataclass
class LoweringResult(ir.passes.PassResult):
    """What one run lowered (node names) and what it left as Q/DQ, with the reason."""

    lowered: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)


class LowerGemmFloat8Pass(ir.passes.InPlacePass):
    """requires: float8 Q/DQ (opset >= 19); ensures: no MatMul/Gemm that could be lowered is left
    (each remaining one has a reason), and GemmFloat8 nodes come with the com.microsoft opset.
    Results are returned per call (:class:`LoweringResult`), never kept on the instance, so a
    reused instance reports each run."""

    def requires(self, model: ir.Model) -> None:
        if model.opset_imports.get("", 0) < 19:
            raise ir.passes.PreconditionError("float8 Q/DQ needs opset >= 19; upgrade the model first")

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            if node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx") and _reason(node) is None:
                raise ir.passes.PostconditionError(f"{node.name!r} could be lowered and was not")
            if node.op_type == "GemmFloat8" and MS_DOMAIN not in model.opset_imports:
                raise ir.passes.PostconditionError(f"{node.name!r} is GemmFloat8 without the {MS_DOMAIN} opset")

    def call(self, model: ir.Model) -> LoweringResult:
        graph = model.graph
        lowered: list[str] = []
        skipped: dict[str, str] = {}
        for node in list(graph):
            if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
                continue
            reason = _reason(node)
            if reason:
                if _dq_of(node.inputs[0]) or _dq_of(node.inputs[1]):
                    skipped[name_of(node)] = reason
                continue
            self._lower(graph, node)
            lowered.append(name_of(node))
        if lowered:
            ir.passes.common.RemoveUnusedNodesPass()(model)
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            logger.info("lowered %d MatMul/Gemm nodes to GemmFloat8", len(lowered))
        return LoweringResult(model, bool(lowered), lowered, skipped)

    def _lower(self, graph: ir.Graph, node: ir.Node) -> None:
        name = name_of(node)
        act_dq, w_dq = _dq_of(node.inputs[0]), _dq_of(node.inputs[1])
        if act_dq is None or w_dq is None:
            raise ir.passes.PreconditionError(
                f"{node.op_type} node {name!r} does not read two DequantizeLinear outputs."
            )
        a8, a_scale = required_input(act_dq, 0), required_input(act_dq, 1)
        w8, w_scale = required_input(w_dq, 0), required_input(w_dq, 1)
        out = node.outputs[0]
        weight_nk, n, k = _weight_nk(graph, node, w8)

        def const(suffix, array):
            return initializer(graph, f"{name}/{suffix}", array)

        tape = ir.tape.Tape()

        def op(op_type, inputs, suffix, domain="", **attrs):
            out = tape.op(op_type, inputs, attrs or None, domain=domain, name=f"{name}/{suffix}")
            out.name = f"{name}/{suffix}"
            return out

        def f32(scale):
            return scale if scale.dtype == ir.DataType.FLOAT else op("Cast", [scale], f"{scale.name}_f32", to=1)

        rank = len(a8.shape) if a8.shape is not None else 2
        a2d = a8 if rank == 2 else op("Reshape", [a8, const("shape_2d", np.array([-1, k], np.int64))], "a_2d")
        alpha = node.attributes.get_float("alpha", 1.0) if node.op_type == "Gemm" else 1.0
        y = op(
            "GemmFloat8",
            [a2d, weight_nk, None, f32(a_scale), f32(w_scale)],
            "gemm_float8",
            domain=MS_DOMAIN,
            transA=0,
            transB=1,
            alpha=float(alpha),
            dtype=int(ir.DataType.FLOAT16),
        )
        if rank != 2:
            lead = op("Shape", [a8], "lead_dims", end=-1)
            y = op(
                "Reshape", [y, op("Concat", [lead, const("n", np.array([n], np.int64))], "out_shape", axis=0)], "y_nd"
            )
        if out.dtype is not None and out.dtype != ir.DataType.FLOAT16:
            y = op("Cast", [y], "y_cast", to=int(out.dtype))
        bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
        if bias is not None:
            beta = node.attributes.get_float("beta", 1.0)
            if beta != 1.0:
                bias = op("Mul", [bias, const("beta", np.array(beta, dtype_of(bias).numpy()))], "beta_c")
            y = op("Add", [y, bias], "bias")
        y.dtype, y.shape = out.dtype, out.shape
        graph.insert_before(node, list(tape.nodes))
        out.replace_all_uses_with(y, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        old = out.name
        out.name = f"{old}/replaced"
        y.name = old
