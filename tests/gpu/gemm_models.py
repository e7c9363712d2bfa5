"""The GPU check's single-GEMM models: one float16 MatMul per width, built with onnx.helper, and what
fp8onnx writes from it for each CUDA form.

Every model is ``y[M, N] = x[M, K] @ W[K, N]`` with float16 ``x`` and ``y`` (M is a dim param), opset 21.
The FP16 model is the baseline and the input of :func:`fp8onnx.quantize`, so each timed FP8 graph is the
one fp8onnx writes for a user (``target="onnxruntime-cuda"``, ``preset="none"``):

- ``fast_w8a16``: ``com.microsoft.MatMulBlockQuantizedFp8Weight`` without ``a_scale`` (``activations="none"``);
- ``fast_w8a8``: the same op with a static per-tensor ``a_scale`` (``activations="static"``); both with
  weight scales per block of 128 along K, the runtime's default and DeepGEMM's only block size;
- ``gemm_float8``: ``com.microsoft.GemmFloat8`` (``gemm_op="gemm-float8"``): per-tensor scales, E4M3
  inputs (a QuantizeLinear in front), float16 out;
- ``qdq``: float8 QuantizeLinear/DequantizeLinear around a float16 MatMul (``gemm_op="qdq"``, static
  activations), which the CUDA EP runs as dequantize + FP16 GEMM.
"""

from __future__ import annotations

import pathlib

import numpy as np

FORMS = ("fp16", "fast_w8a16", "fast_w8a8", "gemm_float8", "qdq")
# (K, N) at Llama-7B's widths: the attention projections, the MLP's up/gate and its down projection
WIDTHS = ((4096, 4096), (4096, 11008), (11008, 4096))
MS = (1, 2, 4, 8, 16, 32, 64, 128, 1024, 4096)  # decode (the GEMV path), mid, prefill
DRY_WIDTHS = ((128, 128), (128, 256), (256, 128))  # K a multiple of the 128-wide blocks
DRY_MS = (1, 16, 128)
CPU_FORMS = ("fp16", "fast_w8a16", "fast_w8a8", "qdq")  # the fast form emulated; GemmFloat8 is CUDA only

RECIPES = {
    "fast_w8a16": {"gemm_op": "block-fp8", "activations": "none"},
    "fast_w8a8": {"gemm_op": "block-fp8", "activations": "static"},
    "gemm_float8": {"gemm_op": "gemm-float8", "activations": "static", "precision": "fp16"},
    "qdq": {"gemm_op": "qdq", "activations": "static", "precision": "fp16"},
}


def width_key(k: int, n: int) -> str:
    return f"{k}x{n}"


def fp16_gemm(path: pathlib.Path, k: int, n: int, seed: int = 0) -> pathlib.Path:
    """The FP16 baseline: one MatMul with a random [K, N] float16 weight (scaled by 1/sqrt(K))."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="gemm")],
        f"gemm_{k}x{n}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["M", n])],
        [numpy_helper.from_array(weight, "w")],
    )
    # IR 10 (opset 21's): onnx 1.23 stamps 14 by default, which onnxruntime(-gpu) 1.31 refuses (it reads <= 13)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    return path


def build_width(root: pathlib.Path, k: int, n: int, forms=FORMS) -> dict[str, str]:
    """{form: model path} for one width: the FP16 model, then fp8onnx's output for each FP8 form."""
    import fp8onnx

    folder = root / width_key(k, n)
    folder.mkdir(parents=True, exist_ok=True)
    base = fp16_gemm(folder / "fp16.onnx", k, n)
    calib = folder / "calib.npz"
    np.savez(calib, x=np.random.default_rng(1).standard_normal((64, k)).astype(np.float16))
    paths = {"fp16": str(base)}
    for form in forms:
        if form == "fp16":
            continue
        recipe = RECIPES[form]
        data = None if recipe["activations"] == "none" else calib  # weight-only takes no data
        out = folder / f"{form}.onnx"
        fp8onnx.quantize(base, out, data, target="onnxruntime-cuda", preset="none", provider="cpu", **recipe)
        paths[form] = str(out)
    return paths


def build_all(root: pathlib.Path, widths, forms=FORMS, workers: int = 1) -> dict[str, dict[str, str]]:
    """{width: {form: path}}, one width per process when ``workers`` > 1 (fp8onnx's load check of the
    fast form runs its CPU emulation: seconds per Llama-7B width)."""
    if workers <= 1:
        return {width_key(k, n): build_width(root, k, n, forms) for k, n in widths}
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")  # no fork after onnxruntime's threads started
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(widths)), mp_context=spawn) as pool:
        jobs = {width_key(k, n): pool.submit(build_width, root, k, n, forms) for k, n in widths}
        return {key: job.result() for key, job in jobs.items()}
