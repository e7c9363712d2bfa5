import csv
import io
import itertools
import json

import pytest
from click.testing import CliRunner

from fp8onnx.cli import main
from fp8onnx.experiments.study import constant_sweep, study, study_configs, technique_configs, write_plots

from helpers import mlp_data, mlp_model

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")


def test_constant_sweep_spans_the_calibrated_range():
    sweep = constant_sweep([0.5, 100.0])
    assert sweep[0] <= 0.5 / 448 / 2 and sweep[-1] >= 100.0 / 448 * 2**8
    assert all(b / a == 4 for a, b in itertools.pairwise(sweep))
    assert constant_sweep([0.0, float("nan")]) == [1.0]


def test_configs_cover_the_papers_grid():
    groups = {}
    for label, group, _ in study_configs([2.0**-4, 2.0**-2]):
        groups.setdefault(group, []).append(label)
    assert groups["format"] == ["e4m3fn amax", "e5m2 amax", "e3m4 amax", "int8 amax", "int8 amax per-channel"]
    assert groups["scaling"] == ["e4m3fn pow2", "e4m3fn mx", "e4m3fn percentile", "e4m3fn mse"]
    assert groups["constant"] == ["e4m3fn constant 2^-4", "e4m3fn constant 2^-2"]
    assert groups["activations"] == ["e4m3fn amax dynamic", "e4m3fn dynamic per-token", "e4m3fn weight-only"]
    assert groups["weights"] == ["e4m3fn amax per-channel", "e4m3fn amax + fp8 embeddings"]
    techniques = [label for label, group, _ in technique_configs()]
    assert {"e4m3fn amax + smooth 0.5", "e4m3fn amax + gptq", "e4m3fn weight-only + gptq", "preset llm"} <= set(
        techniques
    ) and all(group == "techniques" for _, group, _ in technique_configs())


def test_study_techniques_rows(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    plain = {r.label for r in study(path, data, data, provider="cpu").rows}
    result = study(path, data, data, techniques=True, provider="cpu")
    rows = {r.label: r for r in result.rows}
    assert set(rows) == plain | {label for label, _, _ in technique_configs()}
    for label, _, _ in technique_configs():
        assert rows[label].value is not None and rows[label].value > 0.9  # measured, not a placeholder
    assert rows["e4m3fn amax + gptq"].value != rows["e4m3fn amax"].value  # its own rounding, measured


def test_study_ranks_every_configuration(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    result = study(path, data, data, metric="cosine", provider="cpu")  # 'y', a linear head's, is top-1 by default
    labels = [r.label for r in result.rows]
    assert len(labels) == len(set(labels)) >= 8 + 5
    values = [r.value for r in result.rows]
    assert values == sorted(values, reverse=True)
    assert result.metric == "mean cosine to FP32"
    by_label = {r.label: r for r in result.rows}
    assert by_label["e3m4 amax"].emulated and not by_label["e4m3fn amax"].emulated
    assert by_label["e4m3fn amax"].value > 0.99
    fallback = [r for r in result.rows if r.group == "fallback"]  # searched on half the data
    assert sorted(r.label.split(" (")[0] for r in fallback) == [
        "e4m3fn amax fallback 99%",
        "e4m3fn amax fallback 99.5%",
    ]
    assert all(r.ratio_to_fp16 >= 0.99 for r in fallback)
    # far too small a constant scale saturates everything: the paper's window has edges
    smallest = min((r for r in result.rows if r.group == "constant"), key=lambda r: r.config["scale"])
    assert smallest.value < by_label["e4m3fn amax"].value
    assert result.scale_exponents["weights"] and result.scale_exponents["activations"]
    written = write_plots(result, tmp_path)
    assert [p.name for p in written] == ["constant_scale_window.png", "scale_exponents.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_study_cli_writes_json_and_csv(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    r = CliRunner().invoke(
        main,
        [
            "study",
            str(path),
            "--calib",
            str(data),
            "--data",
            str(data),
            "--provider",
            "cpu",
            "--json",
            str(tmp_path / "s.json"),
            "--csv",
            str(tmp_path / "s.csv"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "best deployable: " in r.output and "(emulated)" in r.output
    assert "evaluated on 64 (cpu)" in r.output  # the provider every number was measured on
    doc = json.loads((tmp_path / "s.json").read_text())
    rows = list(csv.DictReader(io.StringIO((tmp_path / "s.csv").read_text())))
    assert [row["label"] for row in rows] == [row["label"] for row in doc["rows"]]
    plots = str(tmp_path / "missing" / "plots")
    r = CliRunner().invoke(main, ["study", str(path), "--calib", str(data), "--data", str(data), "--plot", plots])
    assert r.exit_code == 2 and "Plot folder" in r.output and "its parent" in r.output  # a missing folder is made


def test_byte_identical_configurations_are_evaluated_once(tmp_path, monkeypatch):
    import sys

    study_module = sys.modules["fp8onnx.experiments.study"]

    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    evaluated = []
    real = study_module.compare

    def spy(model, candidates, *args, **kwargs):
        evaluated.extend(candidates)
        return real(model, candidates, *args, **kwargs)

    monkeypatch.setattr(study_module, "compare", spy)
    result = study(path, data, data, provider="cpu")
    by_label = {r.label: r for r in result.rows}
    zero_float = [r for r in result.rows if r.group == "fallback" and "(0 float)" in r.label]
    assert len(evaluated) < len(result.rows)
    for row in zero_float:  # the fallback with no node in float is the amax model itself
        assert row.value == by_label["e4m3fn amax"].value and row.cosine_mean == by_label["e4m3fn amax"].cosine_mean
