"""Quantize to a stated accuracy: the fewest, most sensitive nodes stay in float until the target holds.

The toy chain's output is a linear head's [n, 8], which compare judges by top-1 agreement (a classifier);
these tests of the search itself state the metric they were written for: mean cosine."""

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from test_sensitivity import chain

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.workflows.fallback import TargetNotMet, quantize_to_target

from helpers import SAMPLE, mlp_model


@pytest.fixture
def outlier_chain(tmp_path):
    path, calib = chain(tmp_path / "m.onnx", outlier=True)
    x = np.abs(np.random.default_rng(5).standard_normal((32, 16))).astype(np.float32)
    np.savez(tmp_path / "eval.npz", x=x)
    return path, calib, tmp_path / "eval.npz"


def test_the_sensitive_node_is_kept_and_the_target_holds(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    result = quantize_to_target(path, out, calib, eval_data, metric="cosine", accuracy_target=99.9, provider="cpu")
    assert result.met and result.kept_in_float == ["second"]
    assert result.tried[0] < 0.999 <= result.tried[1]
    assert [n.name for n in result.report.quantized] == ["first"]
    reason = {n.name: n.reason for n in result.report.skipped}["second"]
    assert reason.startswith("kept in float for --accuracy-target")
    producers = {o: n.op_type for n in onnx.load(out).graph.node for o in n.output}
    second = next(n for n in onnx.load(out).graph.node if n.name == "second")
    assert producers[second.input[0]] != "DequantizeLinear"  # really left in float
    check = fp8onnx.compare(path, [out], eval_data, metric="cosine", provider="cpu")
    assert check.rows[-1].ratio_to_fp16 >= 0.999


def test_an_unreachable_target_writes_nothing_and_names_the_best(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    with pytest.raises(TargetNotMet, match=r"not met .* the best was \d+\.\d\d% of FP16 with 0 in float") as caught:
        quantize_to_target(
            path,
            out,
            calib,
            eval_data,
            metric="cosine",
            accuracy_target=99.9,
            max_float_nodes=0,
            report=tmp_path / "r.json",
        )
    result = caught.value.result
    assert not result.met and list(result.tried) == [0] and result.report is None
    assert result.tried[0] < 0.999 and "NOT met (nothing written)" in result.summary()
    assert not out.exists() and not (tmp_path / "r.json").exists()


def test_cli_unreachable_target_exits_2_with_the_best_metric(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    args = [
        "quantize",
        str(path),
        "--calib",
        str(calib),
        "--eval",
        str(eval_data),
        "-o",
        str(out),
        "--metric",
        "cosine",
    ]
    r = CliRunner().invoke(main, [*args, "--accuracy-target", "99.9", "--max-float-nodes", "0"])
    assert r.exit_code == 2 and "the best was" in r.output and "nothing written" in r.output, r.output
    last = r.output.strip().splitlines()[-1]  # after the progress bars: one sentence
    assert last.startswith("fp8onnx: error: Accuracy target 99.9% of FP16") and not out.exists()
    ok = CliRunner().invoke(main, [*args, "--accuracy-target", "99.9"])
    assert ok.exit_code == 0 and "accuracy target 99.9% of FP16" in ok.output and out.exists(), ok.output


def test_the_search_is_deterministic(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    first = quantize_to_target(
        path, tmp_path / "a.onnx", calib, eval_data, metric="cosine", accuracy_target=99.9, provider="cpu"
    )
    second = quantize_to_target(
        path, tmp_path / "b.onnx", calib, eval_data, metric="cosine", accuracy_target=99.9, provider="cpu"
    )
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert first.tried == second.tried and first.kept_in_float == second.kept_in_float


def test_refinement_orders_by_measured_gain_and_reuses_its_scores(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    result = quantize_to_target(
        path, tmp_path / "q.onnx", calib, eval_data, metric="cosine", accuracy_target=99.9, refine=2, provider="cpu"
    )
    assert result.met and result.kept_in_float == ["second"]
    # all-FP8 plus one model per refined node; counts 0 and 1 come from those, nothing else is scored
    assert result.evaluations == 3 and sorted(result.tried) == [0, 1]
    gains = {n["name"]: n["metric_gain"] for n in result.sensitivity}
    assert gains["second"] > gains["first"]


@pytest.mark.parametrize("target", [0.0, 100.5])
def test_target_is_a_percentage(tmp_path, outlier_chain, target):
    path, calib, eval_data = outlier_chain
    with pytest.raises(Fp8OnnxError, match="must be a percentage in"):
        quantize_to_target(path, tmp_path / "q.onnx", calib, eval_data, metric="cosine", accuracy_target=target)


def test_the_report_says_how_the_target_was_met(tmp_path, outlier_chain):
    import json

    path, calib, eval_data = outlier_chain
    quantize_to_target(
        path, tmp_path / "q.onnx", calib, eval_data, metric="cosine", accuracy_target=99.9, report=tmp_path / "r.json"
    )
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["accuracy_target"]["kept_in_float"] == ["second"] and doc["accuracy_target"]["met"] is True
    assert [n["name"] for n in doc["sensitivity"]] == ["first", "second"]
    assert doc["sensitivity"][1]["rank"] == 1 and doc["nodes"][0]["name"] == "first"


def test_later_rounds_reuse_the_fp16_baseline_and_match_a_fresh_compare(tmp_path, outlier_chain, monkeypatch):
    """FP16 runs in the first round only, the FP32 reference once for all rounds (its outputs kept)."""
    import sys

    from fp8onnx.graph.run_settings import RunOptions
    from fp8onnx.settings.config import QuantizeConfig
    from fp8onnx.workflows.candidates import Candidates

    path, calib, eval_data = outlier_chain
    stats = fp8onnx.calibrate(path, calib, provider="cpu")
    config = QuantizeConfig()
    evaluation = sys.modules["fp8onnx.accuracy.evaluation"]  # where compare builds the sessions it evaluates
    built = []
    real = evaluation.make_session
    monkeypatch.setattr(evaluation, "make_session", lambda *a, **k: built.append(a[2]) or real(*a, **k))
    with Candidates(path, config, stats, eval_data, RunOptions(provider="cpu"), metric="cosine") as candidates:
        (all_fp8,) = candidates.ratios([()])
        (kept,) = candidates.ratios([("second",)])  # the second round: compare without FP16
        assert candidates.ratios([(), ("second",)]) == [all_fp8, kept] and candidates.evaluated == 2
        assert candidates.rounds == 2
    assert sum(what.startswith("Reference model") for what in built) == 1
    fp8onnx.quantize(path, tmp_path / "k.onnx", config=candidates.config_keeping(["second"]), stats=stats)
    fresh = fp8onnx.compare(path, [tmp_path / "k.onnx"], eval_data, metric="cosine", provider="cpu")
    fresh = fresh.rows[-1].ratio_to_fp16
    assert kept == fresh and all_fp8 < 0.999 <= kept


def test_a_count_that_passes_only_by_noise_is_not_chosen():
    """The metric is not monotone in the number of float nodes: 1 passes, 2 and 4 fail. The search
    goes on to 8, narrows down to 5-7, and keeps the smallest count from which every larger one passes."""
    from types import SimpleNamespace

    from fp8onnx.workflows.fallback import search

    ratios = {0: 0.90, 1: 0.999, 2: 0.98, 4: 0.99, 5: 0.992, 6: 0.996, 7: 0.997, 8: 1.0}
    sens = SimpleNamespace(
        base_ratio=None, metric="", order=lambda: [SimpleNamespace(name=f"n{i}", metric_gain=None) for i in range(8)]
    )
    candidates = SimpleNamespace(
        metric="m", ratios=lambda keeps: [ratios[len(k)] for k in keeps], noise=lambda keep: None
    )
    tried, chosen = search(sens, candidates, 99.5, 8)
    assert chosen == 6 and sorted(tried) == [0, 1, 2, 4, 5, 6, 7, 8]
    assert search(sens, candidates, 99.5, 4)[1] is None  # within 4 nothing passes steadily


def _searched(ratios: dict, noise: dict, target: float, limit: int = 8):
    from types import SimpleNamespace

    from fp8onnx.workflows.fallback import search

    sens = SimpleNamespace(
        base_ratio=None, metric="", order=lambda: [SimpleNamespace(name=f"n{i}", metric_gain=None) for i in range(8)]
    )
    candidates = SimpleNamespace(
        metric="m", ratios=lambda keeps: [ratios[len(k)] for k in keeps], noise=lambda keep: noise[len(keep)]
    )
    return search(sens, candidates, target, limit)


def test_no_node_is_kept_in_float_for_a_gap_within_the_noise():
    """98.3% of FP16 with a standard error of 0.7% (24 windows of SmolLM2) cannot be told from 99.5%:
    the all-FP8 model is chosen; the same gap measured ten times more precisely is a real loss."""
    ratios = {0: 0.983, 1: 0.99, 2: 0.993, 3: 0.992, 4: 0.996, 8: 0.999}
    tried, chosen = _searched(ratios, {k: 0.007 for k in ratios}, 99.5)
    assert chosen == 0 and list(tried) == [0]
    tried, chosen = _searched(ratios, {k: 0.0007 for k in ratios}, 99.5)
    assert chosen == 4 and sorted(tried) == [0, 1, 2, 3, 4]
    tried, chosen = _searched(ratios, {k: None for k in ratios}, 99.5)  # no estimate (one sample): strict
    assert chosen == 4


def test_the_unresolved_sentence_says_how_much_data_would_resolve_it():
    from fp8onnx.workflows.target_result import FallbackResult, unresolved

    result = FallbackResult(99.5, "task accuracy", {0: 0.983}, [], True, None, noise={0: 0.007})
    result.samples, result.tokens = 24, 3048
    sentence = unresolved(result, 0)
    assert sentence.startswith("The tuning data cannot resolve the target: 98.30% ±0.70% of FP16")
    # (2 x 0.7 / 1.2)^2 x 24 = 32.7 -> 33 windows of 127 tokens
    assert "no node was kept in float" in sentence and "about 33 samples (about 4,191 tokens) instead of 24" in sentence
    result.tried[0] = 0.996
    assert unresolved(result, 0) == ""  # at or above the target: nothing to resolve


def test_the_search_applies_weight_techniques_to_every_candidate(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    result = quantize_to_target(
        path, out, calib, eval_data, metric="cosine", accuracy_target=99.9, weight_rounding="gptq", provider="cpu"
    )
    assert result.met and result.kept_in_float == ["second"]
    assert any("GPTQ rounding of 1 weights" in p for p in result.report.prepared)
    assert result.report.config["weight_rounding"] == "gptq"


def test_a_target_met_only_with_nearly_every_node_in_float_is_refused_unless_allowed(tmp_path, outlier_chain):
    """2 of 2 nodes in float is not an FP8 model: nothing is written, the sentence says how to allow it."""
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    with pytest.raises(TargetNotMet, match=r"holds only with 2 of 2 nodes in float.*--max-float-nodes 2"):
        quantize_to_target(path, out, calib, eval_data, metric="cosine", accuracy_target=100, provider="cpu")
    assert not out.exists()
    allowed = quantize_to_target(
        path, out, calib, eval_data, metric="cosine", accuracy_target=100, max_float_nodes=2, provider="cpu"
    )
    assert allowed.met and sorted(allowed.kept_in_float) == ["first", "second"] and out.exists()


def test_the_metric_can_be_chosen(tmp_path, outlier_chain):
    path, calib, eval_data = outlier_chain
    result = quantize_to_target(path, tmp_path / "q.onnx", calib, eval_data, accuracy_target=90.0, metric="rel-l2")
    assert result.metric == "1 - relative L2 error to FP32"


def test_a_target_the_data_cannot_resolve_is_said_and_confirmed_on_held_out_samples(tmp_path):
    """The sample decoder's defaults score 99.9% of FP16 with a standard error of about 0.15% on the tuning
    two thirds of eval.npz: 100% cannot be told from that, so no node is kept in float, the summary says how
    many samples would tell, and the written model is scored on the third the choice did not see."""
    out = tmp_path / "q.onnx"
    args = ["quantize", str(SAMPLE / "decoder.onnx"), "--calib", str(SAMPLE / "calib.npz")]
    args += ["--eval", str(SAMPLE / "eval.npz"), "--accuracy-target", "100", "-o", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and out.exists(), r.output
    assert "0 nodes in float: " in r.output and "<- written" in r.output
    assert "The tuning data cannot resolve the target" in r.output and "samples (about" in r.output
    assert "held out (every 3rd sample of the evaluation data, 85 samples, not used to choose)" in r.output


def test_a_target_missed_with_every_node_allowed_says_what_is_left():
    """Under auto the sample decoder keeps float8 embeddings, which no node count puts back in float: when
    every node was allowed, the sentence says so instead of asking for more float nodes."""
    from fp8onnx.workflows.target_result import not_met

    error = not_met(
        100.0, "task accuracy", {0: 0.99, 29: 0.995}, [f"n{i}" for i in range(29)], 29, "e.npz", 3, [], "nodes"
    )
    assert "with up to 29 of 29 nodes in float" in str(error) and "every node was allowed in float" in str(error)
    assert "--max-float-nodes" not in str(error)


def _activation_outlier_chain(tmp_path):
    """x (positive) -> MatMul(a) -> Add(c) -> Relu -> MatMul(b) -> y, where the bias puts channel 0 of the Relu
    at ~1e5x the others: one static E4M3 scale for ``second``'s input leaves the other channels a few
    subnormal steps (its activation's error), while both weights are tame (b's row 0 is zero: that channel
    only sets the scale)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a = (rng.standard_normal((16, 32)) * 0.25).astype(np.float32)
    c = np.zeros(32, np.float32)
    c[0] = 60000.0
    b = (rng.standard_normal((32, 8)) * 0.25).astype(np.float32)
    b[0, :] = 0.0
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "a"], ["h"], name="first"),
            helper.make_node("Add", ["h", "c"], ["hc"], name="bias"),
            helper.make_node("Relu", ["hc"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "b"], ["y"], name="second"),
        ],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(a, "a"), numpy_helper.from_array(c, "c"), numpy_helper.from_array(b, "b")],
    )
    path = tmp_path / "act.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    np.savez(tmp_path / "act_calib.npz", x=np.abs(rng.standard_normal((48, 16))).astype(np.float32))
    np.savez(tmp_path / "act_eval.npz", x=np.abs(rng.standard_normal((32, 16))).astype(np.float32))
    return path, tmp_path / "act_calib.npz", tmp_path / "act_eval.npz"


def test_the_activation_unit_takes_back_the_activation_and_keeps_the_fp8_weight(tmp_path):
    """requires: a node whose error is its activation's; ensures: --fallback activations leaves only that
    activation in float (W8A16: its weight still float8 behind a DequantizeLinear) and the target holds."""
    path, calib, eval_data = _activation_outlier_chain(tmp_path)
    out = tmp_path / "q.onnx"
    opts = dict(metric="cosine", accuracy_target=99.9, provider="cpu")
    result = quantize_to_target(path, out, calib, eval_data, fallback="activations", **opts)
    assert result.met and result.kept_in_float == ["second"] and result.unit == "activations"
    assert result.tried[0] < 0.999 <= result.tried[1]
    summary = result.summary()
    assert "1 with float activations" in summary and "activations kept in float (W8A16)" in summary
    assert sorted(n.name for n in result.report.quantized) == ["first", "second"]
    graph = onnx.load(out).graph
    producers = {o: n.op_type for n in graph.node for o in n.output}
    second = next(n for n in graph.node if n.name == "second")
    assert producers[second.input[0]] != "DequantizeLinear"  # its activation in float
    assert producers[second.input[1]] == "DequantizeLinear"  # its weight float8
    assert result.report.config["fallback"] == "activations"
    check = fp8onnx.compare(path, [out], eval_data, metric="cosine", provider="cpu")
    assert check.rows[-1].ratio_to_fp16 >= 0.999


def test_the_activation_unit_cannot_take_back_a_weights_error(tmp_path, outlier_chain):
    """The weight outlier chain's error is its weight's: activations alone back in float do not meet the
    target (nothing written), whole nodes do."""
    path, calib, eval_data = outlier_chain
    out = tmp_path / "q.onnx"
    with pytest.raises(TargetNotMet, match=r"with float activations|in float"):
        quantize_to_target(
            path, out, calib, eval_data, metric="cosine", accuracy_target=99.9, fallback="activations", provider="cpu"
        )
    assert not out.exists()


def test_cli_fallback_activations_and_the_w8a8_preset_sets_it(tmp_path):
    from fp8onnx.settings.config import QuantizeConfig

    assert QuantizeConfig.for_preset("llm-w8a8").fallback == "activations"
    assert QuantizeConfig(activations="none", fallback="activations").fallback == "nodes"  # nothing else to keep
    path, calib, eval_data = _activation_outlier_chain(tmp_path)
    out = tmp_path / "q.onnx"
    args = ["quantize", str(path), "--calib", str(calib), "--eval", str(eval_data), "--accuracy-target", "99.9"]
    args += ["--metric", "cosine", "--fallback", "activations", "-o", str(out), "--provider", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "activations kept in float (W8A16) (most sensitive first): second" in result.output
    bad = CliRunner().invoke(main, [*args[:-4], "--fallback", "weights", "-o", str(out)])
    assert bad.exit_code == 2 and "weights" in bad.output


def test_a_percentage_as_the_deploy_target_is_one_sentence(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    with pytest.raises(Fp8OnnxError, match=r"target=99.5 names the deploy target .* accuracy_target="):
        quantize_to_target(path, tmp_path / "q.onnx", tmp_path / "c.npz", tmp_path / "e.npz", target=99.5)
    assert not (tmp_path / "q.onnx").exists()
