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


def test_deploy_compares_fp8_trained_with_post_training_fp8(tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "train-study",
            "--steps",
            "6",
            "--seeds",
            "1",
            "--scales",
            "1",
            "--deploy",
            str(tmp_path / "d"),
            "--json",
            str(tmp_path / "t.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "t.json").read_text())
    deployed = doc["deployed"]
    assert {p.name for p in (tmp_path / "d").glob("*.onnx")} == {"fp32.onnx", "fp32.ptq-fp8.onnx", "fp8-trained.onnx"}
    amax = next(x for x in doc["runs"] if x["label"] == "fp8-amax")
    fp32 = next(x for x in doc["runs"] if x["label"] == "fp32")
    # the deployed graphs compute what was trained: onnxruntime's accuracy is torch's (same held-out windows)
    assert deployed["fp8-trained, deployed"] == pytest.approx(amax["metric"], abs=2e-3)
    assert deployed["fp32"] == pytest.approx(fp32["metric"], abs=1e-3)
    assert deployed["fp32 + post-training fp8"] is not None and "deployed (onnxruntime" in r.output


def test_the_classification_task_trains_deploys_and_scores_on_held_out_sentences(tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "train-study",
            "--task",
            "classify",
            "--steps",
            "4",
            "--seeds",
            "1",
            "--scales",
            "1",
            "--deploy",
            str(tmp_path),
            "--json",
            str(tmp_path / "t.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["metric"] == "topic accuracy" and all(0 <= x["metric"] <= 1 for x in doc["runs"])
    amax = next(x for x in doc["runs"] if x["label"] == "fp8-amax")
    # onnxruntime computes the trained FP8 numbers up to summation order: at most a flip or two of 164
    assert doc["deployed"]["fp8-trained, deployed"] == pytest.approx(amax["metric"], abs=2 / 164 + 1e-9)
    import numpy as np

    held_out = np.load(tmp_path / "eval.npz")
    assert held_out["labels"].ndim == 1 and set(np.unique(held_out["labels"])) <= {0, 1, 2, 3}
