"""No output of any kind may land on a file the run reads, or on another output of the same run:
every command x every output option x every file it reads (and the outputs among themselves),
through the CLI. Each must exit 2 with one line, before any work, and leave every file as it was."""

import hashlib
import os

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from fp8onnx.cli import main

from helpers import mlp_data, mlp_model

# What each command reads: option (None: positional) -> name of the file in the fixture folder.
MODEL_READS = {"the model": "ext/m.onnx", "its external data": "ext/m.data"}
COMMANDS = {
    "quantize": {
        "args": ["quantize", "{t}/ext/m.onnx", "--calib", "{t}/d.npz", "--check", "{t}/e.npz"],
        "outputs": {"-o": "{t}/q.onnx", "--report": "{t}/r.json"},
        "reads": {**MODEL_READS, "--calib": "d.npz", "--check": "e.npz"},
    },
    "quantize --stats": {
        "args": ["quantize", "{t}/ext/m.onnx", "--stats", "{t}/s.json"],
        "outputs": {"-o": "{t}/q.onnx", "--report": "{t}/r.json"},
        "reads": {**MODEL_READS, "--stats": "s.json"},
    },
    "quantize --calib folder": {
        "args": ["quantize", "{t}/ext/m.onnx", "--calib", "{t}/dd"],
        "outputs": {"-o": "{t}/q.onnx", "--report": "{t}/r.json"},
        "reads": {**MODEL_READS, "--calib (a file in the folder)": "dd/d.npz"},
    },
    "calibrate": {
        "args": ["calibrate", "{t}/ext/m.onnx", "--calib", "{t}/d.npz"],
        "outputs": {"-o": "{t}/s2.json"},
        "reads": {**MODEL_READS, "--calib": "d.npz"},
    },
    "fp16": {"args": ["fp16", "{t}/ext/m.onnx"], "outputs": {"-o": "{t}/f.onnx"}, "reads": MODEL_READS},
    "compare": {
        "args": ["compare", "{t}/ext/m.onnx", "{t}/c.onnx", "--data", "{t}/e.npz"],
        "outputs": {"--json": "{t}/c.json"},
        "reads": {**MODEL_READS, "the candidate": "c.onnx", "--data": "e.npz"},
    },
    "sensitivity": {
        "args": ["sensitivity", "{t}/ext/m.onnx", "--calib", "{t}/d.npz", "--data", "{t}/e.npz"],
        "outputs": {"--json": "{t}/sens.json"},
        "reads": {**MODEL_READS, "--calib": "d.npz", "--data": "e.npz"},
    },
    "study": {
        "args": ["study", "{t}/ext/m.onnx", "--calib", "{t}/d.npz", "--data", "{t}/e.npz"],
        "outputs": {"--json": "{t}/st.json", "--csv": "{t}/st.csv"},
        "reads": {**MODEL_READS, "--calib": "d.npz", "--data": "e.npz"},
    },
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    t = tmp_path_factory.mktemp("overwrite")
    m = mlp_model(t / "plain.onnx")
    (t / "ext").mkdir()
    onnx.save(onnx.load(m), t / "ext" / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    mlp_model(t / "c.onnx", seed=3)
    mlp_data(t / "d.npz")
    mlp_data(t / "e.npz", seed=2)
    (t / "dd").mkdir()
    mlp_data(t / "dd" / "d.npz")
    r = CliRunner().invoke(
        main, ["calibrate", str(t / "ext" / "m.onnx"), "--calib", str(t / "d.npz"), "-o", str(t / "s.json")]
    )
    assert r.exit_code == 0, r.output
    return t


def _snapshot(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _cases():
    for command, spec in COMMANDS.items():
        for option in spec["outputs"]:
            for what, name in spec["reads"].items():
                message = "is inside the calibration data" if name.startswith("dd/") else "would overwrite"
                yield pytest.param(command, option, "{t}/" + name, message, id=f"{command} {option}={what}")
            for other, target in spec["outputs"].items():
                if other != option:  # two outputs of one run on one path
                    yield pytest.param(command, option, target, "is also", id=f"{command} {option}={other}")
    # -o whose weights file (<out>.data) is the input's external data
    yield pytest.param("quantize", "-o", "{t}/ext/m", "would overwrite the external data", id="quantize -o side file")
    yield pytest.param("fp16", "-o", "{t}/ext/m", "would overwrite the external data", id="fp16 -o side file")
    yield pytest.param(
        "quantize --calib folder", "-o", "{t}/dd/new.npz", "is inside", id="quantize -o into calib folder"
    )


def _args(command, option, target, t):
    spec = COMMANDS[command]
    outputs = {**spec["outputs"], option: target}
    args = list(spec["args"])
    for opt, path in outputs.items():
        args += [opt, path]
    return [a.format(t=t) for a in args]


@pytest.mark.parametrize("command, option, target, message", list(_cases()))
def test_output_on_an_input_is_refused(files, command, option, target, message):
    before = _snapshot(files)
    r = CliRunner().invoke(main, _args(command, option, target, files))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fp8onnx: error: ") and message in lines[0], r.output
    assert _snapshot(files) == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_links_to_an_input_are_refused(files, tmp_path, link):
    target = tmp_path / "alias.onnx"
    (os.symlink if link == "symlink" else os.link)(files / "ext" / "m.data", target)
    before = _snapshot(files)
    r = CliRunner().invoke(main, ["fp16", str(files / "ext" / "m.onnx"), "-o", str(target)])
    assert r.exit_code == 2 and "would overwrite the external data" in r.output, r.output
    assert _snapshot(files) == before


def test_plots_on_an_input_are_refused(files, tmp_path):
    model = tmp_path / "scale_exponents.png"  # a model that happens to carry a plot's name
    model.write_bytes((files / "plain.onnx").read_bytes())
    for args in (
        ["inspect", str(model), "--plot", str(tmp_path)],
        ["study", str(model), "--calib", str(files / "d.npz"), "--data", str(files / "e.npz"), "--plot", str(tmp_path)],
    ):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "would overwrite the input model" in r.output, r.output
    assert model.read_bytes() == (files / "plain.onnx").read_bytes()


def test_the_table_covers_every_command(files):
    assert len(list(_cases())) >= 40
    assert np.all([any(c.values[0] == cmd for c in _cases()) for cmd in COMMANDS])
