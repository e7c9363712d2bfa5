"""Folder in, folder out (fp8onnx.workflows.exports) without the exporters: a one-model folder, the output's
guards, atomic replacement. The exporters' folders and their runtimes are in tests/wild/test_deploy.py."""

import json
import os

import onnx
import pytest
from click.testing import CliRunner

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.workflows.exports import MANIFEST, describe_export, quantize_folder

from helpers import mlp_data, mlp_model


@pytest.fixture()
def export(tmp_path):
    folder = tmp_path / "export"
    (folder / "assets").mkdir(parents=True)
    onnx.save(
        onnx.load(mlp_model(tmp_path / "m.onnx")),
        folder / "model.onnx",
        save_as_external_data=True,
        location="model.onnx_data",
        size_threshold=0,
    )
    (folder / "config.json").write_text('{"model_type": "mlp"}')
    (folder / "assets" / "labels.txt").write_text("a\nb\n")
    return folder


def test_a_one_model_folder_gives_a_folder_with_every_other_file(tmp_path, export):
    old = os.umask(0o022)
    try:
        r = CliRunner().invoke(
            main,
            [
                "quantize",
                str(export),
                "--calib",
                str(mlp_data(tmp_path / "d.npz")),
                "-o",
                str(tmp_path / "out"),
                "--provider",
                "cpu",
            ],
        )
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        [
            MANIFEST,
            "assets/labels.txt",
            "config.json",
            "model.onnx",
            "model.onnx.data",
        ]
    )  # the source's model.onnx_data is replaced by the quantized weights, not copied
    assert describe_export(export).layout == "one model"
    assert json.loads((out / MANIFEST).read_text())["layout"] == "one model"
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder left
    # a second run replaces its own earlier output
    quantize_folder(export, out, mlp_data(tmp_path / "d.npz"), provider="cpu")
    assert (out / "model.onnx").is_file()


def test_api_options_reach_every_model_of_the_folder(tmp_path, export):
    """quantize_folder's keyword options are quantize's: a preset is applied (not only recorded) and a
    recipe field beside a config is refused (tests/test_runtime.py: the default is preset auto)."""
    out = tmp_path / "out"
    report = quantize_folder(export, out, mlp_data(tmp_path / "d.npz"), provider="cpu", preset="cnn")
    (config,) = [r.config for r in report.reports.values()]
    assert config["preset"] == "cnn" and config["bias_correction"] is True  # the preset's, not only its name
    with pytest.raises(Fp8OnnxError, match="per_channel given beside config="):
        quantize_folder(export, out, mlp_data(tmp_path / "d.npz"), config=QuantizeConfig(), per_channel=True)


@pytest.mark.parametrize(
    "where, message",
    [
        ("inside", "is the export folder or inside it"),
        ("same", "is the export folder or inside it"),
        ("parent", "holds the export folder"),
        ("foreign", "not empty and was not written by fp8onnx"),
        ("file", "is a file"),
    ],
)
def test_output_folders_that_would_lose_something_are_refused(tmp_path, export, where, message):
    out = {"inside": export / "fp8", "same": export, "parent": tmp_path}.get(where, tmp_path / "out")
    if where == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    if where == "file":
        out.write_text("x")
    with pytest.raises(Fp8OnnxError, match=message):
        quantize_folder(export, out, mlp_data(tmp_path / "d.npz"), provider="cpu")
    if where == "foreign":
        assert (out / "notes.txt").read_text() == "mine"


def test_folders_in_no_known_layout_are_named(tmp_path, export):
    mlp_model(export / "other.onnx")
    with pytest.raises(Fp8OnnxError, match=r"2 models \(model.onnx, other.onnx\) in no layout"):
        describe_export(export)
    (export / "genai_config.json").write_text('{"model": {"decoder": {"filename": "missing.onnx"}}}')
    with pytest.raises(Fp8OnnxError, match=r"names the decoder 'missing\.onnx'"):
        describe_export(export)


@pytest.mark.parametrize("inside", ["export", "out"])
def test_a_report_inside_either_folder_is_refused(tmp_path, export, inside):
    report = (export if inside == "export" else tmp_path / "out") / "config.json"
    before = (export / "config.json").read_text()
    r = CliRunner().invoke(
        main,
        ["quantize", str(export), "--activations", "dynamic", "-o", str(tmp_path / "out"), "--report", str(report)],
    )
    assert r.exit_code == 2 and "lies inside" in r.output, r.output
    assert (export / "config.json").read_text() == before
