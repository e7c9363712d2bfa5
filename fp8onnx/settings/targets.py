"""What a deployment target accepts, checked on a finished model.

TensorRT (explicit quantization, FP8): float8 QuantizeLinear/DequantizeLinear in E4M3FN only; zero points
absent or zero; scales constant, positive and finite; activations quantized per tensor; weights
float8 initializers with DequantizeLinear only, per tensor or per output channel; no custom-domain
GEMMs. ``check_tensorrt`` lists every violation as "node: reason"; an empty list means none found.

onnxruntime's CUDA EP (``onnxruntime-cuda``): float8 Q/DQ in E4M3FN and E5M2 only, and no blocked float8
DequantizeLinear (its kernels implement ``block_size`` for int4 only): block-scaled weights are written in
the per-axis form (:meth:`fp8onnx.passes.InsertQDQPass._blocks_per_axis`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format, format_of
from fp8onnx.passes import output_channel_axis

__all__ = ["TARGETS", "check_tensorrt"]

TARGETS = ("onnxruntime", "onnxruntime-cuda", "tensorrt")


def _scale_problem(scale: ir.Value | None) -> str | None:
    if scale is None or scale.const_value is None:
        return "scale is computed at run time; TensorRT needs constant scales (use static activations)"
    arr = scale.const_value.numpy().astype(np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        return "scale is not positive and finite"
    return None


def check_tensorrt(model: ir.Model) -> list[str]:
    problems = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        where = node.name or node.op_type
        if node.domain not in ("", "ai.onnx") and node.op_type == "GemmFloat8":
            problems.append(f"{where}: com.microsoft.GemmFloat8 is onnxruntime-only (drop --native-gemm)")
            continue
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        fp8 = node.outputs[0] if node.op_type == "QuantizeLinear" else node.inputs[0]
        if fp8 is None:  # a required input left out: not a model onnxruntime or TensorRT loads
            raise Fp8OnnxError(f"{node.op_type} {where!r} has no input x (its first input is required).")
        if format_of(fp8.dtype) not in (None, Fp8Format.E4M3FN):
            problems.append(f"{where}: {fp8.dtype} - TensorRT's FP8 is E4M3FN only")
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        if zero_point is not None and (
            zero_point.const_value is None or np.any(zero_point.const_value.numpy().astype(np.float32))
        ):
            problems.append(f"{where}: non-zero zero point")
        scale = node.inputs[1]
        reason = _scale_problem(scale)
        if reason or scale is None or scale.const_value is None:  # the last two: a reason given
            problems.append(f"{where}: {reason}")
            continue
        if node.attributes.get_int("block_size", 0):
            problems.append(f"{where}: block-wise scales (block_size {node.attributes.get_int('block_size', 0)})")
            continue
        if (node.outputs[0].name or "").endswith("/block_rows"):  # fp8onnx's per-axis form of block scales
            block = "?" if fp8.shape is None else fp8.shape[-1]
            problems.append(f"{where}: block-wise scales (per-axis form, block {block})")
            continue
        per_axis = scale.const_value.size > 1
        is_weight = node.op_type == "DequantizeLinear" and fp8.const_value is not None
        if per_axis and not is_weight:
            problems.append(f"{where}: activations must be quantized per tensor")
        if per_axis and is_weight and not _axis_is_output_channel(node, fp8):
            problems.append(f"{where}: per-channel weight scale is not along the output channel")
    return problems


def _axis_is_output_channel(dq: ir.Node, weight: ir.Value) -> bool:
    """Whether the per-axis scales of ``dq`` (reading the constant ``weight``) run along the output
    channel of every node that reads it."""
    if weight.shape is None:
        raise Fp8OnnxError(f"the weight {weight.name!r} of DequantizeLinear {dq.name!r} has no shape.")
    rank = len(weight.shape)
    axis = dq.attributes.get_int("axis", 1) % rank
    for use in dq.outputs[0].uses():
        expected = output_channel_axis(use.node, use.idx, rank)
        if expected is None:
            return False
        if axis != expected:
            return False
    return True
