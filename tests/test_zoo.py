"""fp8onnx zoo: models found with their sidecar data, a grid of cells saved one by one and reused."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.experiments.zoo import find_models, zoo, zoo_configs
from fp8onnx.settings.config import QuantizeConfig

from helpers import SAMPLE, mlp_data, mlp_model

CONFIGS = [c for c in zoo_configs() if c[0] in ("e4m3fn amax", "e5m2 amax", "e4m3fn weight-only")]


def small_zoo(folder):
    """Two MLPs with NAME.calib.npz / NAME.eval.npz beside them, and the sample decoder as an export
    folder holding model.onnx, calib.npz and eval.npz."""
    folder.mkdir()
    for i in range(2):
        mlp_model(folder / f"mlp{i}.onnx", seed=i)
        mlp_data(folder / f"mlp{i}.calib.npz", seed=10 + i)
        mlp_data(folder / f"mlp{i}.eval.npz", seed=20 + i)
    dec = folder / "decoder"
    dec.mkdir()
    shutil.copy(SAMPLE / "decoder.onnx", dec / "model.onnx")
    for name in ("calib.npz", "eval.npz"):
        shutil.copy(SAMPLE / name, dec / name)
    return folder


def test_models_are_found_with_their_data(tmp_path):
    folder = small_zoo(tmp_path / "zoo")
    models = find_models(folder)
    assert [m.name for m in models] == ["decoder", "mlp0", "mlp1"]
    assert models[1].calib.endswith("mlp0.calib.npz") and models[0].data.endswith("decoder/eval.npz")
    listing = tmp_path / "models.txt"
    listing.write_text("# the zoo\nzoo/mlp1.onnx\n\nzoo/decoder\n")
    assert [m.name for m in find_models(listing)] == ["mlp1", "decoder"]
    (folder / "mlp1.eval.npz").unlink()
    with pytest.raises(Fp8OnnxError, match=r"mlp1.onnx' has no eval data: expected mlp1.eval.npz"):
        find_models(folder)
    with pytest.raises(Fp8OnnxError, match="does not exist"):
        find_models(tmp_path / "nowhere")


def test_the_pass_rates_come_from_the_cells_and_a_rerun_computes_only_what_is_missing(tmp_path):
    folder, out = small_zoo(tmp_path / "zoo"), tmp_path / "out"
    first = zoo(folder, out, configs=CONFIGS, provider="cpu")
    assert first.ran == 3 and [c["label"] for c in first.configs] == [c[0] for c in CONFIGS]
    for summary in first.configs:
        cells = [m["cells"][summary["label"]] for m in first.models]
        assert summary["models"] == 3
        assert summary["passes_ptq"] == sum(bool(c["passes_ptq"]) for c in cells)
        assert summary["passes_llm"] == sum(c["ratio_to_fp16"] >= 0.995 for c in cells)
    decoder = first.models[0]
    assert decoder["metric"] == "task accuracy" and decoder["cells"]["e4m3fn amax"]["ratio_to_fp16"] > 0.99
    # a cell lost (an interrupted run): only its model runs again, and the result is the same
    (out / "cells" / "mlp1" / "e5m2_amax.cell.json").unlink()
    again = zoo(folder, out, configs=CONFIGS, provider="cpu")
    assert again.ran == 1 and again.models == first.models and again.configs == first.configs
    assert zoo(folder, out, configs=CONFIGS, provider="cpu").ran == 0
    # a cell file edited into nonsense is computed again, not trusted and not a crash
    (out / "cells" / "mlp0" / "e4m3fn_amax.cell.json").write_text("{not json")
    mended = zoo(folder, out, configs=CONFIGS, provider="cpu")
    assert mended.ran == 1 and mended.models == first.models
    # one more configuration later: every model runs for that one only
    more = CONFIGS + [("e4m3fn pow2", "scaling", QuantizeConfig(scaling="pow2"))]
    grown = zoo(folder, out, configs=more, provider="cpu")
    assert grown.ran == 3 and all(
        m["cells"]["e4m3fn amax"] == f["cells"]["e4m3fn amax"] for m, f in zip(grown.models, first.models)
    )


def test_cli_writes_json_csv_and_plot_and_refuses_bad_input(tmp_path):
    folder, out = small_zoo(tmp_path / "zoo"), tmp_path / "out"
    runner = CliRunner()
    args = ["zoo", str(folder), "-o", str(out), "--configs", "e4m3fn amax,e5m2 amax", "--provider", "cpu"]
    result = runner.invoke(main, [*args, "--plot", str(tmp_path / "rates.png")])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "zoo.json").read_text())
    assert [c["label"] for c in doc["configs"]] == ["e4m3fn amax", "e5m2 amax"]
    assert (out / "zoo.csv").read_text().count("\n") == 1 + 3 * 2
    assert (tmp_path / "rates.png").read_bytes()[:4] == b"\x89PNG"
    bad = runner.invoke(main, ["zoo", str(folder), "-o", str(out), "--configs", "e9m9 amax"])
    assert bad.exit_code == 2 and "Unknown zoo configuration 'e9m9 amax'" in bad.output
    onto = runner.invoke(main, [*args, "--plot", str(folder / "mlp0.onnx")])
    assert onto.exit_code == 2 and "mlp0.onnx" in onto.output
    assert runner.invoke(main, ["zoo", "--list", str(folder), "-o", str(out)]).output.count("\n") == len(zoo_configs())


def test_a_sidecar_gives_the_family_and_options_every_configuration_of_that_model_takes(tmp_path):
    """``NAME.zoo.json`` (or ``zoo.json`` in an export folder): the model's task family, counted in a
    pass table per family, and QuantizeConfig fields applied to each of its configurations (here
    per-channel weights for one MLP only); its cells are stale once its options change. A bad
    sidecar is refused in one sentence naming the file."""
    folder, out = small_zoo(tmp_path / "zoo"), tmp_path / "out"
    (folder / "mlp0.zoo.json").write_text(json.dumps({"family": "mlp", "options": {"per_channel": True}}))
    (folder / "decoder" / "zoo.json").write_text(json.dumps({"family": "language modelling", "metric": "next byte"}))
    models = {m.name: m for m in find_models(folder)}
    assert models["mlp0"].family == "mlp" and models["mlp0"].options == {"per_channel": True}
    assert models["decoder"].family == "language modelling" and models["mlp1"].family == ""
    result = zoo(folder, out, configs=CONFIGS[:1], provider="cpu")
    cells = {m["name"]: m["cells"]["e4m3fn amax"] for m in result.models}
    assert cells["mlp0"]["config"]["per_channel"] is True and cells["mlp1"]["config"]["per_channel"] is False
    families = result.configs[0]["families"]
    assert {f: v["models"] for f, v in families.items()} == {"-": 1, "language modelling": 1, "mlp": 1}
    assert sum(v["passes_ptq"] for v in families.values()) == result.configs[0]["passes_ptq"]
    assert "family (within 1% rel)" in result.table() and "family" in result.to_csv().splitlines()[0]
    (folder / "mlp0.zoo.json").write_text(json.dumps({"family": "mlp", "options": {"per_channel": False}}))
    assert zoo(folder, out, configs=CONFIGS[:1], provider="cpu").ran == 1  # mlp0 again: its options changed
    for text, message in (
        ("{nope", "is not readable JSON"),
        (json.dumps({"options": {"colour": "red"}}), "'colour' is not a quantize option"),
        (json.dumps({"options": {"preset": "cnn"}}), "'preset' is not a quantize option"),
        (json.dumps({"options": {"op_types": ["Softmax"]}}), "mlp0.zoo.json"),
        (json.dumps(["a list"]), "must be an object"),
    ):
        (folder / "mlp0.zoo.json").write_text(text)
        with pytest.raises(Fp8OnnxError, match=message):
            find_models(folder)
