"""--headroom: static activation scales that cover a multiple of the calibrated range.

requires: static activations with a calibrated scaling (amax, pow2, percentile, mse); X >= 1.
ensures: every static activation scale is X times the one without headroom (weights' unchanged), so inputs
up to X times the calibrated absolute maximum do not clip; outputs without it stay byte-identical."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.settings.config import QuantizeConfig

from helpers import mlp_data, mlp_model, run_ort, run_reference, sqnr_db, sqnr_floor_db


def _scales(path) -> tuple[dict, dict]:
    """(activation Q scales, weight DQ scales) by the tensor they quantize."""
    model = onnx.load(path)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    act, weight = {}, {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits:
            act[node.input[0]] = inits[node.input[1]]
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            weight[node.input[0]] = inits[node.input[1]]
    return act, weight


@pytest.fixture
def mlp(tmp_path):
    path = mlp_model(tmp_path / "mlp.onnx")
    return path, mlp_data(tmp_path / "calib.npz", seed=1)


@pytest.mark.parametrize("scaling", ["amax", "pow2"])
def test_activation_scales_are_widened_and_weights_untouched(tmp_path, mlp, scaling):
    path, calib = mlp
    fp8onnx.quantize(path, tmp_path / "a.onnx", calib, activations="static", scaling=scaling)
    fp8onnx.quantize(path, tmp_path / "b.onnx", calib, activations="static", scaling=scaling, headroom=4)
    (act_a, w_a), (act_b, w_b) = _scales(tmp_path / "a.onnx"), _scales(tmp_path / "b.onnx")
    assert act_a and act_a.keys() == act_b.keys() and w_a.keys() == w_b.keys()
    for name in act_a:  # a power of two: exact in float32 either way
        np.testing.assert_array_equal(act_b[name], 4 * act_a[name])
    for name in w_a:
        np.testing.assert_array_equal(w_b[name], w_a[name])
    assert "headroom" not in fp8onnx.quantize(path, tmp_path / "c.onnx", calib, activations="static").config


def test_inputs_past_the_calibrated_range_clip_without_it(tmp_path, mlp):
    path, calib = mlp
    fmt = Fp8Format.E4M3FN
    fp8onnx.quantize(path, tmp_path / "plain.onnx", calib, activations="static")
    wide = fp8onnx.quantize(path, tmp_path / "wide.onnx", calib, activations="static", headroom=4)
    assert wide.config["headroom"] == 4 and "activation headroom 4x" in wide.summary()
    x = np.random.default_rng(7).standard_normal((64, 16)).astype(np.float32)
    for scale in (1.0, 3.0):  # in range, then three times the calibrated range
        feed = {"x": scale * x}
        want = run_ort(path, feed)[0]
        got = {name: run_ort(tmp_path / f"{name}.onnx", feed)[0] for name in ("plain", "wide")}
        ref = run_reference(tmp_path / "wide.onnx", feed)[0]  # the ONNX reference agrees with onnxruntime
        assert sqnr_db(got["wide"], ref) > 60
        db = {name: sqnr_db(want, y) for name, y in got.items()}
        assert db["wide"] > sqnr_floor_db(fmt, 4, slack_db=3)  # two weights, two activations
        if scale == 1.0:
            assert abs(db["wide"] - db["plain"]) < 3  # a few smallest values lost at most
        else:
            assert db["wide"] > db["plain"] + 6  # clipping costs the plain scales
            assert db["plain"] < sqnr_floor_db(fmt, 4, slack_db=3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"headroom": 0.5}, "--headroom must be a finite number of at least 1, got 0.5"),
        ({"headroom": float("inf")}, "--headroom must be a finite number of at least 1"),
        ({"headroom": True}, "--headroom must be a finite number of at least 1"),
        (
            {"headroom": 2, "activations": "dynamic"},
            "--headroom widens calibrated static activation scales; --activations dynamic has none to widen",
        ),
        ({"headroom": 2, "activations": "none"}, "--activations none has none to widen"),
        ({"headroom": 2, "scaling": "constant"}, "--scaling constant has none to widen"),
    ],
)
def test_bad_headroom_is_one_sentence(options, message):
    with pytest.raises(Fp8OnnxError, match=message.replace("(", r"\(")):
        QuantizeConfig(**options)


def test_presets_leave_it_and_take_it():
    """No preset sets it (on SmolLM2's LAMBADA it changed nothing measurable); a preset with static
    activations takes it, one whose dynamic activations it cannot apply to says so."""
    assert QuantizeConfig.for_preset("llm-w8a8").headroom == 1
    assert QuantizeConfig.for_preset("llm-w8a8", headroom=2).headroom == 2
    with pytest.raises(Fp8OnnxError, match="--activations dynamic-per-token has none to widen"):
        QuantizeConfig.for_preset("llm", headroom=2)


def test_cli_refuses_a_headroom_below_one(tmp_path, mlp):
    path, calib = mlp
    args = ["quantize", str(path), "--calib", str(calib), "--activations", "static", "--headroom", "0.5"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 2 and "--headroom" in result.output
    assert not (tmp_path / "q.onnx").exists()
