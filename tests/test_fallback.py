"""Quantize to a stated accuracy: the fewest, most sensitive nodes stay in float until the target holds."""

import numpy as np
import onnx
import pytest
from test_sensitivity import chain

import fp8onnx
from fp8onnx.errors import Fp8OnnxError
from fp8onnx.fallback import quantize_to_target


@pytest.fixture
def outlier_chain(tmp_path):
    path, calib = chain(tmp_path / "m.onnx", outlier=True)
    x = np.abs(np.random.default_rng(5).standard_normal((32, 16))).astype(np.float32)
    np.savez(tmp_path / "eval.npz", x=x)
    return path, calib, tmp_path / "eval.npz"


def test_the_sensitive_node_is_kept_and_the_target_holds(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    result = quantize_to_target(path, out, calib, eval_data, target=99.9, provider="cpu")
    assert result.met and result.kept_in_float == ["second"]
    assert result.tried[0] < 0.999 <= result.tried[1]
    assert [n.name for n in result.report.quantized] == ["first"]
    reason = {n.name: n.reason for n in result.report.skipped}["second"]
    assert reason.startswith("kept in float for --accuracy-target")
    producers = {o: n.op_type for n in onnx.load(out).graph.node for o in n.output}
    second = next(n for n in onnx.load(out).graph.node if n.name == "second")
    assert producers[second.input[0]] != "DequantizeLinear"  # really left in float
    check = fp8onnx.compare(path, [out], eval_data, provider="cpu")
    assert check.rows[-1].ratio_to_fp16 >= 0.999


def test_an_unreachable_target_writes_the_closest_and_says_so(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    result = quantize_to_target(path, tmp_path / "q.onnx", calib, eval_data, target=99.9, max_float_nodes=0)
    assert not result.met and list(result.tried) == [0] and result.kept_in_float == []
    assert "NOT met" in result.summary()
    assert (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("target", [0.0, 100.5])
def test_target_is_a_percentage(tmp_path, outlier_chain, target):
    path, calib, eval_data = outlier_chain
    with pytest.raises(Fp8OnnxError, match="must be a percentage in"):
        quantize_to_target(path, tmp_path / "q.onnx", calib, eval_data, target=target)


def test_the_report_says_how_the_target_was_met(tmp_path, outlier_chain):
    import json

    path, calib, eval_data = outlier_chain
    quantize_to_target(path, tmp_path / "q.onnx", calib, eval_data, target=99.9, report=tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["accuracy_target"]["kept_in_float"] == ["second"] and doc["accuracy_target"]["met"] is True
    assert [n["name"] for n in doc["sensitivity"]] == ["first", "second"]
    assert doc["sensitivity"][1]["rank"] == 1 and doc["nodes"][0]["name"] == "first"
