"""--target tensorrt: only what TensorRT's FP8 takes, and a check that says what it would reject."""

import onnx_ir as ir
import pytest

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.settings.targets import check_tensorrt

from helpers import SAMPLE, mlp_data, mlp_model


@pytest.mark.parametrize("per_channel", [False, True])
def test_tensorrt_target_output_meets_the_rules(tmp_path, per_channel):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    report = fp8onnx.quantize(
        path, tmp_path / "q.onnx", data, target="tensorrt", per_channel=per_channel, provider="cpu"
    )
    assert report.target_problems == []
    assert (
        "TensorRT rules (E4M3FN, zero points 0, constant scales, per-tensor activations): all met" in report.summary()
    )
    assert fp8onnx.inspect(tmp_path / "q.onnx")["tensorrt_problems"] == []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"format": "e5m2"}, "--target tensorrt takes e4m3fn only"),
        ({"weight_format": "e4m3fn", "activation_format": "e5m2"}, "--target tensorrt takes e4m3fn only"),
        ({"activations": "dynamic"}, "needs constant scales"),
        ({"native_gemm": True}, "needs constant scales"),
        ({"target": "tpu"}, "Unknown --target 'tpu'"),
    ],
)
def test_tensorrt_target_refuses_what_it_cannot_take(tmp_path, options, message):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    options = {"target": "tensorrt", **options}
    with pytest.raises(Fp8OnnxError, match=message):
        fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu", **options)


def test_check_names_what_tensorrt_would_reject(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    fp8onnx.quantize(path, tmp_path / "e5.onnx", data, format="e5m2", provider="cpu")
    problems = check_tensorrt(ir.load(tmp_path / "e5.onnx"))
    assert problems and all("TensorRT's FP8 is E4M3FN only" in p for p in problems)
    fp8onnx.quantize(path, tmp_path / "dyn.onnx", activations="dynamic", provider="cpu")
    problems = check_tensorrt(ir.load(tmp_path / "dyn.onnx"))
    assert len(problems) == 4 and all("TensorRT needs constant scales" in p for p in problems)  # 2 Q + 2 DQ
    fp8onnx.quantize(
        SAMPLE / "decoder.onnx", tmp_path / "n.onnx", SAMPLE / "calib.npz", native_gemm=True, provider="cpu"
    )
    problems = check_tensorrt(ir.load(tmp_path / "n.onnx"))
    assert len(problems) == 29 and all("onnxruntime-only" in p for p in problems)
    assert "TensorRT: " in __import__("fp8onnx.workflows.api", fromlist=["x"]).inspect_summary(
        fp8onnx.inspect(tmp_path / "e5.onnx")
    )
