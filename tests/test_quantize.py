import json
import logging
import pathlib
import sys

import numpy as np
import onnx
import pytest

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.settings.config import QuantizeConfig

from helpers import SAMPLE, mlp_data, mlp_model, op_types, run_ort, run_reference, sqnr_db, sqnr_floor_db


@pytest.fixture
def mlp(tmp_path):
    return mlp_model(tmp_path / "m.onnx", opset=17), mlp_data(tmp_path / "d.npz")


@pytest.mark.parametrize("fmt", [f.value for f in Fp8Format if f.deployable and not f.integer])  # int8: test_int8
@pytest.mark.parametrize("scaling", ["amax", "pow2"])
def test_end_to_end_structure_and_sqnr(mlp, tmp_path, fmt, scaling):
    path, data = mlp
    floor_db = sqnr_floor_db(Fp8Format(fmt), quantized_tensors=4)
    before = path.read_bytes()
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, format=fmt, scaling=scaling, provider="cpu")
    assert path.read_bytes() == before  # the input is never modified
    assert (report.opset_from, report.opset_to) == (17, 21)
    assert [n.name for n in report.quantized] == ["fc1", "fc2"]
    assert [(n.name, n.reason) for n in report.skipped] == [
        ("gram", "both inputs are activations (e.g. attention scores); opt in with --activation-matmuls")
    ]
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    assert op_types(q).count("QuantizeLinear") == 2 and op_types(q).count("DequantizeLinear") == 4
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)
    ref = run_ort(onnx.load(path), {"x": x})[0]
    assert sqnr_db(ref, run_ort(q, {"x": x})[0]) > floor_db
    assert sqnr_db(ref, run_reference(q, {"x": x})[0]) > floor_db
    if scaling == "pow2":
        for node in report.quantized:
            for t in node.tensors:
                assert np.log2(t.scale) == int(np.log2(t.scale))


@pytest.mark.parametrize(
    "options",
    [
        {"scaling": "percentile"},
        {"scaling": "percentile", "percentile": 99.0},
        {"scaling": "mse"},
        {"per_channel": True},
        {"per_channel": True, "scaling": "pow2"},
        {"weight_format": "e4m3fn", "activation_format": "e5m2"},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_scaling_variants_structure_and_sqnr(mlp, tmp_path, options):
    path, data = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu", **options)
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    assert op_types(q).count("QuantizeLinear") == 2 and op_types(q).count("DequantizeLinear") == 4
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)
    ref = run_ort(onnx.load(path), {"x": x})[0]
    fmt = Fp8Format(options.get("activation_format", "e4m3fn"))
    for run in (run_ort, run_reference):
        # percentile 99 clips 1% of activations on purpose: allow 6 dB for that
        slack = 7.0 if options.get("percentile") == 99.0 else 1.0
        assert sqnr_db(ref, run(q, {"x": x})[0]) > sqnr_floor_db(fmt, quantized_tensors=4, slack_db=slack)
    weights = [t for n in report.quantized for t in n.tensors if t.kind == "weight"]
    if options.get("per_channel"):
        assert [t.axis for t in weights] == [1, 0]  # MatMul [K, N] -> N; Gemm transB [N, K] -> N
        assert [len(t.scale) for t in weights] == [32, 8]
    if options.get("scaling") in ("percentile", "mse"):
        acts = [t for n in report.quantized for t in n.tensors if t.kind == "activation"]
        assert all(t.scale <= t.amax / 448 * (1 + 1e-6) for t in acts)  # clipping never widens the range


def test_dynamic_activations_need_no_calibration(mlp, tmp_path):
    path, data = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", provider="cpu")
    assert report.calibration is None
    assert {t.scale for n in report.quantized for t in n.tensors if t.kind == "activation"} == {None}
    q = onnx.load(tmp_path / "q.onnx")
    assert op_types(q).count("ReduceMax") == 2
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32) * 1000  # far from any calibration
    assert sqnr_db(run_ort(onnx.load(path), {"x": x})[0], run_ort(q, {"x": x})[0]) > sqnr_floor_db(
        Fp8Format.E4M3FN, quantized_tensors=4
    )
    with pytest.raises(Fp8OnnxError, match="--activations dynamic needs no calibration"):
        fp8onnx.quantize(path, tmp_path / "q2.onnx", data, activations="dynamic")


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")
def test_e3m4_is_emulated_and_labelled(mlp, tmp_path):
    path, data = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, format="e3m4", provider="cpu")
    assert "SIMULATION" in report.summary() and "no runtime can deploy" in report.summary()
    q = onnx.load(tmp_path / "q.onnx")
    meta = {p.key: p.value for p in q.metadata_props}
    assert "not deployable" in meta["fp8onnx_emulated"] or "no runtime can deploy" in meta["fp8onnx_emulated"]
    assert "QuantizeLinear" not in op_types(q)
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)
    ref = run_ort(onnx.load(path), {"x": x})[0]
    for run in (run_ort, run_reference):
        assert sqnr_db(ref, run(q, {"x": x})[0]) > sqnr_floor_db(Fp8Format.E3M4, quantized_tensors=4)
    assert "SIMULATION" in __import__("fp8onnx.workflows.api", fromlist=["x"]).inspect_summary(
        fp8onnx.inspect(tmp_path / "q.onnx")
    )


