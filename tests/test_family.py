"""--preset auto: the model family told from the graph, the family's preset under the user's own
options, and calibration on the bundled text sample when a token model comes without data."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from test_conv import cnn
from test_sources import _model as _lm

import fp8onnx
from fp8onnx.cli import main
from fp8onnx.graph.model_io import load_model
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.techniques.family import detect_family

from helpers import SAMPLE, mlp_model


def _speech(path):
    """input_values[b, t] -> Unsqueeze -> Conv1d(4, k3) -> Transpose -> MatMul: a wav2vec-like front."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Unsqueeze", ["input_values", "axis"], ["x3"]),
        helper.make_node("Conv", ["x3", "w1"], ["c"], name="conv"),
        helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["t", "w2"], ["hidden"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "speech",
        [helper.make_tensor_value_info("input_values", TensorProto.FLOAT, ["b", "t"])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "t", 8])],
        [
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
            numpy_helper.from_array(rng.standard_normal((4, 1, 3)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w2"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _encoder(path):
    """input_ids -> Gather(table) -> MatMul: token ids in, hidden states out, no vocabulary projection."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input_ids"], ["e"]), helper.make_node("MatMul", ["e", "w"], ["hidden"])],
        "enc",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", 8])],
        [
            numpy_helper.from_array(rng.standard_normal((300, 8)).astype(np.float32), "emb"),
            numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(
    "build, family, preset, why",
    [
        (lambda p: SAMPLE / "decoder.onnx", "decoder LLM", "llm-weight-only", "a causal mask, 'logits': scores over"),
        # no KV cache, no causal mask a graph shows, a 400-token vocabulary: its per-position scores say it
        (lambda p: _lm(p, past=False), "decoder LLM", "llm-weight-only", "the 400-token vocabulary at every position"),
        (_encoder, "encoder", "encoder", "no vocabulary projection"),
        (cnn, "CNN", "cnn", "2 Conv/ConvTranspose nodes, 1 MatMul/Gemm"),
        (_speech, "speech", None, "audio input 'input_values'"),
        (mlp_model, "other", None, "MatMul/Gemm nodes"),
    ],
)
def test_the_family_is_told_from_the_graph(tmp_path, build, family, preset, why):
    found = detect_family(load_model(build(tmp_path / "m.onnx")))
    assert (found.name, found.preset) == (family, preset)
    assert why in found.why and found.describe().startswith(f"model family: {family} (")


def test_auto_applies_the_family_preset_under_explicit_options(tmp_path):
    out = tmp_path / "q.onnx"
    config = QuantizeConfig.for_preset("auto", activations="static")  # the user's own choice stays
    report = fp8onnx.quantize(SAMPLE / "decoder.onnx", out, SAMPLE / "calib.npz", config=config, provider="cpu")
    assert report.family["family"] == "decoder LLM" and report.family["preset"] == "llm-weight-only"
    assert report.config["preset"] == "llm-weight-only" and report.config["activations"] == "static"
    assert report.config["weight_rounding"] == "gptq"  # from the preset
    assert report.summary().splitlines()[1].startswith("  model family: decoder LLM")
    meta = json.loads(onnx.load(out).metadata_props[0].value)
    assert meta["preset"] == "llm-weight-only"
    # the default (no config): weight-only float8, activations in float, and the summary says why
    plain = fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "d.onnx", SAMPLE / "calib.npz", provider="cpu")
    assert plain.config["activations"] == "none" and "--preset llm gives them" in plain.summary()
    # FP8 GEMMs (GemmFloat8) take static per-tensor scales: auto gives the plain recipe then
    gemm = fp8onnx.quantize(
        SAMPLE / "decoder.onnx", tmp_path / "g.onnx", SAMPLE / "calib.npz", native_gemm=True, provider="cpu"
    )
    assert (
        gemm.family["preset"] == "none"
        and gemm.config["activations"] == "static"
        and "--native-gemm" in (gemm.family["why"])
    )
    assert QuantizeConfig.for_preset("none") == QuantizeConfig()


def test_a_token_model_without_data_calibrates_on_the_bundled_text_sample(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    _encoder(folder / "model.onnx")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "the", "a", "of", "to", "and"])}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    r = CliRunner().invoke(main, ["quantize", str(folder), "-o", str(tmp_path / "q.onnx")])
    assert r.exit_code == 0, r.output
    assert "text sample of CPython's documentation" in r.output and "domain data calibrates better" in r.output
    (folder / "tokenizer.json").unlink()
    # no tokenizer, no data: the preset's data-driven part (GPTQ) is skipped and said; per-token needs none
    r = CliRunner().invoke(main, ["quantize", str(folder), "-o", str(tmp_path / "q2.onnx")])
    assert r.exit_code == 0 and "no calibration data: GPTQ rounding of preset encoder skipped" in r.output, r.output
    r = CliRunner().invoke(main, ["quantize", str(folder), "--activations", "static", "-o", str(tmp_path / "q4.onnx")])
    assert r.exit_code == 2 and "has no tokenizer.json beside it" in r.output, r.output
    # the hint names what still reads data: per-token activations would not free the preset's GPTQ from it
    assert "which activation statistics, GPTQ rounding read." in r.output, r.output
    r = CliRunner().invoke(main, ["quantize", str(folder), "--preset", "none", "-o", str(tmp_path / "q5.onnx")])
    assert r.exit_code == 2 and "or use --activations dynamic-per-token (no data needed)." in r.output, r.output
    r = CliRunner().invoke(main, ["quantize", str(mlp_model(tmp_path / "m.onnx")), "-o", str(tmp_path / "q3.onnx")])
    assert r.exit_code == 2 and "need calibration" in r.output, r.output  # not a token model: what data it needs


def test_the_accuracy_search_under_auto_uses_the_family_recipe_and_its_data(tmp_path):
    """requires: a CNN (auto: the cnn preset, whose bias correction reads the calibration data) and
    held-out data; ensures: every variant the search scores is quantized with that recipe (the data
    is passed, the stem stays in float), and the written model carries the family line."""
    path = cnn(tmp_path / "m.onnx")
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((32, 3, 8, 8)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=rng.standard_normal((32, 3, 8, 8)).astype(np.float32))
    result = fp8onnx.quantize_to_target(
        path, tmp_path / "q.onnx", tmp_path / "calib.npz", tmp_path / "eval.npz", accuracy_target=99.0, provider="cpu"
    )
    assert result.met and result.report.family["preset"] == "cnn"
    assert result.report.config["bias_correction"] and result.report.config["float_stem"]


def test_an_explicit_calibrated_scaling_wins_over_the_presets_implicit_activations(tmp_path):
    """`quantize minilm.onnx --calib c.npz --scaling percentile` under auto: the encoder preset's dynamic
    per-token activations (an option the user never typed) yield to static ones, which the scaling
    calibrates; the preset's weight settings stay, and activations typed by hand still win."""
    from click.testing import CliRunner

    from fp8onnx.cli import main

    for scaling in ("percentile", "mse"):
        config = QuantizeConfig.for_preset("encoder", scaling=scaling)
        assert (config.activations, config.scaling.value, config.weight_rounding) == ("static", scaling, "gptq")
    assert QuantizeConfig.for_preset("encoder", scaling="pow2").activations == "dynamic-per-token"  # in-graph pow2
    with pytest.raises(fp8onnx.Fp8OnnxError, match="needs calibration"):
        QuantizeConfig.for_preset("encoder", scaling="percentile", activations="dynamic-per-token")
    args = ["quantize", str(SAMPLE / "decoder.onnx"), "--calib", str(SAMPLE / "calib.npz"), "--scaling", "mse"]
    r = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "q.onnx"), "--provider", "cpu"])
    assert r.exit_code == 0, r.output
    meta = json.loads(onnx.load(tmp_path / "q.onnx").metadata_props[0].value)
    assert meta["activations"] == "static" and meta["scaling"] == "mse" and meta["preset"] == "llm-weight-only"


