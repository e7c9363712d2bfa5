"""SmoothQuant for FP8: outlier channels move into the weights; the float function is unchanged."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format

from helpers import run_ort, run_reference, sqnr_db, sqnr_floor_db


def block(path, rng, norm=True):
    """x -> [LayerNormalization] -> MatMul(q), MatMul(k). Channel 0 of the MatMuls' input is a 3e4x outlier
    (by the norm's scale, or in x itself): per tensor, the other channels fall into E4M3's subnormals."""
    d = 32
    gamma = np.ones(d, np.float32)
    gamma[0] = 3e4
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1)] if norm else []
    src = "h" if norm else "x"
    nodes += [
        helper.make_node("MatMul", [src, "wq"], ["q"], name="mm_q"),
        helper.make_node("MatMul", [src, "wk"], ["k"], name="mm_k"),
    ]
    weights = [(rng.standard_normal((d, 16)) / 6).astype(np.float32) for _ in range(2)]
    for w in weights:  # the outlier channel's weights are small: it adds to the output like the others
        w[0] /= 3e4
    inits = [numpy_helper.from_array(w, n) for w, n in zip(weights, ("wq", "wk"))]
    if norm:
        inits += [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(d, np.float32), "beta")]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", d])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 16]) for n in ("q", "k")],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((512, d)).astype(np.float32)
    if not norm:
        x[:, 0] *= 3e4
    return path, x


@pytest.mark.parametrize("norm", [True, False])
def test_smoothing_helps_per_tensor_fp8_and_keeps_the_function(tmp_path, norm):
    rng = np.random.default_rng(0)
    path, x = block(tmp_path / "m.onnx", rng, norm)
    np.savez(tmp_path / "calib.npz", x=x[:256])
    held_out = {"x": x[256:]}
    refs = run_ort(path, held_out)
    sqnr = {}
    for alpha in (None, 0.5):
        out = tmp_path / f"q{alpha}.onnx"
        report = fp8onnx.quantize(path, out, tmp_path / "calib.npz", smooth=alpha, provider="cpu")
        got = run_ort(out, held_out)
        sqnr[alpha] = min(sqnr_db(r, g) for r, g in zip(refs, got))
    assert sqnr[0.5] > sqnr[None] + 6 and sqnr[0.5] > sqnr_floor_db(Fp8Format.E4M3FN, 2)
    folded = ("1" if norm else "0") + " folded into the norm or MatMul that computes them"
    assert any(f"smoothed 1 activations into their weights (alpha 0.5; {folded})" in p for p in report.prepared)
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ("Mul" in ops) != norm  # folded into the LayerNormalization's scale, else one Mul
    assert ops.count("QuantizeLinear") == 1  # the smoothed activation is quantized, Mul or not
    for r, g in zip(refs, run_reference(out, held_out)):
        assert sqnr_db(r, g) > sqnr_floor_db(Fp8Format.E4M3FN, 2)


def swiglu(path, rng, bias: bool):
    """x -> up = MatMul(x, wu) [+ bu], gate = MatMul(x, wg); h = silu(gate) * up -> MatMul(h, wd). Channel 0
    of h is a 1e5x outlier (column 0 of wu), which smoothing folds back into wu's columns (and bu)."""
    d, f = 16, 32
    wu, wg = ((rng.standard_normal((d, f)) / 4).astype(np.float32) for _ in range(2))
    wd = (rng.standard_normal((f, d)) / 6).astype(np.float32)
    wu[:, 0] *= 1e5
    wd[0] /= 1e5
    bu = (rng.standard_normal(f) / 4).astype(np.float32)
    bu[0] *= 1e5
    nodes = [
        helper.make_node("MatMul", ["x", "wu"], ["up0" if bias else "up"], name="mm_up"),
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="mm_gate"),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sig"),
        helper.make_node("Mul", ["g", "sg"], ["silu"], name="silu"),
        helper.make_node("Mul", ["silu", "up"], ["h"], name="glu"),
        helper.make_node("MatMul", ["h", "wd"], ["y"], name="mm_down"),
        helper.make_node("Shape", ["h"], ["h_shape"], name="shape"),  # reads h's shape only: folding is safe
    ]
    inits = [numpy_helper.from_array(w, n) for w, n in ((wu, "wu"), (wg, "wg"), (wd, "wd"))]
    if bias:
        nodes.insert(1, helper.make_node("Add", ["up0", "bu"], ["up"], name="add_up"))
        inits.append(numpy_helper.from_array(bu, "bu"))
    graph = helper.make_graph(
        nodes,
        "swiglu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", d])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", d]),
            helper.make_tensor_value_info("h_shape", TensorProto.INT64, [2]),
        ],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path, rng.standard_normal((512, d)).astype(np.float32)


@pytest.mark.parametrize("bias", [False, True], ids=["matmul", "matmul+add"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_smoothing_folds_into_the_columns_of_a_preceding_matmul(tmp_path, bias, per_channel):
    """Folded into up's columns when up's weight is per output channel (its scales absorb 1/s); with a
    per-tensor weight the columns would spread its range, so a Mul is inserted instead."""
    rng = np.random.default_rng(0)
    path, x = swiglu(tmp_path / "m.onnx", rng, bias)
    np.savez(tmp_path / "calib.npz", x=x[:256])
    held_out = {"x": x[256:]}
    ref = run_ort(path, held_out)[0]
    sqnr = {}
    for alpha in (None, 0.5):
        out = tmp_path / f"q{alpha}.onnx"
        report = fp8onnx.quantize(
            path, out, tmp_path / "calib.npz", smooth=alpha, op_types=["MatMul"], per_channel=per_channel
        )
        sqnr[alpha] = sqnr_db(ref, run_ort(out, held_out)[0])
    # per tensor, wu's own outlier column stays in wu (only folding would have removed it): above the
    # floor only per channel, but 6 dB better than without smoothing either way
    floor = sqnr_floor_db(Fp8Format.E4M3FN, 3) if per_channel else sqnr[None] + 6
    assert sqnr[0.5] > sqnr[None] + 6 and sqnr[0.5] > floor
    assert sqnr_db(ref, run_reference(out, held_out)[0]) > floor
    q = onnx.load(out)
    smooths = {n.name for n in q.graph.node if n.name.endswith("/smooth")}
    if per_channel:  # the graph input x needs a Mul; h was folded into wu's columns
        assert smooths == {"fp8onnx/x/smooth"}
        assert any("1 folded into the norm or MatMul" in p for p in report.prepared)
    else:
        assert smooths == {"fp8onnx/x/smooth", "fp8onnx/h/smooth"}
        assert any("0 folded into the norm or MatMul" in p for p in report.prepared)
    assert [n.op_type for n in q.graph.node if not n.name.startswith("fp8onnx")].count("Mul") == 2  # silu, glu
    assert [n.op_type for n in q.graph.node].count("QuantizeLinear") == 2  # x (smoothed) and h: both in FP8


def test_smoothing_needs_calibration_and_an_alpha_in_range(tmp_path):
    path, _ = block(tmp_path / "m.onnx", np.random.default_rng(1))
    with pytest.raises(Fp8OnnxError, match="--smooth must be in"):
        fp8onnx.QuantizeConfig(smooth=1.5)
    with pytest.raises(Fp8OnnxError, match="--smooth needs --calib DATA"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", smooth=0.5)
