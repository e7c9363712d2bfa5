import json

import numpy as np
import onnx_ir as ir
import pytest

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.pipeline.calibration import Stats, collect_amax

from helpers import assert_same_histogram, mlp_data, mlp_model


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
    assert [n["tensors"] for n in direct.to_json()["nodes"]] == [n["tensors"] for n in reused.to_json()["nodes"]]


def test_bad_stats_files(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    (tmp_path / "s.json").write_text("{")
    with pytest.raises(Fp8OnnxError, match="is not readable JSON"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", stats=tmp_path / "s.json")
    (tmp_path / "s.json").write_text(json.dumps({"fp8onnx_stats_version": 2, "amax": {"x": 1.0}}))
    with pytest.raises(Fp8OnnxError, match="have no entry for tensor 'r'"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", stats=tmp_path / "s.json")


def test_batches_are_sized_to_the_memory_budget_with_the_same_statistics(tmp_path):
    """Without --batch-size, one sample's run is measured first and the batches shrink to fit
    --batch-memory; amax and histograms do not depend on the batching. (onnxruntime may multiply one
    row and sixteen with other kernels: the last bits of an amax may differ on some CPUs, and a value
    on a histogram bin's edge move to the next bin; SPEC §11.)"""
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    fixed = fp8onnx.calibrate(path, data, batch_size=16, provider="cpu")
    small = fp8onnx.calibrate(path, data, provider="cpu", batch_memory=1)  # 1 byte: one sample per run
    default = fp8onnx.calibrate(path, data, provider="cpu")
    assert small.num_batches == small.num_samples and default.num_batches == fixed.num_batches
    assert "sized to --batch-memory 0 MiB" in small.batching and default.batching == "16 samples"
    assert small.amax == pytest.approx(fixed.amax, rel=1e-6) and small.hist.keys() == fixed.hist.keys()
    for name, hist in fixed.hist.items():
        assert_same_histogram(hist.counts, small.hist[name].counts)
    # layer by layer (weights over the segment budget): the probe runs through the segments too
    seg = fp8onnx.calibrate(path, data, provider="cpu", batch_memory=1, weight_memory=1)
    assert seg.num_batches == seg.num_samples and seg.amax == pytest.approx(fixed.amax, rel=1e-6)


def test_auto_batch_size_takes_the_larger_of_fetched_and_resident_memory():
    from fp8onnx.data.feeds import Batch
    from fp8onnx.pipeline.batching import auto_batch_size

    class Source:
        def batches(self, n):
            yield Batch({"x": np.zeros((2, 3), np.float32)})  # a 2-sample feed (fixed batch axis)

    mib = 1 << 20
    assert auto_batch_size(lambda feed: (200 * mib, 0), Source(), 1024 * mib)[0] == 10  # 100 MiB a sample
    assert auto_batch_size(lambda feed: (0, 600 * mib), Source(), 1024 * mib)[0] == 3
    assert auto_batch_size(lambda feed: (mib, mib), Source(), 1024 * mib) == (16, "16 samples")
    assert auto_batch_size(lambda feed: (4096 * mib, 0), Source(), 1024 * mib)[0] == 1