def test_the_llm_presets_keep_outlier_channels_and_yield_to_smoothing(tmp_path):
    """requires: a decoder and calibration data; ensures: the decoder family's default (llm-weight-only) and
    llm-w8a8 keep each activation's 4 largest channels in float and the summary says so; --preset llm (the
    FP8-dynamic recipe the torch anchor checks) keeps none; the user's smoothing or one constant scale
    drops the preset's kept channels instead of refusing the run, an explicit count wins."""
    assert [QuantizeConfig.for_preset(p).keep_channels for p in ("llm-weight-only", "llm-w8a8", "llm")] == [4, 4, 0]
    smoothed = QuantizeConfig.for_preset("llm-w8a8", smooth=0.5)
    assert (smoothed.keep_channels, smoothed.smooth) == (0, 0.5)
    constant = QuantizeConfig.for_preset("llm-weight-only", scaling="constant", weight_rounding="nearest")
    assert constant.keep_channels == 0
    assert QuantizeConfig.for_preset("llm-w8a8", keep_channels=2).keep_channels == 2
    report = fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "d.onnx", SAMPLE / "calib.npz", provider="cpu")
    assert report.config["keep_channels"] == 4
    assert "kept the 4 largest input channels of " in report.summary()
    graph = onnx.load(tmp_path / "d.onnx").graph
    assert any(n.op_type == "Gather" and "kept" in n.name for n in graph.node), [n.name for n in graph.node][:20]
    plain = fp8onnx.quantize(
        SAMPLE / "decoder.onnx", tmp_path / "l.onnx", SAMPLE / "calib.npz", config=QuantizeConfig.for_preset("llm")
    )
    assert "keep_channels" not in plain.config and "kept the" not in plain.summary()
