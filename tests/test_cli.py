import json
import pathlib

import click
import numpy as np
import pytest
from click.testing import CliRunner

import fp8onnx
from fp8onnx.cli import main

from helpers import mlp_data, mlp_model

COMMANDS = ["quantize", "calibrate", "compare", "inspect", "fp16", "demo", "study", "sensitivity"]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_help_shows_examples():
    result = run("--help")
    assert result.exit_code == 0 and "fp8onnx quantize model.onnx --calib calib.npz" in result.output
    for cmd in COMMANDS:
        result = run(cmd, "--help")
        assert result.exit_code == 0, cmd
        assert "Example" in result.output and f"fp8onnx {cmd}" in result.output, cmd


def test_quantize_compare_inspect_fp16_calibrate(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    r = run(
        "quantize",
        path,
        "--calib",
        data,
        "-o",
        tmp_path / "q.onnx",
        "--report",
        tmp_path / "r.json",
        "--provider",
        "cpu",
        "--check",
        data,
    )
    assert r.exit_code == 0, r.output
    assert "quantized 2 of 3 MatMul/Gemm nodes to e4m3fn, amax scaling" in r.output
    assert "upgraded opset 17 -> 21" in r.output and "q.onnx" in r.output and "FP16" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["output"].endswith("q.onnx")
    r = run("calibrate", path, "--calib", data, "-o", tmp_path / "s.json", "--provider", "cpu")
    assert r.exit_code == 0 and "4 tensors calibrated on 64 samples" in r.output
    r = run("quantize", path, "--stats", tmp_path / "s.json", "-o", tmp_path / "q2.onnx", "--scaling", "pow2")
    assert r.exit_code == 0, r.output
    r = run("compare", path, tmp_path / "q.onnx", tmp_path / "q2.onnx", "--data", data, "--json", tmp_path / "c.json")
    assert r.exit_code == 0 and "q2.onnx" in r.output
    assert len(json.loads((tmp_path / "c.json").read_text())["rows"]) == 4
    r = run("inspect", tmp_path / "q.onnx")
    assert r.exit_code == 0 and "2 of 3 MatMul/Gemm nodes read float8 inputs" in r.output
    assert json.loads(run("inspect", tmp_path / "q.onnx", "--json").output)["quantized_nodes"] == 2
    r = run("inspect", tmp_path / "q.onnx", "--plot", tmp_path)
    assert r.exit_code == 0 and (tmp_path / "scale_exponents.png").read_bytes()[:4] == b"\x89PNG"
    r = run("fp16", path, "-o", tmp_path / "h.onnx")
    assert r.exit_code == 0 and (tmp_path / "h.onnx").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["quantize", "{m}", "-o", "{t}/q.onnx"], "Activation scales need calibration"),
        (["quantize", "{t}/none.onnx", "--calib", "{d}", "-o", "{t}/q.onnx"], "none.onnx' does not exist"),
        (["quantize", "{m}", "--calib", "{d}", "-o", "{m}"], "would overwrite the input model"),
        (["quantize", "{m}", "--calib", "{t}/none.npz", "-o", "{t}/q.onnx"], "none.npz' does not exist"),
        (["quantize", "{m}", "--calib", "{d}", "--stats", "{d}", "-o", "{t}/q.onnx"], "either --calib or --stats"),
        (["quantize", "{m}", "--scaling", "constant", "--scale", "0", "-o", "{t}/q.onnx"], "positive finite --scale"),
        (["quantize", "{m}", "--calib", "{d}", "--op-types", "LSTM", "-o", "{t}/q.onnx"], "Unsupported op type 'LSTM'"),
        (["compare", "{m}", "{t}/none.onnx", "--data", "{d}"], "none.onnx' does not exist"),
        (["calibrate", "{m}", "--calib", "{t}/bad.npz", "-o", "{t}/s.json"], "has no array for input 'x'"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(tmp_path, args, message):
    m, d = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    np.savez(tmp_path / "bad.npz", y=np.zeros((2, 16), np.float32))
    r = run(*[a.format(m=m, d=d, t=tmp_path) for a in args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.startswith("fp8onnx: error:")]
    assert len(lines) == 1 and message in lines[0], r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "q.onnx").exists()


def test_usage_errors_exit_2(tmp_path):
    assert run("quantize").exit_code == 2
    assert run("quantize", "m.onnx", "-o", "x.onnx", "--format", "e3m5").exit_code == 2


def test_demo_runs_and_meets_the_criterion():
    r = run("demo", "--provider", "cpu")
    assert r.exit_code == 0, r.output
    assert "within the 99.5% criterion" in r.output and "NOT within" not in r.output


def test_quantize_scaling_options(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    r = run(
        "quantize", path, "-o", tmp_path / "a.onnx", "--activations", "dynamic", "--per-channel", "--provider", "cpu"
    )
    assert r.exit_code == 0, r.output
    assert "dynamic activations, per-channel weights" in r.output
    r = run(
        "quantize",
        path,
        "-o",
        tmp_path / "b.onnx",
        "--calib",
        data,
        "--weight-format",
        "e4m3fn",
        "--activation-format",
        "e5m2",
        "--scaling",
        "percentile",
        "--percentile",
        "99.9",
        "--provider",
        "cpu",
    )
    assert r.exit_code == 0, r.output
    assert "e4m3fn weights / e5m2 activations, percentile 99.9 scaling" in r.output
    r = run("quantize", path, "-o", tmp_path / "c.onnx", "--calib", data, "--format", "e3m4", "--provider", "cpu")
    assert r.exit_code == 0 and "SIMULATION" in r.output
    r = run("quantize", path, "-o", tmp_path / "d.onnx", "--calib", data, "--activations", "dynamic")
    assert r.exit_code == 2 and "needs no calibration" in r.output


def _mismatched_value_info(path):
    """Runs in onnxruntime, but ONNX's strict shape inference refuses it (declared [b, 9], inferred [b, 8])."""
    import onnx
    from onnx import helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="r")],
        "g",
        [helper.make_tensor_value_info("x", 1, ["b", 16])],
        [helper.make_tensor_value_info("y", 1, ["b", 8])],
        [numpy_helper.from_array(np.ones((16, 8), np.float32), "w")],
        value_info=[helper.make_tensor_value_info("h", 1, ["b", 9])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_third_party_warnings_are_one_line_and_only_with_v(tmp_path, monkeypatch):
    """onnx_ir logs a warning with a whole traceback when ONNX shape inference fails (as strict
    inference did on this model): from the CLI it is one line, and only with -v."""
    import logging

    import onnx_ir.passes.common as common

    real = common.ShapeInferencePass.call

    def call(self, model):
        try:
            raise ValueError("inferred shape and existing shape differ\nsecond line")
        except ValueError as exc:
            logging.getLogger("onnx_ir.passes.common.shape_inference").warning("Shape inference failed", exc_info=exc)
        return real(self, model)

    monkeypatch.setattr(common.ShapeInferencePass, "call", call)
    path, data = _mismatched_value_info(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    quiet = run("quantize", path, "--calib", data, "-o", tmp_path / "q.onnx")
    assert quiet.exit_code == 0 and "Traceback" not in quiet.output and "onnx_ir" not in quiet.output, quiet.output
    loud = run("-v", "quantize", path, "--calib", data, "-o", tmp_path / "q2.onnx")
    assert loud.exit_code == 0 and "Traceback" not in loud.output and "second line" not in loud.output, loud.output
    assert "WARNING onnx_ir.passes.common.shape_inference: Shape inference failed" in loud.output, loud.output


def test_plain_npy_calibrates_a_one_input_model(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32))
    r = run("quantize", path, "--calib", tmp_path / "x.npy", "-o", tmp_path / "q.onnx")
    assert r.exit_code == 0 and "calibrated on 16 samples" in r.output, r.output


def test_lossless_integer_data_is_cast_with_a_note(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.arange(16 * 16, dtype=np.int64).reshape(16, 16) - 100)
    r = run("quantize", path, "--calib", tmp_path / "d.npz", "-o", tmp_path / "q.onnx")
    assert r.exit_code == 0, r.output
    assert "cast int64 to float32 (every value is exact)" in r.output, r.output


def test_a_plot_folder_is_made_when_its_parent_exists(tmp_path):
    model = tmp_path / "q.onnx"
    fp8onnx.quantize(mlp_model(tmp_path / "m.onnx"), model, mlp_data(tmp_path / "d.npz"), provider="cpu")
    r = CliRunner().invoke(main, ["inspect", str(model), "--plot", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "plots" / "scale_exponents.png").is_file()
    r = CliRunner().invoke(main, ["inspect", str(model), "--plot", str(tmp_path / "no" / "plots")])
    assert r.exit_code == 2 and "its parent" in r.output and "does not exist" in r.output, r.output
    assert not (tmp_path / "no").exists()


def test_quantize_help_leads_with_the_common_jobs_and_groups_its_options():
    out = CliRunner().invoke(main, ["quantize", "--help"]).output
    sections = ["Model, data and output:", "Accuracy:", "Recipe", "Deployment target:", "Running:"]
    positions = [out.index(s) for s in sections]
    assert positions == sorted(positions)
    assert out.index("What most users need:") < out.index("Examples of the other options:") < positions[0]
    assert out.index("--calib") < out.index("Accuracy:") < out.index("--smooth")  # the common ones first


def test_recipe_options_are_the_config_fields_declared_once():
    """requires: quantize's click options; ensures: every QuantizeConfig field a user sets has exactly one
    option of quantize (by the field's name, or its spelling in ``_PARAM``), and sensitivity's recipe
    options are a subset: the command builds its config from the fields, not from a re-spelled list."""
    import dataclasses

    from fp8onnx.cli.common import _PARAM
    from fp8onnx.cli.options import NOT_OPTIONS
    from fp8onnx.settings.config import QuantizeConfig

    fields = {_PARAM.get(f.name, f.name) for f in dataclasses.fields(QuantizeConfig)} - NOT_OPTIONS
    quantize = {p.name for p in main.commands["quantize"].params}
    assert fields <= quantize, fields - quantize
    sensitivity = {p.name for p in main.commands["sensitivity"].params}
    assert {"fmt", "scaling", "activations", "weight_block_size"} <= fields & sensitivity


def test_every_option_is_documented():
    """Options are declared once, in the commands; the docs are checked against them: every option of
    every command appears in README.md or docs/*.md."""
    root = pathlib.Path(__file__).resolve().parents[1]
    docs = (root / "README.md").read_text() + "".join(p.read_text() for p in (root / "docs").glob("*.md"))
    missing = [
        f"{name} {param.opts[0]}"
        for name, command in main.commands.items()
        for param in command.params
        if isinstance(param, click.Option)
        and not any(o in docs for o in param.opts + param.secondary_opts if o.startswith("--"))
        and not any(f"{o} " in docs for o in param.opts if not o.startswith("--"))
    ]
    assert missing == [], f"undocumented options: {missing}"