def test_activation_matmuls_opt_in(mlp, tmp_path):
    path, data = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, activation_matmuls=True, provider="cpu")
    assert [n.name for n in report.quantized] == ["fc1", "fc2", "gram"]
    assert op_types(onnx.load(tmp_path / "q.onnx")).count("QuantizeLinear") == 4  # x, r, yt, y


def test_op_types_and_exclude(mlp, tmp_path):
    path, data = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, op_types=("MatMul",), exclude=("fc*",), provider="cpu")
    assert report.quantized == []
    reasons = {n.name: n.reason for n in report.skipped}
    assert reasons["fc2"] == "Gemm is not in --op-types"
    assert reasons["fc1"] == "excluded by --exclude 'fc*'"
    assert "nothing to quantize" in report.summary()


def test_constant_scaling_needs_no_calibration(mlp, tmp_path):
    path, _ = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", scaling="constant", scale=0.01, provider="cpu")
    assert {t.scale for n in report.quantized for t in n.tensors} == {0.01}
    assert report.calibration is None


def test_quantizing_the_output_again_changes_nothing(mlp, tmp_path):
    path, data = mlp
    fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")
    report = fp8onnx.quantize(tmp_path / "q.onnx", tmp_path / "q2.onnx", data, provider="cpu")
    assert not report.modified and not report.quantized
    assert {n.reason for n in report.skipped} >= {
        "already quantized: input 'fp8onnx/x/dequantized' comes from DequantizeLinear or fp8onnx"
    }


def test_report_json_and_metadata(mlp, tmp_path):
    path, data = mlp
    fp8onnx.quantize(path, tmp_path / "q.onnx", data, report=tmp_path / "r.json", provider="cpu")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["weight_format"] == doc["config"]["activation_format"] == "e4m3fn"
    fc1 = next(n for n in doc["nodes"] if n["name"] == "fc1")
    assert [t["kind"] for t in fc1["tensors"]] == ["activation", "weight"]
    meta = {p.key: p.value for p in onnx.load(tmp_path / "q.onnx").metadata_props}
    assert json.loads(meta["fp8onnx"])["scaling"] == "amax"
    info = fp8onnx.inspect(tmp_path / "q.onnx")
    assert info["quantized_nodes"] == 2 and len(info["float8_tensors"]) == 4


def test_deterministic_output(mlp, tmp_path):
    path, data = mlp
    fp8onnx.quantize(path, tmp_path / "a.onnx", data, provider="cpu")
    fp8onnx.quantize(path, tmp_path / "b.onnx", data, provider="cpu")
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format": "e3m5"}, "Unknown float8 format"),
        ({"scaling": "mean"}, "Unknown scaling method"),
        ({"scaling": "constant", "scale": float("inf")}, "Constant scaling needs a positive finite --scale"),
        ({"scale": 0.1}, "--scale only applies to --scaling constant"),
        ({"margin": 2}, "--margin only applies to --scaling pow2"),
        ({"op_types": ("LSTM",)}, "Unsupported op type 'LSTM'"),
        ({"percentile": 99.0}, "--percentile only applies to --scaling percentile"),
        ({"scaling": "percentile", "percentile": 0}, "--percentile must be in"),
        ({"activations": "sometimes"}, "Unknown --activations"),
        ({"activations": "dynamic", "scaling": "mse"}, "--scaling mse needs calibration"),
        ({"scaling": "constant", "scale": 1.0, "per_channel": True}, "contradicts --per-channel"),
        ({"scaling": "constant", "scale": 1.0, "activations": "dynamic"}, "contradicts --activations dynamic"),
        ({"provider": "rocm"}, "Unknown provider 'rocm'"),
    ],
)
def test_bad_options(mlp, tmp_path, kwargs, message):
    path, data = mlp
    with pytest.raises(Fp8OnnxError, match=message):
        fp8onnx.quantize(path, tmp_path / "q.onnx", data, **kwargs)
    assert not (tmp_path / "q.onnx").exists()


