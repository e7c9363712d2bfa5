"""--activations dynamic-per-token (one in-graph scale per row) and none (weight-only FP8)."""

import re

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format

from helpers import run_ort, run_reference, sqnr_db, sqnr_floor_db

FMAX = np.float32(448.0)


def matmul(path, w, shape=("b", "s", 16)):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*shape[:-1], w.shape[1]])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def tokens(rng, magnitudes=(1.0, 100.0, 0.01, 0.0, 5.0, 3e4)):
    """[2, 6, 16] rows whose magnitudes differ by up to 1e6, and an all-zero row."""
    return (rng.standard_normal((2, len(magnitudes), 16)) * np.array(magnitudes)[None, :, None]).astype(np.float32)


def per_token_reference(x: np.ndarray) -> np.ndarray:
    """NumPy: scale = max(amax_row * (1/448), tiny) in float32; x/scale cast to E4M3 (saturating), times scale."""
    scale = np.abs(x).max(-1, keepdims=True) * np.float32(1 / FMAX)
    scale = np.clip(scale, np.finfo(np.float32).tiny, None).astype(np.float32)
    return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale


def test_per_token_activations_match_numpy_bit_for_bit(tmp_path):
    """With an identity weight (exact in E4M3 per channel), the output is the quantized activation itself."""
    rng = np.random.default_rng(0)
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic-per-token", provider="cpu")
    assert "dynamic per-token activations, per-channel weights" in report.summary()
    x = tokens(rng)
    want = per_token_reference(x)
    for run in (run_ort, run_reference):
        got = run(tmp_path / "q.onnx", {"x": x})[0]
        assert np.array_equal(got, want), np.abs(got - want).max()
    ops = [n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node]
    assert "QuantizeLinear" not in ops and ops.count("Cast") == 2 and "ReduceMax" in ops


def test_per_token_beats_per_tensor_on_rows_of_different_magnitude(tmp_path):
    rng = np.random.default_rng(1)
    path = matmul(tmp_path / "m.onnx", rng.standard_normal((16, 8)).astype(np.float32))
    x = tokens(rng)
    ref = run_ort(path, {"x": x})[0]
    got = {}
    for mode in ("dynamic", "dynamic-per-token"):
        fp8onnx.quantize(path, tmp_path / f"{mode}.onnx", activations=mode, provider="cpu")
        got[mode] = run_ort(tmp_path / f"{mode}.onnx", {"x": x})[0]
    small = slice(0, 3)  # the rows of magnitude 1, 100 and 0.01: per tensor, 0.01 is flushed by the 3e4 row
    row_small = [sqnr_db(ref[:, 2], got[m][:, 2]) for m in ("dynamic", "dynamic-per-token")]
    assert row_small[1] > sqnr_floor_db(Fp8Format.E4M3FN, 2) and row_small[1] > row_small[0] + 10
    assert sqnr_db(ref[:, small], got["dynamic-per-token"][:, small]) > sqnr_floor_db(Fp8Format.E4M3FN, 2)


def test_per_token_only_where_the_rows_are_the_reduction_rows(tmp_path):
    """Gemm with transA reduces over axis 0: that input gets one dynamic scale per tensor instead."""
    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], name="gemm", transA=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    report = fp8onnx.quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", activations="dynamic-per-token")
    x_report = next(t for n in report.quantized for t in n.tensors if t.name == "x")
    assert x_report.axis is None
    assert "QuantizeLinear" in [n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node]
    x = rng.standard_normal((16, 5)).astype(np.float32)
    ref = run_ort(tmp_path / "m.onnx", {"x": x})[0]
    assert sqnr_db(ref, run_ort(tmp_path / "q.onnx", {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, 2)


def test_weight_only_has_no_activation_qdq(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    path = matmul(tmp_path / "m.onnx", w)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", activations="none", provider="cpu")
    assert "weight-only" in report.summary() and report.calibration is None
    assert [(t.kind, t.axis) for n in report.quantized for t in n.tensors] == [("weight", 1)]  # per channel
    q = onnx.load(tmp_path / "q.onnx")
    assert [n.op_type for n in q.graph.node] == ["DequantizeLinear", "MatMul"]
    x = tokens(rng)
    ref = run_ort(path, {"x": x})[0]
    for run in (run_ort, run_reference):
        got = run(q, {"x": x})[0]
        assert sqnr_db(ref, got) > sqnr_floor_db(Fp8Format.E4M3FN, 1)
        scale = np.abs(w).max(0) / FMAX
        wq = (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
        assert np.allclose(got, x @ wq, rtol=1e-5, atol=1e-3)


def test_weight_only_leaves_activation_matmuls_alone(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="attn")],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    report = fp8onnx.quantize(
        tmp_path / "m.onnx", tmp_path / "q.onnx", activations="none", activation_matmuls=True, provider="cpu"
    )
    assert not report.quantized and "weights only" in {n.name: n.reason for n in report.skipped}["attn"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"activations": "none", "calib": "d.npz"}, "--activations none needs no calibration"),
        ({"activations": "dynamic-per-token", "calib": "d.npz"}, "--activations dynamic-per-token needs no"),
        ({"activations": "dynamic-per-token", "scaling": "percentile"}, "needs calibration (use --scaling amax"),
        ({"activations": "dynamic-per-token", "target": "tensorrt"}, "drop --activations dynamic-per-token"),
    ],
)
def test_what_the_modes_refuse(tmp_path, options, message):
    path = matmul(tmp_path / "m.onnx", np.ones((16, 8), np.float32))
    np.savez(tmp_path / "d.npz", x=np.ones((2, 3, 16), np.float32))
    calib = tmp_path / options.pop("calib") if "calib" in options else None
    with pytest.raises(Fp8OnnxError, match=re.escape(message)):
        fp8onnx.quantize(path, tmp_path / "q.onnx", calib, provider="cpu", **options)


