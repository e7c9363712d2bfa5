"""MX-style scales: power-of-two (E8M0-representable) scales everywhere with --scaling pow2, in-graph
dynamic scales included, and --format mxfp8 (E4M3 elements, one power-of-two scale per 32 elements
for weights and activations) in standard ONNX; checked against NumPy bit for bit, onnx.reference and
onnxruntime CPU at its default optimisation level, and by SQNR against the unquantized graph."""

import ml_dtypes
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from test_activation_modes import FMAX, matmul, tokens
from test_blocks import layer

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main

from helpers import run_ort, run_reference, sqnr_db


def pow2_up(s: np.ndarray) -> np.ndarray:
    """NumPy: the smallest power of two >= s (s >= 0, float32), exactly, from the float's own exponent."""
    mantissa, exponent = np.frexp(s)
    p = np.where(mantissa == 0.5, s, np.ldexp(np.float32(1), exponent).astype(np.float32))
    return np.where(s == 0, np.float32(0), p).astype(np.float32)


def pow2_rows_reference(x: np.ndarray, group: int | None = None) -> np.ndarray:
    """NumPy: per row (or per ``group`` channels) scale = pow2_up(amax * (1/448)), at least float32's
    tiny; x/scale cast to E4M3 (saturating: never needed here, the scale is rounded up), times scale."""
    rows = x.reshape(-1, group) if group else x
    scale = pow2_up(np.abs(rows).max(-1, keepdims=True) * np.float32(1 / FMAX))
    scale = np.clip(scale, np.finfo(np.float32).tiny, None).astype(np.float32)
    return ((rows / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(x.shape)


def edge_rows(rng) -> np.ndarray:
    """[2, 8, 16]: rows whose amax / 448 is exactly a power of two, one float32 step either side of
    one, tiny, huge and zero (where Log's rounding could put the exponent one off)."""
    x = tokens(rng, magnitudes=(1.0, 1.0, 1.0, 1.0, 1e-30, 3e4, 0.0, 7.0))
    exact = FMAX * np.float32(2.0**-3)  # the float32 amax whose amax * (1/448) is 2^-3 exactly
    while exact * np.float32(1 / FMAX) > np.float32(2.0**-3):
        exact = np.nextafter(exact, np.float32(0))
    while exact * np.float32(1 / FMAX) < np.float32(2.0**-3):
        exact = np.nextafter(exact, np.float32(1e9))
    assert exact * np.float32(1 / FMAX) == np.float32(2.0**-3)
    for i, amax in enumerate((exact, np.nextafter(exact, np.float32(0)), np.nextafter(exact, np.float32(1e9)))):
        x[:, i] = x[:, i] / np.abs(x[:, i]).max(-1, keepdims=True) * amax
    return x.astype(np.float32)


def identity_quantized(tmp_path, mode: str, scaling: str) -> int | None:
    """tmp_path/q.onnx: a MatMul with an identity weight (exact in E4M3 per channel), quantized with
    in-graph activation scales (``mode``, groups of 8 for per-group) by ``scaling``; returns the group
    size (None per token). Its output is the quantized activation itself."""
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    group = 8 if mode == "dynamic-per-group" else None
    options = {"group_size": group} if group else {}
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", activations=mode, scaling=scaling, provider="cpu", **options)
    assert f"{scaling} scaling" in report.summary()
    return group


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # onnx.reference's Log of a zero row
@pytest.mark.parametrize("mode", ["dynamic-per-token", "dynamic-per-group"])
def test_pow2_dynamic_scales_match_numpy_bit_for_bit(tmp_path, mode):
    """With an identity weight (exact in E4M3 per channel), the output is the quantized activation itself."""
    group = identity_quantized(tmp_path, mode, "pow2")
    x = edge_rows(np.random.default_rng(7))
    want = pow2_rows_reference(x, group)
    for run in (run_ort, run_reference):
        got = run(tmp_path / "q.onnx", {"x": x})[0]
        assert np.array_equal(got, want), np.abs(got - want).max()
    ops = [n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node]
    assert {"Log", "Ceil", "Pow", "Less", "GreaterOrEqual"} <= set(ops)


def test_pow2_dynamic_per_tensor_scale(tmp_path):
    rng = np.random.default_rng(8)
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", scaling="pow2", provider="cpu", preset="none")
    x = edge_rows(rng)[:1, :2]  # the batch's amax * (1/448) exactly 2^-3
    scale = pow2_up(np.abs(x).max() * np.float32(1 / FMAX))
    assert scale == np.float32(2.0**-3)
    want = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    for run in (run_ort, run_reference):
        assert np.array_equal(run(tmp_path / "q.onnx", {"x": x})[0], want)


def test_without_pow2_the_dynamic_graph_is_unchanged(tmp_path):
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic-per-token", provider="cpu")
    assert not {"Log", "Pow", "Ceil"} & {n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node}


@pytest.mark.parametrize("activations", [None, "none"])
def test_format_mxfp8_is_e4m3_with_power_of_two_scales_per_32(tmp_path, activations):
    """Weights: blocked DequantizeLinear (block 32 along K) with power-of-two scales; activations: one
    power-of-two scale per row and 32 channels, in the graph (or none: weight-only MXFP8)."""
    path, x = layer(tmp_path / "m.onnx", 96, spread=3)
    options = {"activations": activations} if activations else {}
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", format="mxfp8", preset="none", provider="cpu", **options)
    model = onnx.load(tmp_path / "q.onnx")
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert {a.name: a.i for a in dq.attribute}["block_size"] == 32
    scales = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == dq.input[1]))
    assert scales.shape == (3, 24) and np.all(np.frexp(scales)[0] == 0.5)  # every one a power of two
    meta = report.config
    assert (meta["weight_format"], meta["weight_block_size"], meta["scaling"]) == ("e4m3fn", 32, "pow2")
    feed = {"x": x[:64]}
    ref, got, reference = run_ort(path, feed)[0], run_ort(model, feed)[0], run_reference(model, feed)[0]
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    ops = {n.op_type for n in model.graph.node}
    if activations == "none":
        assert "Pow" not in ops and sqnr_db(ref, got) > 30  # measured 31.5 dB
    else:
        assert {"Pow", "Reshape"} <= ops and (meta["activations"], meta["group_size"]) == ("dynamic-per-group", 32)
        assert sqnr_db(ref, got) > 26  # measured 28.3 dB (29.2 with amax scales, 28.4 per token)


