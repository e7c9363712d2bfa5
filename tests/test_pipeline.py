"""The calibration pipeline: techniques declare statistics, the recipe measures them in the fewest
passes, and the executor comes from RunOptions, never from the technique."""

import numpy as np
import onnx_ir as ir
import pytest

import fp8onnx
from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.pipeline import executors, statistics
from fp8onnx.techniques import recipe

from helpers import assert_same_histogram, mlp_data, mlp_model


@pytest.fixture
def counted_passes(monkeypatch):
    """Every pass over the calibration data the recipe makes: the kinds of statistics it measured."""
    passes = []
    real = recipe.measure

    def spy(model, stats, *args):
        passes.append(sorted(type(s).__name__ for s in stats))
        return real(model, stats, *args)

    monkeypatch.setattr(recipe, "measure", spy)
    return passes


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, [["Ranges"]]),
        ({"weight_rounding": "gptq"}, [["Ranges", "Sums"]]),
        ({"weight_rounding": "gptq", "bias_correction": True}, [["Ranges", "Sums", "Sums"]]),
        ({"activations": "none", "weight_rounding": "gptq"}, [["Sums"]]),
        ({"smooth": 0.5, "weight_rounding": "gptq", "bias_correction": True}, [["Sums"], ["Ranges", "Sums", "Sums"]]),
        ({"activations": "dynamic-per-token"}, []),
    ],
)
def test_the_recipe_reads_the_data_the_fewest_times_its_order_allows(tmp_path, counted_passes, options, expected):
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "c.npz")
    fp8onnx.quantize(
        model,
        tmp_path / "q.onnx",
        None if options.get("activations") == "dynamic-per-token" else data,
        preset="none",
        **options,
    )
    assert counted_passes == expected


def test_the_executor_comes_from_the_run_options(tmp_path):
    model = ir.load(mlp_model(tmp_path / "m.onnx"))
    assert executors.executor_for(model, RunOptions()) is executors.InProcess
    assert executors.executor_for(model, RunOptions(weight_memory=64)) is executors.LayerByLayer
    assert executors.executor_for(model, RunOptions(workers=2)) is executors.RayWorkers


def test_one_pass_gives_what_separate_passes_give(tmp_path):
    """Statistics measured together equal the same statistics measured alone, in one process and
    layer by layer."""
    model = ir.load(mlp_model(tmp_path / "m.onnx"))
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 16)).astype(np.float32)} for i in range(3)]

    def square_sum(x, add):
        return [add("ReduceSum", [add("Mul", [x, x], "sq"), np.array([0], np.int64)], "sum", keepdims=0)]

    for weight_memory in (1 << 30, 64):
        run = RunOptions(weight_memory=weight_memory, batch_size=2)
        alone_ranges, alone_sums = (
            statistics.Ranges(["h", "r"], histograms=True),
            statistics.Sums({"r": square_sum}, "sq"),
        )
        statistics.measure(model, [alone_ranges], as_data(feeds, input_specs(model)), run, "ranges")
        statistics.measure(model, [alone_sums], as_data(feeds, input_specs(model)), run, "sums")
        ranges, sums = statistics.Ranges(["h", "r"], histograms=True), statistics.Sums({"r": square_sum}, "sq")
        done = statistics.measure(model, [ranges, sums], as_data(feeds, input_specs(model)), run, "both")
        assert done.num_batches == 3 and done.num_samples == 12
        assert done.executor == ("in process" if weight_memory > 64 else "layer by layer")
        # the same nodes in two instrumented graphs: onnxruntime may plan them differently (SPEC §11)
        assert ranges.amax == pytest.approx(alone_ranges.amax, rel=1e-6)
        assert ranges.hist.keys() == alone_ranges.hist.keys()
        for name, hist in ranges.hist.items():
            assert_same_histogram(hist.counts, alone_ranges.hist[name].counts)
        np.testing.assert_allclose(sums.result["r"][0], alone_sums.result["r"][0], rtol=1e-6)
        r = np.maximum(
            np.concatenate([f["x"] for f in feeds])
            @ ir.load(tmp_path / "m.onnx").graph.initializers["w1"].const_value.numpy(),
            0,
        )
        np.testing.assert_allclose(sums.result["r"][0], (r * r).sum(axis=0), rtol=1e-5)


@pytest.mark.parametrize("sequential", [False, True])
def test_sequential_calibration_measures_each_layer_on_the_quantized_layers_before_it(
    tmp_path, monkeypatch, sequential
):
    """GPTQ's X^T X of the second layer: from the first layer's float weights, or (sequential) from
    its weights as stored, GPTQ-rounded before the second layer is measured."""
    from fp8onnx.techniques import gptq

    rounded, hessians = {}, []
    real, real_factor = gptq.GPTQ._round_stack, gptq.gptq_factor

    def spy(self, *args):
        out = real(self, *args)
        rounded.update(out)
        return out

    def spy_factor(h, *args, **kwargs):
        hessians.append(np.array(h))
        return real_factor(h, *args, **kwargs)

    monkeypatch.setattr(gptq.GPTQ, "_round_stack", spy)
    monkeypatch.setattr(gptq, "gptq_factor", spy_factor)
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "c.npz")
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(model, out, data, preset="none", activations="none", weight_rounding="gptq", sequential=sequential)
    first = rounded["w1"]
    (hessian,) = [h for h in hessians if h.shape == (32, 32)]
    x = np.load(data)["x"]
    w1 = ir.load(model).graph.initializers["w1"].const_value.numpy()
    for weights, expected_match in ((first, sequential), (w1, not sequential)):
        r = np.maximum(x @ weights, 0)
        assert np.allclose(hessian, r.T @ r, rtol=1e-4, atol=1e-3) == expected_match
    assert (ir.load(out).metadata_props.get("fp8onnx", "").find('"sequential": true') >= 0) == sequential
    # the stored weight's scales are those of the float weight (not recomputed from GPTQ's rounding)
    quantized = ir.load(out)
    scale = next(v for name, v in quantized.graph.initializers.items() if name.endswith("w1/scale"))
    np.testing.assert_array_equal(
        scale.const_value.numpy(), (np.abs(w1).max(axis=0) / np.float32(448)).astype(np.float32)
    )


