"""Sensitivity: the SQNR of each node's output with only it in FP8, all nodes in one pass."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.cli import main
from fp8onnx.errors import Fp8OnnxError
from fp8onnx.runtime import make_session
from fp8onnx.sensitivity import sensitivity

from helpers import SAMPLE, sqnr_db


def chain(path, outlier: bool):
    """x (positive) -> MatMul(a) -> Relu -> MatMul(b) -> y. Column 0 of ``a`` is negative, so channel 0
    of the Relu is always 0; with ``outlier`` the weight of ``b`` that reads it is 1e5: it changes
    nothing in float, but its per-tensor E4M3 scale flushes b's other weights to (near) zero."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((16, 32)) * 0.25).astype(np.float32)
    a[:, 0] = -1.0
    b = (rng.standard_normal((32, 8)) * 0.25).astype(np.float32)
    if outlier:
        b[0, 0] = 1e5
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "a"], ["h"], name="first"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "b"], ["y"], name="second"),
        ],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    np.savez(path.with_suffix(".npz"), x=np.abs(rng.standard_normal((48, 16))).astype(np.float32))
    return path, path.with_suffix(".npz")


def test_one_node_equals_the_quantized_model(tmp_path):
    """With one quantizable node, its sensitivity is exactly the SQNR of the quantized model's output."""
    path = tmp_path / "one.onnx"
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="only")],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    result = sensitivity(path, tmp_path / "d.npz", provider="cpu", batch_size=40)
    fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu", batch_size=40)
    ref = make_session(path, "cpu").run(None, {"x": x})[0]
    got = make_session(tmp_path / "q.onnx", "cpu").run(None, {"x": x})[0]
    (node,) = result.nodes
    assert node.name == "only" and node.rank == 1
    assert node.sqnr_db == pytest.approx(sqnr_db(ref, got), abs=0.01)


def test_the_outlier_node_ranks_first(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=True)
    result = sensitivity(path, data, provider="cpu")
    assert [n.name for n in result.ranked()] == ["second", "first"]
    first, second = (next(n for n in result.nodes if n.name == k) for k in ("first", "second"))
    assert second.sqnr_db < first.sqnr_db - 10
    plain = sensitivity(*chain(tmp_path / "p.onnx", outlier=False), provider="cpu")
    assert all(20 < n.sqnr_db < 40 for n in plain.ranked())  # one E4M3 rounding of input and weight


def test_sample_decoder_every_weight_matmul_measured():
    result = sensitivity(SAMPLE / "decoder.onnx", SAMPLE / "calib.npz", SAMPLE / "eval.npz", provider="cpu")
    assert len(result.ranked()) == 29 and result.samples == 256
    assert sorted(n.rank for n in result.ranked()) == list(range(1, 30))
    assert all(np.isfinite(n.sqnr_db) and n.sqnr_db > 20 for n in result.ranked())
    unmeasured = [n for n in result.nodes if n.rank is None]
    assert len(unmeasured) == 8 and all("both inputs are activations" in n.reason for n in unmeasured)


def test_cli_table_json_and_plot(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=True)
    args = ["sensitivity", str(path), "--calib", str(data), "--json", str(tmp_path / "s.json")]
    r = CliRunner().invoke(main, [*args, "--plot", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "rank  node" in r.output and "   1  second" in r.output
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [n["name"] for n in doc["nodes"]] == ["first", "second"] and doc["samples"] == 48
    assert (tmp_path / "sensitivity.png").stat().st_size > 1000
    bad = CliRunner().invoke(main, ["sensitivity", str(path)])
    assert bad.exit_code == 2 and "need calibration" in bad.output
    same = CliRunner().invoke(main, [*args[:4], "--json", str(data)])
    assert same.exit_code == 2 and "would overwrite the calibration data" in same.output


def test_dynamic_activations_need_no_calibration_but_data(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=False)
    result = sensitivity(path, data=data, activations="dynamic", provider="cpu")
    assert len(result.ranked()) == 2
    with pytest.raises(Fp8OnnxError, match="needs data to run on"):
        sensitivity(path, activations="dynamic", provider="cpu")
