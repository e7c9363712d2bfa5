"""Sessions: provider choice, the option that avoids onnxruntime issue 22269, failures as one
sentence, and large in-memory models handed over through a temporary file."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.graph import providers, run_settings, runtime

from helpers import mlp_model


def test_auto_is_cuda_only_where_onnxruntime_has_it():
    expected = "cuda" if providers.cuda_unavailable() is None else "cpu"  # a session's own providers
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


@pytest.mark.parametrize("external", [False, True])
def test_weights_are_handed_over_in_place_and_the_model_is_left_as_it_was(tmp_path, external):
    path = mlp_model(tmp_path / "m.onnx")
    if external:  # memory-mapped weights: handed over as views of the mapping
        onnx.save(onnx.load(path), tmp_path / "e.onnx", save_as_external_data=True, location="e.data", size_threshold=0)
        path = tmp_path / "e.onnx"
    model = ir.load(path)
    before = {name: v.const_value for name, v in model.graph.initializers.items()}
    session = runtime.session_for_model(model, "cpu")
    assert {name: v.const_value for name, v in model.graph.initializers.items()} == before  # same objects
    handed, _ = session._fp8onnx_weights
    assert sorted(handed) == sorted(n for n, t in before.items() if t.nbytes >= runtime.HANDOVER_BYTES)
    x = np.linspace(-2, 2, 32, dtype=np.float32).reshape(2, 16)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for got, want in zip(session.run(None, {"x": x}), expected):
        np.testing.assert_array_equal(got, want)  # exact: one graph, one feed, the same weight bytes
    assert [p.name for p in tmp_path.iterdir() if p.suffix not in (".onnx", ".data")] == []  # no temporary file


def test_weights_numpy_cannot_hold_are_serialized(tmp_path):
    import ml_dtypes

    w = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
    model = ir.load(mlp_model(tmp_path / "m.onnx"))
    value = next(v for v in model.graph.initializers.values() if v.const_value.nbytes == w.nbytes)
    value.const_value = ir.Tensor(w.astype(ml_dtypes.bfloat16), dtype=ir.DataType.BFLOAT16, name=value.name)
    node = value.uses()[0].node
    cast = ir.node("Cast", [value], {"to": ir.DataType.FLOAT})
    node.graph.insert_before(node, cast)
    node.replace_input_with(1, cast.outputs[0])
    session = runtime.session_for_model(model, "cpu")
    assert value.name not in session._fp8onnx_weights[0]
    assert session.run(None, {"x": np.ones((1, 16), np.float32)})[0].shape == (1, 8)


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
    from fp8onnx.graph.run_settings import RunOptions

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


def test_entry_settings_build_both_objects_once_and_drop_nothing():
    """Every API entry point's keyword options become (QuantizeConfig, RunOptions) here: a preset is applied
    (QuantizeConfig(preset="llm") alone only records the name), recipe fields beside a config are refused."""
    from fp8onnx.graph.run_settings import RunOptions, entry_settings
    from fp8onnx.settings.config import QuantizeConfig

    config, run = entry_settings(None, RunOptions(batch_size=2), {"provider": "cpu", "format": "e5m2"})
    assert run == RunOptions(2, "cpu") and config.format.value == "e5m2" and config.preset == "auto"
    llm, _ = entry_settings(None, None, {"provider": "cpu", "preset": "llm"})
    assert llm == QuantizeConfig.for_preset("llm") and llm.activations.value != QuantizeConfig().activations.value
    plain, _ = entry_settings(None, None, {"provider": "cpu"}, preset=None)
    assert plain == QuantizeConfig()
    given = QuantizeConfig(per_channel=True)
    assert entry_settings(given, None, {"provider": "cpu"})[0] is given
    with pytest.raises(Fp8OnnxError, match="format given beside config="):
        entry_settings(given, None, {"provider": "cpu", "format": "e5m2"})


def test_instrumented_sessions_run_each_statistic_right_after_its_tensor():
    so = runtime._options("cpu", instrumented=True)
    assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert not so.enable_mem_pattern
    assert runtime._options("cpu").execution_order == ort.ExecutionOrder.DEFAULT  # what users run keeps ORT's


@pytest.mark.parametrize("weight_memory", [1 << 30, 64])  # one session, and layer by layer
def test_every_statistics_session_is_instrumented(tmp_path, monkeypatch, weight_memory):
    from fp8onnx.pipeline import calibration, segments, statistics

    seen = []
    real = runtime.make_session

    def spy(*args, **kwargs):
        seen.append(kwargs.get("instrumented", False))
        return real(*args, **kwargs)

    for module in (runtime, segments):
        monkeypatch.setattr(module, "make_session", spy)
    model = ir.load(mlp_model(tmp_path / "m.onnx"))
    feeds = [{"x": np.ones((2, 16), np.float32)}]
    run = run_settings.RunOptions(weight_memory=weight_memory)
    calibration.collect_amax(model, ["x"], feeds, run=run)
    maxed = statistics.Sums({"x": lambda x, add: [add("ReduceMax", [x], "max", keepdims=0)]}, "max", np.maximum)
    statistics.measure(model, [maxed], as_data(feeds, input_specs(model)), run, "max")
    assert len(seen) >= 2 and all(seen)
