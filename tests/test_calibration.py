import json

import numpy as np
import onnx_ir as ir
import pytest

import fp8onnx
from fp8onnx.calibration import Stats, collect_amax
from fp8onnx.errors import Fp8OnnxError
from fp8onnx.runtime import RunOptions

from helpers import mlp_data, mlp_model


def test_running_amax_equals_numpy_over_all_batches(tmp_path):
    model = ir.load(mlp_model(tmp_path / "m.onnx"))
    w1 = model.graph.initializers["w1"].const_value.numpy()
    rng = np.random.default_rng(0)
    feeds = [{"x": (rng.standard_normal((n, 16)) * s).astype(np.float32)} for n, s in [(4, 1), (7, 3), (1, 0.5)]]
    stats = collect_amax(model, ["x", "h", "r"], feeds, run=RunOptions(provider="cpu"))
    x = np.concatenate([f["x"] for f in feeds])
    assert stats.amax["x"] == pytest.approx(np.abs(x).max())
    assert stats.amax["h"] == pytest.approx(np.abs(x @ w1).max(), rel=1e-5)
    assert stats.amax["r"] == pytest.approx(np.maximum(x @ w1, 0).max(), rel=1e-5)
    assert (stats.num_batches, stats.num_samples) == (3, 12)


def test_all_zero_activations_give_zero_amax_and_a_valid_scale(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "zeros.npz", x=np.zeros((8, 16), np.float32))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "zeros.npz", provider="cpu")
    x_scale = next(t for n in report.quantized for t in n.tensors if t.name == "x")
    assert x_scale.amax == 0.0 and 0 < x_scale.scale < float("inf")


def test_calibrate_saves_stats_that_quantize_reuses(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    stats = fp8onnx.calibrate(path, data, tmp_path / "stats.json", batch_size=5, provider="cpu")
    doc = json.loads((tmp_path / "stats.json").read_text())
    assert set(doc["amax"]) == {"x", "r", "yt", "y"}  # every MatMul/Gemm activation, act x act included
    assert doc["num_samples"] == 64 and doc["num_batches"] == 13
    assert Stats.load(tmp_path / "stats.json").amax == stats.amax
    direct = fp8onnx.quantize(path, tmp_path / "a.onnx", data, provider="cpu")
    reused = fp8onnx.quantize(path, tmp_path / "b.onnx", stats=tmp_path / "stats.json", provider="cpu")
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert [t.scale for n in direct.quantized for t in n.tensors] == [
        t.scale for n in reused.quantized for t in n.tensors
    ]


def test_bad_stats_files(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    (tmp_path / "s.json").write_text("{")
    with pytest.raises(Fp8OnnxError, match="is not readable JSON"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", stats=tmp_path / "s.json")
    (tmp_path / "s.json").write_text(json.dumps({"fp8onnx_stats_version": 2, "amax": {"x": 1.0}}))
    with pytest.raises(Fp8OnnxError, match="have no entry for tensor 'r'"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", stats=tmp_path / "s.json")
