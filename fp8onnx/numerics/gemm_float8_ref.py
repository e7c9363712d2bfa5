"""NumPy references of onnxruntime's CUDA-only float8 GEMMs: ``com.microsoft.GemmFloat8`` (cuBLASLt,
as fp8onnx emits it) and ``com.microsoft.MatMulBlockQuantizedFp8Weight``.

Read from onnxruntime's kernel (``contrib_ops/cuda/math/gemm_float8.cc``): inputs A, B, optional C,
then float32 scalars scaleA, scaleB, scaleY; cuBLASLt computes
``Y = scaleY * (alpha * scaleA * scaleB * op(A) @ op(B) + beta * C)`` with float32 accumulation,
where scaleY only applies to a float8 output. fp8onnx emits float16 output, no C, transA=0,
transB=1 (the "TN" layout cuBLASLt requires for float8), so ``Y = alpha*sA*sB * A @ B.T`` in fp16.
This function is what the CPU tests run in place of the CUDA kernel; a GPU run checks it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["gemm_float8", "matmul_block_quantized_fp8_weight", "run_with_gemm_float8"]


def gemm_float8(
    a,
    b,
    c=None,
    scales=(1.0, 1.0, 1.0),
    *,
    trans_a=0,
    trans_b=0,
    alpha=1.0,
    beta=0.0,
    out_dtype=np.float16,
) -> np.ndarray:
    """``com.microsoft.GemmFloat8``: ``alpha * scale_a * scale_b * (A' @ B') + beta * C``, with ``scales`` =
    (scale_a, scale_b, scale_y); ``scale_y`` multiplies a float8 output into its range."""
    scale_a, scale_b, scale_y = scales
    a32 = np.asarray(a).astype(np.float32)
    b32 = np.asarray(b).astype(np.float32)
    if a32.ndim != 2 or b32.ndim != 2:
        raise ValueError("GemmFloat8 takes 2-D A and B")
    a32 = a32.T if trans_a else a32
    b32 = b32.T if trans_b else b32
    y = np.float32(alpha) * np.float32(scale_a) * np.float32(scale_b) * (a32 @ b32)
    if c is not None and beta:
        y = y + np.float32(beta) * np.asarray(c, np.float32)
    out_dtype = np.dtype(out_dtype)
    if out_dtype.itemsize == 1:  # a float8 output is scaled into its range
        y = y * np.float32(scale_y)
    return y.astype(out_dtype)


def run_with_gemm_float8(model, feed: dict) -> list[np.ndarray]:
    """``model`` (a ModelProto) on onnx.reference, with :func:`gemm_float8` standing in for the CUDA-only
    ``com.microsoft.GemmFloat8``: what the CPU tests and the GPU check compare the op's graph with."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    class GemmFloat8(OpRun):
        op_domain = "com.microsoft"

        def _run(self, a, b, c=None, scale_a=None, scale_b=None, scale_y=None, **attrs):
            y_scale = 1.0 if scale_y is None else scale_y
            out = onnx.helper.tensor_dtype_to_np_dtype(attrs.get("dtype", 1))
            op = {"trans_a": attrs.get("transA", 0), "trans_b": attrs.get("transB", 0)}
            op.update(alpha=attrs.get("alpha", 1.0), beta=attrs.get("beta", 0.0), out_dtype=out)
            return (gemm_float8(a, b, c, (scale_a, scale_b, y_scale), **op),)

    return list(ReferenceEvaluator(model, new_ops=[GemmFloat8]).run(None, feed))  # outputs in the graph's order


def matmul_block_quantized_fp8_weight(a, b, b_scale, a_scale=None, bias=None, *, block_size: int = 128) -> np.ndarray:
    """``com.microsoft.MatMulBlockQuantizedFp8Weight`` from its schema text (onnxruntime 1.29+):
    ``B_scaled[n, k] = fp8_e4m3(B[n, k]) * b_scale[n, k // block_size]``; with ``a_scale``,
    ``A_scaled = fp8_e4m3(A / a_scale) * a_scale``, else A; ``Y = A_scaled @ B_scaled^T + bias`` in A's
    type. Where the schema leaves it open, as the CUDA kernel's default path does it
    (``contrib_ops/cuda/math/matmul_block_scaled_fp8.cu``): B_scaled computed in float32 and rounded to
    A's type; A divided as a multiplication by the float32 reciprocal, saturated to E4M3's +-448, the
    result rounded to A's type; float32 accumulation; Y rounded to A's type before the bias is added
    in float32 and rounded again. ``a``: float16 (or bfloat16) [..., K]; ``b``: float8e4m3fn [N, K]."""
    import ml_dtypes

    a = np.asarray(a)
    t = a.dtype
    n, k = b.shape
    scales = np.asarray(b_scale, np.float32)
    blocks = -(-k // block_size)
    if scales.shape != (n, blocks):
        raise ValueError(f"b_scale must be [N, ceil(K / block_size)] = [{n}, {blocks}], got {scales.shape}")
    w = np.asarray(b).astype(np.float32) * np.repeat(scales, block_size, axis=1)[:, :k]
    w = w.astype(t).astype(np.float32)
    x = a.astype(np.float32)
    if a_scale is not None:
        s = np.float32(np.asarray(a_scale, np.float32).reshape(()))
        inverse = np.float32(1) / s if s != 0 else np.float32(0)
        q = np.clip(x * inverse, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        x = (q.astype(np.float32) * s).astype(t).astype(np.float32)
    y = np.matmul(x, w.T).astype(t)
    if bias is not None:
        y = (y.astype(np.float32) + np.asarray(bias).astype(np.float32)).astype(t)
    return y
