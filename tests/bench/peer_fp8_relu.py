"""onnxruntime's own FP8 quantizer (``quantize_static``, QFLOAT8E4M3FN) and fp8onnx on MatMul -> Relu -> MatMul,
each output run at every onnxruntime optimisation level against FP32 (relative L2 error): the observation
behind docs/peers.md's note on removed Relus. Also what ``quantize_static`` refuses for FP8 (MinMax
calibration) and what ``quantize_dynamic`` with FP8 weights writes (a model onnxruntime does not load).

Usage: python tests/bench/peer_fp8_relu.py [--out DIR] [--json docs/results/peer_fp8_relu.json]   (a toy graph; seconds)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

import fp8onnx

LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")


class _Reader(CalibrationDataReader):
    def __init__(self, x: np.ndarray):
        self.it = iter([{"x": x[i : i + 4]} for i in range(0, len(x), 4)])

    def get_next(self):
        return next(self.it, None)


def relu_model(path: pathlib.Path, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """MatMul -> Relu -> MatMul (x [n, 64] -> y [n, 16]) written to ``path`` (opset 17); its two weights."""
    w1, w2 = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("x", ["n", 64]), ("y", ["n", 16]))]
    weights = [numpy_helper.from_array(w, n) for n, w in (("w1", w1), ("w2", w2))]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return w1, w2


def _error(path: pathlib.Path, level: str, x: np.ndarray, ref: np.ndarray) -> float:
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.log_severity_level = 3
    y = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    out = args.out or pathlib.Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    model = out / "m.onnx"
    w1, w2 = relu_model(model, rng)
    calib = rng.standard_normal((32, 64)).astype(np.float32)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    ref = np.maximum(x @ w1, 0) @ w2
    fp8 = {"quant_format": QuantFormat.QDQ, "activation_type": QuantType.QFLOAT8E4M3FN}
    fp8["weight_type"] = QuantType.QFLOAT8E4M3FN
    results: dict = {"relative_error": {}}
    try:
        quantize_static(str(model), str(out / "minmax.onnx"), _Reader(calib), **fp8)
    except ValueError as exc:
        results["minmax"] = str(exc)
        print(f"quantize_static, default MinMax calibration: {exc}")
    written = {}
    for name, extra in (("ort_default", None), ("ort_keep_relu", {"QDQKeepRemovableActivations": True})):
        path = out / f"{name}.onnx"
        quantize_static(str(model), str(path), _Reader(calib), **fp8, calibrate_method=CalibrationMethod.Distribution,
                        extra_options=extra)  # fmt: skip
        written[f"quantize_static ({name})"] = path
    np.savez(out / "calib.npz", x=calib)
    written["fp8onnx"] = out / "fp8onnx.onnx"
    fp8onnx.quantize(model, written["fp8onnx"], out / "calib.npz", provider="cpu", preset="none", batch_size=4)
    for what, path in written.items():
        ops = [n.op_type for n in onnx.load(path).graph.node if n.op_type in ("Relu", "MatMul")]
        found = {lvl: _error(path, lvl, x, ref) for lvl in LEVELS}
        results["relative_error"][what] = {"ops": "+".join(ops), **found}
        errors = ", ".join(f"{lvl.removeprefix('ORT_')} {e:.4f}" for lvl, e in found.items())
        print(f"{what}: {'+'.join(ops)}; relative error vs FP32: {errors}")
    dyn = out / "dynamic.onnx"
    quantize_dynamic(str(model), str(dyn), weight_type=QuantType.QFLOAT8E4M3FN)
    try:
        ort.InferenceSession(str(dyn), providers=["CPUExecutionProvider"])
        results["dynamic"] = "loads"
    except Exception as exc:
        results["dynamic"] = f"does not load ({str(exc).splitlines()[0][:160]})"
    print(f"quantize_dynamic with FP8 weights: {results['dynamic']}")
    print(f"onnxruntime {ort.__version__}, fp8onnx {fp8onnx.__version__}")
    if args.json:
        import datetime
        import platform

        results.update(
            onnxruntime=ort.__version__, fp8onnx=fp8onnx.__version__, machine=platform.processor() or platform.machine()
        )
        results["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