def test_bad_paths(mlp, tmp_path):
    path, data = mlp
    with pytest.raises(Fp8OnnxError, match="would overwrite the input model"):
        fp8onnx.quantize(path, path, data)
    with pytest.raises(Fp8OnnxError, match=r"Output folder .* does not exist"):
        fp8onnx.quantize(path, tmp_path / "nope" / "q.onnx", data)
    with pytest.raises(Fp8OnnxError, match="does not exist"):
        fp8onnx.quantize(tmp_path / "missing.onnx", tmp_path / "q.onnx", data)
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(Fp8OnnxError, match="is not a readable ONNX model"):
        fp8onnx.quantize(tmp_path / "junk.onnx", tmp_path / "q.onnx", data)
    with pytest.raises(Fp8OnnxError, match="need calibration"):
        fp8onnx.quantize(path, tmp_path / "q.onnx")


def test_sample_decoder_stays_within_995_of_fp16(tmp_path):
    """The README's promise: FP8 next-byte accuracy >= 99.5% of FP16 on held-out text."""
    report = fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "d.onnx", SAMPLE / "calib.npz", provider="cpu")
    assert len(report.quantized) == 29 and report.output_bytes < 0.4 * report.input_bytes
    result = fp8onnx.compare(SAMPLE / "decoder.onnx", [tmp_path / "d.onnx"], SAMPLE / "eval.npz", provider="cpu")
    fp32, _fp16, fp8 = result.rows
    assert fp32.accuracy > 0.55  # a trained model, not random weights
    assert fp8.passes_llm and fp8.passes_ptq, result.table()