def test_a_preset_sets_its_options_and_explicit_options_win(tmp_path):
    from click.testing import CliRunner

    from fp8onnx.cli import main
    from fp8onnx.settings.config import PRESETS, QuantizeConfig

    llm = QuantizeConfig.for_preset("llm")
    assert llm.activations == "dynamic-per-token" and llm.float_vocab and llm.embeddings == "fp8"
    assert (
        llm.to_json()["preset"] == "llm" and QuantizeConfig.for_preset("llm", embeddings="float").embeddings == "float"
    )
    assert set(PRESETS) == {"llm", "llm-weight-only", "llm-w8a8", "encoder", "cnn"}
    assert all(p["why"] for p in PRESETS.values())
    w8a8 = QuantizeConfig.for_preset("llm-w8a8", target="onnxruntime-cuda")
    # per-channel weights (blocks of 32 cost LAMBADA +10% target perplexity): the fast form's b_scale [N, 1]
    assert (w8a8.activations, w8a8.per_channel, w8a8.weight_block_size) == ("static", True, 0)
    assert w8a8.gemm_op == "block-fp8"
    assert w8a8.w8a8_share == 0.67 and w8a8.float_activations == () and w8a8.float_last_layers == 0  # by loss
    assert w8a8.float_vocab and w8a8.weight_rounding == "gptq" and w8a8.fallback == "activations"
    assert QuantizeConfig.for_preset("llm-w8a8", activations="dynamic").w8a8_share is None  # yields to it
    # its per-channel weights yield to a granularity the user chose and to one constant scale (never "drop
    # --per-channel", a flag the user did not give)
    for given in ({"target": "tensorrt"}, {"native_gemm": True}):  # both take one scale per channel
        assert QuantizeConfig.for_preset("llm-w8a8", **given).per_channel is True, given
    assert QuantizeConfig.for_preset("llm-w8a8", per_channel=False).per_channel is False
    assert QuantizeConfig.for_preset("llm-w8a8", scaling="constant", activations="static").per_channel is False
    blocks = QuantizeConfig.for_preset("llm-w8a8", weight_block_size=64)  # blocks asked for: its channels yield
    assert (blocks.weight_block_size, blocks.per_channel) == (64, None)
    with pytest.raises(Fp8OnnxError, match="--w8a8-share chooses which static activations"):
        QuantizeConfig(activations="dynamic", w8a8_share=0.5)
    # a preset's part that contradicts an explicit option yields to it
    assert QuantizeConfig.for_preset("cnn", activations="dynamic").scaling.value == "amax"
    constant = QuantizeConfig.for_preset("llm-weight-only", scaling="constant", scale=0.5)
    assert constant.weight_rounding == "nearest" and constant.float_vocab
    with pytest.raises(Fp8OnnxError, match="Unknown --preset 'gan'"):
        QuantizeConfig.for_preset("gan")
    path = matmul(tmp_path / "m.onnx", np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32))
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(5).standard_normal((4, 3, 16)).astype(np.float32))
    args = ["quantize", str(path), "--preset", "llm"]
    r = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "q.onnx")])
    assert r.exit_code == 2 and "needs --calib DATA" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "q.onnx")])
    assert r.exit_code == 0 and "dynamic per-token activations" in r.output and "(preset llm)" in r.output, r.output
    assert "GPTQ weight rounding" in r.output
    r = CliRunner().invoke(
        main, [*args, "--weight-rounding", "nearest", "--smooth", "off", "-o", str(tmp_path / "w.onnx")]
    )
    assert r.exit_code == 0 and "GPTQ" not in r.output and "(preset llm)" in r.output, r.output


def per_group_reference(x: np.ndarray, group: int) -> np.ndarray:
    """NumPy: each row's channels in groups of ``group``, each group quantized like a per-token row."""
    rows = x.reshape(-1, group)
    return per_token_reference(rows).reshape(x.shape)


