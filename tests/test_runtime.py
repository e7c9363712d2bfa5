"""Sessions: provider choice, the option that avoids onnxruntime issue 22269, failures as one
sentence, and large in-memory models handed over through a temporary file."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from fp8onnx import runtime
from fp8onnx.errors import Fp8OnnxError

from helpers import mlp_model


def test_auto_is_cuda_only_where_onnxruntime_has_it():
    expected = "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    assert runtime.resolve_provider("auto") == expected
    assert runtime.resolve_provider("CPU") == "cpu"
    with pytest.raises(Fp8OnnxError, match="Unknown provider 'rocm'"):
        runtime.resolve_provider("rocm")


def test_cpu_sessions_disable_the_qdq_fusion_and_checks_can_skip_optimizations():
    so = runtime._options("cpu", optimize=False)
    assert so.get_session_config_entry("session.disable_quant_qdq") == "1"
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert runtime._options("cpu").graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_a_model_that_does_not_load_is_one_sentence(tmp_path):
    broken = onnx.load(mlp_model(tmp_path / "m.onnx"))
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(Fp8OnnxError, match=r"^The thing does not load in onnxruntime \(cpu\): ") as info:
        runtime.make_session(broken.SerializeToString(), "cpu", "The thing")
    assert "\n" not in str(info.value)


def test_large_models_go_through_a_temporary_file(tmp_path, monkeypatch):
    path = mlp_model(tmp_path / "m.onnx")
    model = ir.load(path)
    assert runtime.weight_bytes(model) == (16 * 32 + 8 * 32 + 8) * 4
    monkeypatch.setattr(runtime, "_INLINE_LIMIT", 1)  # every model counts as large
    spill = tmp_path / "tmp"
    spill.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(spill))
    session = runtime.session_for_model(model, "cpu")
    x = np.ones((2, 16), np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for got, want in zip(session.run(None, {"x": x}), expected):
        np.testing.assert_array_equal(got, want)
    assert list(spill.iterdir()) == []  # the temporary copy is gone once the session holds the model


def test_inline_proto_reads_external_weights_without_touching_the_model(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    onnx.save(onnx.load(path), tmp_path / "e.onnx", save_as_external_data=True, location="e.data", size_threshold=0)
    model = ir.load(tmp_path / "e.onnx")
    proto = runtime.inline_proto(model)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    assert isinstance(model.graph.initializers["w1"].const_value, ir.ExternalTensor)  # still memory-mapped


def test_median_latency_is_positive_and_runs_warmup_plus_runs():
    calls = []

    class Fake:
        def run(self, outputs, feed):
            calls.append(1)

    assert runtime.median_latency_ms(Fake(), {}, warmup=2, runs=5) >= 0
    assert len(calls) == 7


def test_run_options_validate_and_merge():
    from fp8onnx.runtime import RunOptions

    run = RunOptions.of(None, batch_size=4, provider="cpu")
    assert run == RunOptions(4, "cpu") and RunOptions.of(run, progress=True).batch_size == 4
    for bad, message in [
        ({"batch_size": 0}, "--batch-size must be a positive integer"),
        ({"provider": "rocm"}, "Unknown provider 'rocm'"),
        ({"weight_memory": 0}, "--weight-memory must be a positive number of bytes"),
    ]:
        with pytest.raises(Fp8OnnxError, match=message):
            RunOptions(**bad)
    with pytest.raises(TypeError, match="unknown run option 'batchsize'"):
        RunOptions.of(None, batchsize=3)
    assert RunOptions.split({"provider": "cpu", "format": "e5m2"}) == ({"provider": "cpu"}, {"format": "e5m2"})


def test_instrumented_sessions_run_each_statistic_right_after_its_tensor():
    so = runtime._options("cpu", instrumented=True)
    assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert not so.enable_mem_pattern
    assert runtime._options("cpu").execution_order == ort.ExecutionOrder.DEFAULT  # what users run keeps ORT's


@pytest.mark.parametrize("weight_memory", [1 << 30, 64])  # one session, and layer by layer
def test_every_statistics_session_is_instrumented(tmp_path, monkeypatch, weight_memory):
    from fp8onnx import calibration, graph_stats, segments

    seen = []
    real = runtime.make_session

    def spy(*args, **kwargs):
        seen.append(kwargs.get("instrumented", False))
        return real(*args, **kwargs)

    for module in (runtime, segments):
        monkeypatch.setattr(module, "make_session", spy)
    model = ir.load(mlp_model(tmp_path / "m.onnx"))
    feeds = [{"x": np.ones((2, 16), np.float32)}]
    run = runtime.RunOptions(weight_memory=weight_memory)
    calibration.collect_amax(model, ["x"], feeds, run=run)
    graph_stats.sum_in_graph(model, {"x": lambda x, add: [add("ReduceMax", [x], "max", keepdims=0)]}, feeds, run, "max")
    assert len(seen) >= 2 and all(seen)
