"""Phase timings: quantize books every phase once, sub-phases under their lap; -v prints the table."""

import json

import numpy as np
from click.testing import CliRunner

import fp8onnx
from fp8onnx.base.phases import lap, phase, process_age, recording, table
from fp8onnx.cli import main

from helpers import mlp_data, mlp_model


def test_laps_and_sub_phases_add_up_in_order():
    with recording() as phases:
        lap("first")
        with phase("inner"):
            pass
        with phase("inner"):  # booked twice: one row, times added
            pass
        lap("second")
    rows = phases.to_json()
    # a sub-phase belongs to the lap in progress: the one booked next ("second")
    assert [(r["phase"], r["depth"]) for r in rows] == [("first", 0), ("second", 0), ("inner", 1)]
    assert all(r["seconds"] >= 0 for r in rows)
    text = table(rows, startup=1.5)
    assert text.splitlines()[1].strip().startswith("startup (interpreter and imports)")
    assert "    inner" in text and text.splitlines()[-1].split()[0] == "total"
    lap("outside")  # outside a recording: nothing happens
    with phase("outside"):
        pass
    assert 0 <= process_age() < 3600


def test_quantize_reports_its_phases(tmp_path):
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "c.npz")
    report = fp8onnx.quantize(model, tmp_path / "q.onnx", data, report=tmp_path / "r.json", provider="cpu")
    names = [(r["phase"], r["depth"]) for r in report.phases]
    laps = [n for n, d in names if d == 0]
    assert laps == ["load and prepare", "plan", "calibrate", "scales", "rewrite", "check and write", "report"]
    assert ("run the calibration batches", 1) in names and (
        "onnxruntime load check and write, side by side",
        1,
    ) in names
    peaks = [r["peak_rss_mib"] for r in report.phases if r["depth"] == 0]  # laps end in order
    assert peaks == sorted(peaks) and peaks[0] > 10  # the peak so far never decreases
    in_file = json.loads((tmp_path / "r.json").read_text())["phases"]
    assert [r["phase"] for r in in_file] == [n for n, _ in names][: len(in_file)]  # all but the report lap


def test_verbose_cli_prints_the_phase_table(tmp_path):
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "c.npz")
    args = ["quantize", str(model), "--calib", str(data), "-o", str(tmp_path / "q.onnx")]
    quiet = CliRunner().invoke(main, args)
    loud = CliRunner().invoke(main, ["-v", *args])
    assert quiet.exit_code == 0 and loud.exit_code == 0, loud.output
    assert "run the calibration batches" not in quiet.output
    assert "run the calibration batches" in loud.output and "startup (interpreter and imports)" in loud.output
    assert np.isfinite(float(loud.output.split("check and write")[1].split()[0]))
