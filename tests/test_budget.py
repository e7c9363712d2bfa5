"""The FP8 error budget (fp8onnx sensitivity --budget): per node, the weight's and the activation's
errors alone, and of the activation's the part from values clipped or below E4M3's smallest normal
(range) against rounding (mantissa); checked against NumPy's Q/DQ of the same tensors, and on graphs
built so that each kind dominates."""

import json
import math

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from test_sensitivity import chain

from fp8onnx.accuracy.sensitivity import measure_sensitivity
from fp8onnx.cli import main
from fp8onnx.numerics.formats import Fp8Format, dequantize, quantize
from fp8onnx.numerics.scaling import amax_to_scale

E4M3 = Fp8Format.E4M3FN


def _one_matmul(tmp_path, x: np.ndarray, w: np.ndarray):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", x.shape[1]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", w.shape[1]])],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "one.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    np.savez(tmp_path / "x.npz", x=x)
    return path, tmp_path / "x.npz"


def _qdq(a: np.ndarray) -> np.ndarray:
    s = amax_to_scale(float(np.abs(a).max()), E4M3)
    return dequantize(quantize(a, s, E4M3), s)


def _rel(y, ref) -> float:
    return float(((y.astype(np.float64) - ref) ** 2).sum() / (ref**2).sum())


def test_the_split_is_numpys_qdq_of_each_input(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x[:, 3] *= 1e4  # one outlier channel: under one scale, most values fall below E4M3's smallest normal
    w = (rng.standard_normal((32, 16)) / 6).astype(np.float32)
    w[3] *= 1e-4  # and small weights read it (an LLM's massive activations): the other channels carry y
    path, data = _one_matmul(tmp_path, x, w)
    result = measure_sensitivity(path, data, provider="cpu", budget=True)
    (row,) = result.budget
    ref = x.astype(np.float64) @ w
    xq = _qdq(x)
    s = amax_to_scale(float(np.abs(x).max()), E4M3)
    top = E4M3.fmax * (1 + 2.0 ** -(E4M3.mantissa_bits + 1)) * s  # beyond rounding to the largest value
    out = (np.abs(x) > top) | ((np.abs(x) < 2.0**E4M3.min_normal_exponent * s) & (x != 0))
    x_range = np.where(out, xq, x)
    # onnxruntime's float32 MatMul against NumPy's float64: relative errors agree to 1e-3 of themselves
    assert row.weight_rel_err == pytest.approx(_rel(x @ _qdq(w), ref), rel=1e-3)
    assert row.activation_rel_err == pytest.approx(_rel(xq @ w, ref), rel=1e-3)
    assert row.range_rel_err == pytest.approx(_rel(x_range @ w, ref), rel=1e-3)
    assert row.below_normal == pytest.approx(out.mean()) and row.clipped == 0.0  # amax scaling clips nothing
    assert row.below_normal > 0.5 and row.verdict() == "activation (range)"
    assert row.share == 1.0 and row.rel_err == pytest.approx(10 ** (-result.nodes[0].sqnr_db / 10), rel=1e-9)


def test_a_mantissa_bound_activation_and_a_weight_bound_node(tmp_path):
    """Gaussian activations (no outlier): the activation's error is rounding. The chain's second weight
    holds a 1e5 outlier: its per-tensor scale flushes the other weights, so its weight dominates."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    path, data = _one_matmul(tmp_path, x, (rng.standard_normal((32, 16)) / 6).astype(np.float32))
    (row,) = measure_sensitivity(path, data, provider="cpu", budget=True).budget
    assert row.range_share < 0.05 and row.clipped == 0.0
    path, calib = chain(tmp_path / "chain.onnx", outlier=True)
    rows = {r.name: r for r in measure_sensitivity(path, calib, provider="cpu", budget=True).budget}
    assert rows["second"].verdict() == "weight" and rows["second"].share > 0.9
    assert math.isclose(sum(r.share for r in rows.values()), 1.0)


def test_dynamic_activations_get_no_range_split(tmp_path):
    rng = np.random.default_rng(2)
    path, data = _one_matmul(tmp_path, rng.standard_normal((8, 32)).astype(np.float32), np.ones((32, 4), np.float32))
    (row,) = measure_sensitivity(path, None, data, provider="cpu", budget=True, activations="dynamic").budget
    assert row.activation_rel_err is not None and row.range_rel_err is None and row.clipped is None


def test_the_cli_prints_and_writes_the_budget(tmp_path):
    path, calib = chain(tmp_path / "chain.onnx", outlier=False)
    args = ["sensitivity", str(path), "--calib", str(calib), "--budget", "--json", str(tmp_path / "s.json")]
    r = CliRunner().invoke(main, [*args, "--provider", "cpu"])
    assert r.exit_code == 0, r.output
    assert "FP8 error budget" in r.output and "mostly" in r.output
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [b["name"] for b in doc["budget"]] == ["first", "second"]
    assert {"share", "weight_rel_err", "activation_rel_err", "range_share", "mostly"} <= set(doc["budget"][0])
