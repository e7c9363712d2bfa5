"""Small graphs built in code, and the numeric checks every pass test uses."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

REPO = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = REPO / "models" / "decoder"


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref = np.asarray(reference, np.float64)
    noise = np.sum((ref - np.asarray(test, np.float64)) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref**2) / noise))


def run_ort(model: onnx.ModelProto | str | pathlib.Path, feed: dict, level: str = "default") -> list[np.ndarray]:
    """Run on the CPU EP at ORT's default optimisation level (as users do), or 'basic'."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if level == "basic":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feed)


def run_reference(model: onnx.ModelProto | str | pathlib.Path, feed: dict) -> list[np.ndarray]:
    m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    return ReferenceEvaluator(m).run(None, feed)


def mlp_model(
    path: pathlib.Path,
    *,
    opset: int = 17,
    hidden: int = 32,
    relu: bool = True,
    gemm: bool = True,
    dtype=np.float32,
    seed: int = 0,
    dynamic_batch: bool = True,
) -> pathlib.Path:
    """x[b,16] -> MatMul(W1) -> Relu -> Gemm(W2^T, bias, transB=1) -> y[b,8], plus an act x act MatMul."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((16, hidden)) * 0.3).astype(dtype)
    w2 = (rng.standard_normal((8, hidden)) * 0.3).astype(dtype)
    b2 = rng.standard_normal(8).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1")]
    act = "h"
    if relu:
        nodes.append(helper.make_node("Relu", ["h"], ["r"], name="relu"))
        act = "r"
    if gemm:
        nodes.append(helper.make_node("Gemm", [act, "w2", "b2"], ["y"], name="fc2", transB=1))
    else:
        nodes.append(helper.make_node("Transpose", ["w2"], ["w2t"], name="t", perm=[1, 0]))
        nodes.append(helper.make_node("MatMul", [act, "w2t"], ["y0"], name="fc2"))
        nodes.append(helper.make_node("Add", ["y0", "b2"], ["y"], name="bias"))
    # activation x activation: y^T y, opt-in only
    nodes.append(helper.make_node("Transpose", ["y"], ["yt"], name="yt", perm=[1, 0]))
    nodes.append(helper.make_node("MatMul", ["yt", "y"], ["gram"], name="gram"))
    batch = "batch" if dynamic_batch else 4
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", elem, [batch, 16])],
        [helper.make_tensor_value_info("y", elem, [batch, 8]), helper.make_tensor_value_info("gram", elem, [8, 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def mlp_data(path: pathlib.Path, n: int = 64, seed: int = 1, dtype=np.float32, **extra) -> pathlib.Path:
    x = np.random.default_rng(seed).standard_normal((n, 16)).astype(dtype)
    np.savez(path, x=x, **extra)
    return path


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def sqnr_floor_db(fmt, quantized_tensors: int, slack_db: float = 1.0) -> float:
    """The SQNR a chain of ``quantized_tensors`` per-tensor quantizations in ``fmt`` should beat.

    Rounding to a grid with relative step ``eps`` adds noise of relative power eps**2/12 per tensor
    (uniform error); independent errors add up, so n tensors cost 10*log10(n) dB more.
    """
    import ml_dtypes

    eps = float(ml_dtypes.finfo(fmt.np_dtype).eps)
    return 20 * np.log10(2 * np.sqrt(3) / eps) - 10 * np.log10(quantized_tensors) - slack_db
