"""`fp8onnx train-study` on the decoder task, a few steps: every run is reported, a constant scale far
below the tensors' range saturates and does not converge where FP8-AMAX does, outputs are written."""

import csv
import io
import json

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from fp8onnx.cli import main


def test_train_study_reports_the_cscale_window_and_writes_its_outputs(tmp_path):
    out = tmp_path / "t.json"
    r = CliRunner().invoke(
        main,
        [
            "train-study",
            "--steps", "12",
            "--seeds", "1",
            "--scales", "0.000244140625,1",  # 2^-12: inputs and weights saturate; 2^0: fits
            "--json", str(out),
            "--csv", str(tmp_path / "t.csv"),
            "--plot", str(tmp_path / "plots"),
        ],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    runs = {(x["label"], x["seed"]): x for x in doc["runs"]}
    assert sorted(label for label, _ in runs) == ["bf16", "fp32", "fp8-amax", "fp8-cscale 2^-12", "fp8-cscale 2^0"]
    assert runs[("fp8-amax", 0)]["converged"] and runs[("fp8-cscale 2^0", 0)]["converged"]
    assert runs[("fp8-cscale 2^-12", 0)]["converged"] is False
    assert len(runs[("fp32", 0)]["losses"]) == 12 and runs[("fp32", 0)]["metric"] > 0
    biases = runs[("fp8-amax", 0)]["biases"]
    assert set(biases) == {"first", "middle", "last"} and len(biases["last"]["grad"]) == 4 * 7 + 1  # every Linear
    assert "CSCALE convergence" in r.output and "2^-12 0/1" in r.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "t.csv").read_text())))
    assert len(rows) == 5
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "cscale_window.png",
        "loss_curves.png",
        "scale_biases.png",
    ]


def test_bad_scales_are_refused():
    r = CliRunner().invoke(main, ["train-study", "--steps", "2", "--scales", "0.3"])
    assert r.exit_code == 2 and "powers of two" in r.output
