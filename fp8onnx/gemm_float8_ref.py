"""NumPy reference of onnxruntime's ``com.microsoft.GemmFloat8`` (CUDA, cuBLASLt), as fp8onnx emits it.

Read from onnxruntime's kernel (``contrib_ops/cuda/math/gemm_float8.cc``): inputs A, B, optional C,
then float32 scalars scaleA, scaleB, scaleY; cuBLASLt computes
``Y = scaleY * (alpha * scaleA * scaleB * op(A) @ op(B) + beta * C)`` with float32 accumulation,
where scaleY only applies to a float8 output. fp8onnx emits float16 output, no C, transA=0,
transB=1 (the "TN" layout cuBLASLt requires for float8), so ``Y = alpha*sA*sB * A @ B.T`` in fp16.
This function is what the CPU tests run in place of the CUDA kernel; a GPU run checks it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["gemm_float8"]


def gemm_float8(
    a,
    b,
    c=None,
    scale_a=1.0,
    scale_b=1.0,
    scale_y=1.0,
    *,
    trans_a=0,
    trans_b=0,
    alpha=1.0,
    beta=0.0,
    out_dtype=np.float16,
) -> np.ndarray:
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