def test_unnamed_nodes_are_named_and_each_quantized_once(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        "unnamed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    data = mlp_data(tmp_path / "d.npz")
    report = fp8onnx.quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", data, provider="cpu")
    names = [n.name for n in report.quantized]
    assert len(names) == 2 and len(set(names)) == 2 and all(names)
    q = onnx.load(tmp_path / "q.onnx")
    assert op_types(q).count("QuantizeLinear") == 2 and op_types(q).count("DequantizeLinear") == 4
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)
    assert sqnr_db(x @ w1 @ w2, run_ort(q, {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=4)


def test_precision_fp16_runs_the_rest_of_the_graph_in_float16(mlp, tmp_path):
    path, data = mlp
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, precision="fp16", provider="cpu")
    assert "converted the unquantized graph to float16 (inputs and outputs kept)" in report.prepared
    assert "FP16 graph" in report.summary()
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    assert q.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # a drop-in
    assert q.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    scales = [i for i in q.graph.initializer if i.name.endswith("/scale")]
    assert scales and {s.data_type for s in scales} == {onnx.TensorProto.FLOAT16}
    assert not [i.name for i in q.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)
    ref = run_ort(onnx.load(path), {"x": x})[0]
    assert sqnr_db(ref, run_ort(q, {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=4, slack_db=3)
    # statistics for an FP16 graph come from calibrating that graph
    fp8onnx.calibrate(path, data, tmp_path / "s16.json", precision="fp16", provider="cpu")
    again = fp8onnx.quantize(path, tmp_path / "q2.onnx", stats=tmp_path / "s16.json", precision="fp16", provider="cpu")
    assert len(again.quantized) == 2
    with pytest.raises(Fp8OnnxError, match="Unknown --precision 'fp8'"):
        fp8onnx.quantize(path, tmp_path / "q3.onnx", data, precision="fp8")


def test_deprecated_and_onnxruntime_ops_are_accepted(tmp_path):
    """onnx.checker refuses GroupNormalization at opset 18 (deprecated there) and does not know
    onnxruntime's SimplifiedLayerNormalization in the default domain; onnxruntime runs both."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("GroupNormalization", ["a", "s", "b"], ["g"], num_groups=2, name="gn"),
        helper.make_node("Reshape", ["g", "shape"], ["f"], name="flat"),
        helper.make_node("SimplifiedLayerNormalization", ["f", "gamma"], ["n"], name="rms", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 4, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [
            numpy_helper.from_array(np.ones(2, np.float32), "s"),
            numpy_helper.from_array(np.zeros(2, np.float32), "b"),
            numpy_helper.from_array(np.array([-1, 36], np.int64), "shape"),
            numpy_helper.from_array(np.ones(36, np.float32), "gamma"),
            numpy_helper.from_array(rng.standard_normal((36, 2)).astype(np.float32), "w"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    x = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    np.savez(tmp_path / "d.npz", a=x)
    report = fp8onnx.quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert [n.name for n in report.quantized] == ["mm"]
    q = onnx.load(tmp_path / "q.onnx")
    assert [n.op_type for n in q.graph.node if n.op_type in ("GroupNormalization", "SimplifiedLayerNormalization")] == [
        "GroupNormalization",
        "SimplifiedLayerNormalization",
    ]
    assert sqnr_db(run_ort(onnx.load(tmp_path / "m.onnx"), {"a": x})[0], run_ort(q, {"a": x})[0]) > 20


def test_calib_and_stats_contradict_in_the_library_too(mlp, tmp_path):
    path, data = mlp
    stats = fp8onnx.calibrate(path, data)
    with pytest.raises(Fp8OnnxError, match="either --calib or --stats, not both"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", data, stats=stats)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", stats=stats, provider="cpu")
    assert report.calibration["source"] == "statistics given in memory"  # not a 400-character repr


def test_first_line_of_an_exception_without_text():
    from fp8onnx.base.errors import first_line

    assert first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(ValueError("\n\n  real cause\nmore")) == "real cause"
    assert first_line(ValueError("bytes \x00\x1b here")) == "bytes \\x00\\x1b here"


def test_recipe_choices_are_enums_that_read_as_their_names():
    from fp8onnx.settings.choices import Activations, Precision

    cfg = QuantizeConfig(activations="dynamic", precision="fp16", target="onnxruntime")
    assert cfg.activations is Activations.DYNAMIC and cfg.activations == "dynamic"
    assert cfg.precision is Precision.FP16
    assert json.loads(json.dumps(cfg.to_json()))["activations"] == "dynamic"
    for field, bad, message in [
        (
            "activations",
            "sometimes",
            "Unknown --activations 'sometimes'; choose one of static, dynamic, dynamic-per-token, "
            "dynamic-per-group, none.",
        ),
        ("precision", "fp8", "Unknown --precision 'fp8'; choose one of model, fp16, bf16."),
        ("target", "coreml", "Unknown --target 'coreml'; choose one of onnxruntime, onnxruntime-cuda, tensorrt."),
    ]:
        with pytest.raises(Fp8OnnxError) as info:
            QuantizeConfig(**{field: bad})
        assert str(info.value) == message


def test_constant_scaling_alone_casts_with_scale_one(tmp_path):
    """--scaling constant without --scale is the constant-scale baseline at 1 (values cast as they are):
    it runs without calibration, and the report says the scale."""
    from helpers import mlp_model

    path = mlp_model(tmp_path / "m.onnx", opset=21)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", scaling="constant", preset="none", provider="cpu")
    assert report.config["scale"] == 1.0 and report.modified
    scales = [t.scale for n in report.quantized for t in n.tensors]
    assert scales and all(s == 1.0 for s in scales)  # exact: the constant is the scale itself


def test_a_runtime_that_refuses_float8_activation_qdq_is_named_at_quantize_time(mlp, tmp_path, caplog):
    """onnxruntime before 1.32 (onnxruntime-gpu's newest is 1.31.1) fuses some float8 activation Q/DQ into
    kernels without float8 types at its default level: quantize tries a plain session there and says so in
    one sentence, with the session option that loads it (CI runs this on 1.31.1 and on 1.32)."""
    import onnxruntime as ort

    path, _ = mlp
    old = tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 32)
    with caplog.at_level(logging.WARNING, logger="fp8onnx"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", provider="cpu")
    said = [r.getMessage() for r in caplog.records if "session.disable_quant_qdq=1" in r.getMessage()]
    assert len(said) == (1 if old else 0), said
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)
    if old:  # what the sentence says is what this runtime does, and its remedy works
        assert said[0].startswith(f"onnxruntime {ort.__version__} (installed) refuses") and "MatMulInteger" in said[0]
        with pytest.raises(Exception, match="float8"):
            run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})
    else:
        run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    ort.InferenceSession(str(tmp_path / "q.onnx"), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_a_relu_before_a_static_fp8_input_holds_at_every_optimisation_level(tmp_path, level):
    """MatMul -> Relu -> MatMul with static FP8 on the second MatMul's input. onnxruntime 1.32's own FP8
    quantizer writes DQ -> Relu -> Q there, whose Relu its EXTENDED optimiser removes (negative values pass:
    relative error above 1; tests/bench/peer_fp8_relu.py, docs/peers.md); fp8onnx's Q reads the Relu's float
    output, which every level keeps.

    requires: a graph whose Relu output is quantized. ensures: SQNR against FP32 above 20 dB at each level."""
    import onnxruntime as ort

    sys.path.insert(0, str(pathlib.Path(__file__).parent / "bench"))
    from peer_fp8_relu import relu_model

    rng = np.random.default_rng(0)
    w1, w2 = relu_model(tmp_path / "m.onnx", rng)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((32, 64)).astype(np.float32))
    fp8onnx.quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "calib.npz", provider="cpu", preset="none")
    x = rng.standard_normal((8, 64)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 32):
        # onnxruntime 1.31 fuses float8 DQ -> MatMul into kernels it lacks (conftest's _FUSES_FLOAT8); fp8onnx's
        # warning tells its users this option, which fp8onnx's own sessions set.
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    y = ort.InferenceSession(tmp_path / "q.onnx", so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert "Relu" in op_types(onnx.load(tmp_path / "q.onnx"))
    assert sqnr_db(np.maximum(x @ w1, 0) @ w2, y) > 20  # without the Relu: about -2 dB
