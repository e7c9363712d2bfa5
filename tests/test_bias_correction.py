"""Bias correction: the mean output error of FP8 weights is cancelled on inputs like the calibration data."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError

from helpers import run_ort, run_reference


def layer(path, op, rng):
    """x (mean far from 0) -> Gemm / MatMul+Add / Conv with a bias."""
    if op == "Conv":
        w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])]
        shapes = (["n", 4, 8, 8], ["n", 8, 8, 8])
    else:
        w = rng.standard_normal((32, 16)).astype(np.float32)
        nodes = (
            [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm")]
            if op == "Gemm"
            else [
                helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                helper.make_node("Add", ["h", "b"], ["y"], name="add"),
            ]
        )
        shapes = (["n", 32], ["n", 16])
    b = rng.standard_normal(w.shape[0] if op == "Conv" else 16).astype(np.float32)
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shapes[0])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shapes[1])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    shape = (512, 4, 8, 8) if op == "Conv" else (512, 32)
    means = rng.uniform(2, 6, shape[1])  # per input channel, far from zero
    x = (rng.standard_normal(shape) * 0.5 + means.reshape((1, -1) + (1,) * (len(shape) - 2))).astype(np.float32)
    return path, x


@pytest.mark.parametrize("op", ["Gemm", "MatMul", "Conv"])
def test_bias_correction_removes_the_mean_error(tmp_path, op):
    rng = np.random.default_rng(0)
    path, x = layer(tmp_path / "m.onnx", op, rng)
    np.savez(tmp_path / "calib.npz", x=x[:256])
    held_out = {"x": x[256:]}
    ref = run_ort(path, held_out)[0]
    mean_error = {}
    for corrected in (False, True):
        out = tmp_path / f"q{corrected}.onnx"
        report = fp8onnx.quantize(
            path,
            out,
            tmp_path / "calib.npz",
            op_types=("MatMul", "Gemm", "Conv"),
            bias_correction=corrected,
            preset="none",
        )
        got = run_ort(out, held_out)[0]
        axes = (0, 2, 3) if op == "Conv" else (0,)
        mean_error[corrected] = np.abs((got - ref).mean(axis=axes)).mean()
    assert any("bias correction of 1 layers" in p for p in report.prepared)
    assert mean_error[True] < 0.2 * mean_error[False]
    assert np.allclose(run_reference(out, held_out)[0], run_ort(out, held_out)[0], rtol=1e-4, atol=1e-3)


def test_bias_correction_needs_calibration(tmp_path):
    path, _ = layer(tmp_path / "m.onnx", "Gemm", np.random.default_rng(1))
    with pytest.raises(Fp8OnnxError, match="--bias-correction needs --calib DATA"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="none", bias_correction=True)


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_bias_correction_after_gptq_corrects_what_gptq_left(tmp_path, op):
    """With GPTQ, the shift is E[x] (W - GPTQ's W): measured against the float weight, not against the
    rounded one (which made it zero), in the same pass as the Hessians."""
    rng = np.random.default_rng(2)
    path, x = layer(tmp_path / "m.onnx", op, rng)
    np.savez(tmp_path / "calib.npz", x=x[:256])
    held_out = {"x": x[256:]}
    ref = run_ort(path, held_out)[0]
    mean_error, biases = {}, {}
    for corrected in (False, True):
        out = tmp_path / f"q{corrected}.onnx"
        report = fp8onnx.quantize(
            path, out, tmp_path / "calib.npz", weight_rounding="gptq", bias_correction=corrected, preset="none"
        )
        mean_error[corrected] = np.abs((run_ort(out, held_out)[0] - ref).mean(axis=0)).mean()
        biases[corrected] = numpy_helper.to_array(next(t for t in onnx.load(out).graph.initializer if t.name == "b"))
    assert any("bias correction of 1 layers" in p for p in report.prepared)
    assert not np.array_equal(biases[True], biases[False])
    assert mean_error[True] < mean_error[False]