def test_format_mxfp8_refuses_what_contradicts_it(tmp_path):
    path = matmul(tmp_path / "m.onnx", np.eye(16, dtype=np.float32))
    with pytest.raises(Fp8OnnxError, match="--format mxfp8 sets --weight-block-size 32; it contradicts"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", format="mxfp8", weight_block_size=64)
    with pytest.raises(Fp8OnnxError, match="bundle of settings"):
        fp8onnx.QuantizeConfig(format="mxfp8")
    r = CliRunner().invoke(
        main, ["quantize", str(path), "--format", "mxfp8", "--activations", "static", "-o", str(tmp_path / "q.onnx")]
    )
    assert r.exit_code == 2 and "--format mxfp8 sets --activations dynamic-per-group" in r.output, r.output
    assert not (tmp_path / "q.onnx").exists()


def mx_rows_reference(x: np.ndarray, group: int | None = None) -> np.ndarray:
    """NumPy, OCP MX's rule: per row (or ``group`` channels) scale = 2^(floor(log2 amax) - 8) (E4M3's
    emax), at least float32's tiny; x / scale saturated to +-448, cast to E4M3, times scale."""
    rows = x.reshape(-1, group) if group else x
    _, exponent = np.frexp(np.abs(rows).max(-1, keepdims=True))  # amax = m * 2^e, m in [0.5, 1)
    scale = np.ldexp(np.float32(1), exponent - 1 - 8).astype(np.float32)
    scale = np.clip(scale, np.finfo(np.float32).tiny, None).astype(np.float32)
    q = np.clip(rows / scale, -FMAX, FMAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * scale).reshape(x.shape)


def test_mx_scaling_is_ocp_rule_for_static_scales():
    """--scaling mx: scale = 2^(floor(log2 amax) - emax), emax the exponent of the format's largest
    value; the same in the per-element form (block scales)."""
    from fp8onnx.numerics.formats import Fp8Format
    from fp8onnx.numerics.scaling import Scaling, amax_to_scale, amax_to_scales, mx_emax

    assert [mx_emax(f) for f in (Fp8Format.E4M3FN, Fp8Format.E5M2, Fp8Format.E4M3FNUZ, Fp8Format.INT8)] == [8, 15, 7, 6]
    e4m3 = Fp8Format.E4M3FN
    for amax, scale in ((1.0, 2.0**-8), (1.9, 2.0**-8), (np.nextafter(2.0, 0), 2.0**-8), (2.0, 2.0**-7), (448, 1.0)):
        assert amax_to_scale(amax, e4m3, Scaling.MX) == scale
    # against pow2 (rounded up): the same but where amax's mantissa is above fmax's (1.75): then half of it
    assert amax_to_scale(1.5, e4m3, Scaling.POW2) == 2.0**-8 and amax_to_scale(1.9, e4m3, Scaling.POW2) == 2.0**-7
    rng = np.random.default_rng(0)
    amax = np.abs(rng.standard_normal(1000)) * 10.0 ** rng.integers(-9, 9, 1000)
    want = np.array([amax_to_scale(a, e4m3, Scaling.MX) for a in amax])
    assert np.array_equal(amax_to_scales(amax, e4m3, Scaling.MX), want)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # onnx.reference's Log of a zero row
@pytest.mark.parametrize("mode", ["dynamic-per-token", "dynamic-per-group"])
def test_mx_dynamic_scales_match_numpy_bit_for_bit_and_saturate(tmp_path, mode):
    """In-graph OCP MX scales (the largest power of two at most amax, over 2^8): bit for bit NumPy's on
    ORT CPU and onnx.reference, for rows whose amax is a power of two, one float32 step either side of
    one, has a mantissa above 1.75 (its largest values saturate at 448), is tiny, huge or zero."""
    group = identity_quantized(tmp_path, mode, "mx")
    x = edge_rows(np.random.default_rng(9))
    x[:, 3] *= np.float32(1.9) / np.abs(x[:, 3]).max(-1, keepdims=True)  # amax 1.9: saturates
    for i, amax in enumerate((np.float32(2.0), np.nextafter(np.float32(2.0), np.float32(0)))):
        x[:, 4 + i] *= amax / np.abs(x[:, 4 + i]).max(-1, keepdims=True)
    want = mx_rows_reference(x, group)
    assert np.abs(want[:, 3]).max() < np.abs(x[:, 3]).max()  # the row's largest value was saturated
    for run in (run_ort, run_reference):
        got = run(tmp_path / "q.onnx", {"x": x})[0]
        assert np.array_equal(got, want), np.abs(got - want).max()


def test_format_mxfp8_takes_the_ocp_rule(tmp_path):
    """--format mxfp8 --scaling mx: MXFP8 with OCP's scales (block weights and per-group activations)."""
    path, x = layer(tmp_path / "m.onnx", 96, spread=3)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", format="mxfp8", scaling="mx", preset="none", provider="cpu")
    assert (report.config["scaling"], report.config["weight_block_size"]) == ("mx", 32)
    model = onnx.load(tmp_path / "q.onnx")
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    scales = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == dq.input[1]))
    assert np.all(np.frexp(scales)[0] == 0.5)
    feed = {"x": x[:64]}
    ref, got = run_ort(path, feed)[0], run_ort(model, feed)[0]
    np.testing.assert_allclose(got, run_reference(model, feed)[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert sqnr_db(ref, got) > 26