@pytest.mark.parametrize("group", [4, 8, 16])
def test_per_group_activations_match_numpy_bit_for_bit(tmp_path, group):
    rng = np.random.default_rng(3)
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    report = fp8onnx.quantize(
        path, tmp_path / "q.onnx", activations="dynamic-per-group", group_size=group, provider="cpu"
    )
    assert f"dynamic per-group activations ({group} channels a scale), per-channel weights" in report.summary()
    x = tokens(rng) * np.logspace(-6, 0, 16, dtype=np.float32)  # channels spanning more than E4M3's range too
    want = per_group_reference(x, group)
    for run in (run_ort, run_reference):
        got = run(tmp_path / "q.onnx", {"x": x})[0]
        assert np.array_equal(got, want), np.abs(got - want).max()
    if group < 16:  # the smallest channels: flushed by their row's one scale, kept by their group's
        small, per_token = slice(0, group), per_token_reference(x)
        assert sqnr_db(x[..., small], want[..., small]) > sqnr_db(x[..., small], per_token[..., small]) + 10


def test_per_group_sees_the_channels_through_a_reshape_to_a_computed_shape(tmp_path):
    """An attention output reshaped to a computed shape has no static last dim; the MatMul's weight
    tells its channels (an LLM's o_proj input once fell back to one scale per row)."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
        helper.make_node("MatMul", ["r", "w"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 16]),
            helper.make_tensor_value_info("target", TensorProto.INT64, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 16])],
        [numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic-per-group", group_size=4, provider="cpu")
    assert any(n.op_type == "Reshape" and n.name.endswith("/groups") for n in onnx.load(tmp_path / "q.onnx").graph.node)
    x = tokens(rng) * np.logspace(-6, 0, 16, dtype=np.float32)
    for run in (run_ort, run_reference):
        got = run(tmp_path / "q.onnx", {"x": x, "target": np.array(x.shape, np.int64)})[0]
        np.testing.assert_array_equal(got, per_group_reference(x, 4))


def test_per_group_activations_in_an_emulated_format_are_per_group(tmp_path):
    """E3M4 (no ONNX type: float ops round to its grid) per group of 4 channels, bit for bit against
    ml_dtypes; it once got one scale per row (per token) while the summary said per group."""
    rng = np.random.default_rng(6)
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    report = fp8onnx.quantize(
        path,
        tmp_path / "q.onnx",
        activations="dynamic-per-group",
        group_size=4,
        activation_format="e3m4",
        provider="cpu",
    )
    assert "e4m3fn weights / e3m4 activations" in report.summary()
    x = tokens(rng) * np.logspace(-3, 0, 16, dtype=np.float32)
    rows = x.reshape(-1, 4)
    scale = np.clip(np.abs(rows).max(-1, keepdims=True) * np.float32(1 / 15.5), np.finfo(np.float32).tiny, None)
    want = ((rows / scale).astype(ml_dtypes.float8_e3m4).astype(np.float32) * scale).reshape(x.shape)
    for run in (run_ort, run_reference):
        got = run(tmp_path / "q.onnx", {"x": x})[0]
        assert np.array_equal(got, want), np.abs(got - want).max()


def test_per_group_falls_back_to_per_row_where_channels_are_not_groups(tmp_path, caplog):
    rng = np.random.default_rng(4)
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    with caplog.at_level("WARNING"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic-per-group", group_size=5, provider="cpu")
    assert "'x': 16 channels are not groups of 5; one scale per row there" in caplog.text
    x = tokens(rng)
    assert np.array_equal(run_ort(tmp_path / "q.onnx", {"x": x})[0], per_token_reference(x))


def test_constant_scaling_given_alone_overrules_the_presets_activations(tmp_path, caplog):
    """--scaling constant with a preset whose activations are dynamic (encoder) runs static at the one
    scale; with a weight-only preset, the calibration data given is not read (a warning, not an error:
    the preset chose the activations, not the user)."""
    from helpers import mlp_data, mlp_model

    encoder = fp8onnx.QuantizeConfig.for_preset("encoder", scaling="constant")
    assert encoder.activations == "static" and encoder.scale == 1.0 and encoder.weight_rounding == "nearest"
    path, data = mlp_model(tmp_path / "m.onnx", opset=21), mlp_data(tmp_path / "d.npz")
    caplog.set_level("WARNING", logger="fp8onnx")
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, preset="llm-weight-only", scaling="constant")
    assert report.modified and "the calibration data is not read" in caplog.text
    with pytest.raises(fp8onnx.Fp8OnnxError, match="needs no calibration"):  # the user's own choice: refused
        fp8onnx.quantize(path, tmp_path / "q2.onnx", data, activations="none", preset="none")