def test_layer_by_layer_gptq_rounds_each_segment_as_it_ends(tmp_path, monkeypatch):
    """Over the weight budget, GPTQ rounds a layer as soon as the segment computing its X^T X has run
    (written to a scratch folder, its sums dropped), but for the last segment's, rounded when the
    model is written: the same bytes as rounding them all at the end, and no temporary file left."""
    import sys

    from fp8onnx.models.build_llama import build, write_data
    from fp8onnx.techniques import gptq

    path = build(tmp_path / "tiny", layers=2, dim=64, heads=4, ffn=160, vocab=300)
    write_data(tmp_path / "tiny", vocab=300, seq=16, calib=8, evals=4)
    calib = tmp_path / "tiny" / "calib.npz"
    options = {"preset": "none", "activations": "none", "weight_rounding": "gptq", "weight_memory": 60_000}
    early = []
    real = gptq.GPTQ.round_ready

    def spy(self, quant, measured, **kwargs):
        before = set(self.originals)
        real(self, quant, measured, **kwargs)
        early.extend((name, len(self.hessians.dropped)) for name in sorted(set(self.originals) - before))

    monkeypatch.setattr(gptq.GPTQ, "round_ready", spy)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)
    (tmp_path / "streamed").mkdir()
    fp8onnx.quantize(path, tmp_path / "streamed" / "q.onnx", calib, **options)
    assert 0 < len({name for name, _ in early}) < 2 * 7 + 1 and early[-1][1] > 0  # sums dropped
    assert list(scratch.iterdir()) == []
    monkeypatch.setattr(sys.modules["fp8onnx.workflows.quantizer"], "_settling", lambda *args: ({}, None))
    (tmp_path / "at_the_end").mkdir()
    fp8onnx.quantize(path, tmp_path / "at_the_end" / "q.onnx", calib, **options)
    for suffix in ("", ".data"):
        a, b = (tmp_path / n / f"q.onnx{suffix}" for n in ("streamed", "at_the_end"))
        assert a.exists() == b.exists() and (not a.exists() or a.read_bytes() == b.read_bytes())


def test_layer_by_layer_gptq_with_the_last_segment_rounded_when_written(tmp_path, monkeypatch):
    """The default recipe for a decoder (GPTQ, lm_head in float) over the weight budget: the last
    segment's weights are rounded when the model is written, in stacks with weights of the same shape
    that earlier segments rounded already (their X^T X dropped); the same bytes as rounding them all
    at the end (a regression: the stack once reached for the dropped sums)."""
    import sys

    from fp8onnx.models.build_llama import build, write_data

    path = build(tmp_path / "tiny", layers=3, dim=64, heads=4, ffn=160, vocab=3000)
    write_data(tmp_path / "tiny", vocab=3000, seq=16, calib=8, evals=4)
    calib = tmp_path / "tiny" / "calib.npz"
    (tmp_path / "streamed").mkdir()
    report = fp8onnx.quantize(path, tmp_path / "streamed" / "q.onnx", calib, weight_memory=100_000)
    assert report.config["preset"] == "llm-weight-only" and report.config["weight_rounding"] == "gptq"
    monkeypatch.setattr(sys.modules["fp8onnx.workflows.quantizer"], "_settling", lambda *args: ({}, None))
    (tmp_path / "at_the_end").mkdir()
    fp8onnx.quantize(path, tmp_path / "at_the_end" / "q.onnx", calib, weight_memory=100_000)
    for suffix in ("", ".data"):
        a, b = (tmp_path / n / f"q.onnx{suffix}" for n in ("streamed", "at_the_end"))
        assert a.exists() == b.exists() and (not a.exists() or a.read_bytes() == b.read_bytes())


def test_gptq_after_smoothing_measures_the_smoothed_inputs(tmp_path, monkeypatch):
    """Smoothing inserts a Mul where it cannot fold 1/s (a graph input, a Relu): GPTQ's X^T X is of
    what the layers read after it (``<x>/smoothed``), not of the input before smoothing."""
    measured = []
    real = recipe.measure

    def spy(model, stats, *args):
        measured.extend(name for s in stats if getattr(s, "desc", "") == "hessians" for name in s.builders)
        return real(model, stats, *args)

    monkeypatch.setattr(recipe, "measure", spy)
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "c.npz")
    report = fp8onnx.quantize(model, tmp_path / "q.onnx", data, preset="none", smooth=0.5, weight_rounding="gptq")
    assert any("smoothed 2 activations" in line for line in report.prepared)
    assert sorted(measured) == ["r/smoothed", "x/smoothed"]
