"""Sensitivity: the SQNR of each node's output with only it in FP8, all nodes in one pass."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.graph.runtime import make_session
from fp8onnx.workflows.fallback import sensitivity

from helpers import SAMPLE, sqnr_db


def chain(path, outlier: bool):
    """x (positive) -> MatMul(a) -> Relu -> MatMul(b) -> y. Column 0 of ``a`` is negative, so channel 0
    of the Relu is always 0; with ``outlier`` the weight of ``b`` that reads it is 1e5: it changes
    nothing in float, but its per-tensor E4M3 scale flushes b's other weights to (near) zero."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((16, 32)) * 0.25).astype(np.float32)
    a[:, 0] = -1.0
    b = (rng.standard_normal((32, 8)) * 0.25).astype(np.float32)
    if outlier:
        b[0, 0] = 1e5
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "a"], ["h"], name="first"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "b"], ["y"], name="second"),
        ],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    np.savez(path.with_suffix(".npz"), x=np.abs(rng.standard_normal((48, 16))).astype(np.float32))
    return path, path.with_suffix(".npz")


def test_one_node_equals_the_quantized_model(tmp_path):
    """With one quantizable node, its sensitivity is exactly the SQNR of the quantized model's output."""
    path = tmp_path / "one.onnx"
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="only")],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    result = sensitivity(path, tmp_path / "d.npz", provider="cpu", batch_size=40)
    fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu", batch_size=40)
    ref = make_session(path, "cpu").run(None, {"x": x})[0]
    got = make_session(tmp_path / "q.onnx", "cpu").run(None, {"x": x})[0]
    (node,) = result.nodes
    assert node.name == "only" and node.rank == 1
    assert node.sqnr_db == pytest.approx(sqnr_db(ref, got), abs=0.01)


def test_the_outlier_node_ranks_first(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=True)
    result = sensitivity(path, data, provider="cpu")
    assert [n.name for n in result.ranked()] == ["second", "first"]
    first, second = (next(n for n in result.nodes if n.name == k) for k in ("first", "second"))
    assert second.sqnr_db < first.sqnr_db - 10
    plain = sensitivity(*chain(tmp_path / "p.onnx", outlier=False), provider="cpu")
    assert all(20 < n.sqnr_db < 40 for n in plain.ranked())  # one E4M3 rounding of input and weight


def test_sample_decoder_every_weight_matmul_measured():
    result = sensitivity(SAMPLE / "decoder.onnx", SAMPLE / "calib.npz", SAMPLE / "eval.npz", provider="cpu")
    assert len(result.ranked()) == 29 and result.samples == 256
    assert sorted(n.rank for n in result.ranked()) == list(range(1, 30))
    assert all(np.isfinite(n.sqnr_db) and n.sqnr_db > 20 for n in result.ranked())
    unmeasured = [n for n in result.nodes if n.rank is None]
    assert len(unmeasured) == 8 and all("both inputs are activations" in n.reason for n in unmeasured)


def test_cli_table_json_and_plot(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=True)
    args = ["sensitivity", str(path), "--calib", str(data), "--json", str(tmp_path / "s.json")]
    r = CliRunner().invoke(main, [*args, "--plot", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "rank  node" in r.output and "   1  second" in r.output
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [n["name"] for n in doc["nodes"]] == ["first", "second"] and doc["samples"] == 48
    assert (tmp_path / "sensitivity.png").stat().st_size > 1000
    bad = CliRunner().invoke(main, ["sensitivity", str(path)])
    assert bad.exit_code == 2 and "need calibration" in bad.output
    same = CliRunner().invoke(main, [*args[:4], "--json", str(data)])
    assert same.exit_code == 2 and "would overwrite the calibration data" in same.output


def test_dynamic_activations_need_no_calibration_but_data(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=False)
    result = sensitivity(path, data=data, activations="dynamic", provider="cpu")
    assert len(result.ranked()) == 2
    with pytest.raises(Fp8OnnxError, match="needs data to run on"):
        sensitivity(path, activations="dynamic", provider="cpu")


def deep_chain(path, outliers=(0, 3e4, 1e6, 1e4)):
    """x (positive) -> 4 x [MatMul -> Relu] (the last without Relu). Column 0 of every weight is
    negative, so channel 0 after each Relu is always 0; the next weight's entry reading it is set to
    ``outliers[k]``: no effect in float, a per-tensor E4M3 scale that pushes the other weights of
    node k into subnormals (1e4: a little, 1e6: all of them)."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for k, outlier in enumerate(outliers):
        w = (rng.standard_normal((16, 16)) * 0.25).astype(np.float32)
        w[:, 0] = -1.0
        if outlier:
            w[0, 0] = outlier
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{k}"], [f"h{k}"], name=f"mm{k}"))
        prev = f"h{k}"
        if k < len(outliers) - 1:
            nodes.append(helper.make_node("Relu", [prev], [f"r{k}"], name=f"relu{k}"))
            prev = f"r{k}"
    graph = helper.make_graph(
        nodes,
        "deep",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["n", 16])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = np.abs(rng.standard_normal((64, 16))).astype(np.float32)
    np.savez(path.with_suffix(".npz"), x=x)
    return path, path.with_suffix(".npz"), x


def test_the_ranking_agrees_with_leave_one_out(tmp_path):
    """One instrumented pass ranks the nodes as quantizing each alone (4 models) ranks them by the
    SQNR of the model's output."""
    path, data, x = deep_chain(tmp_path / "m.onnx")
    ranked = [n.name for n in sensitivity(path, data, provider="cpu").ranked()]
    ref = make_session(path, "cpu").run(None, {"x": x})[0]
    names = [f"mm{k}" for k in range(4)]
    alone = {}
    for name in names:
        out = tmp_path / f"{name}.onnx"
        fp8onnx.quantize(path, out, data, exclude=[m for m in names if m != name], provider="cpu")
        alone[name] = sqnr_db(ref, make_session(out, "cpu").run(None, {"x": x})[0])
    assert ranked == sorted(names, key=alone.get) == ["mm2", "mm1", "mm3", "mm0"]


def test_refinement_scores_the_top_nodes_on_the_end_metric(tmp_path):
    path, data, _ = deep_chain(tmp_path / "m.onnx")
    np.savez(tmp_path / "eval.npz", x=np.abs(np.random.default_rng(9).standard_normal((32, 16))).astype(np.float32))
    # the chain's output is a linear head's [n, 8] (top-1 agreement by default); this test is about cosine
    result = sensitivity(path, data, eval_data=tmp_path / "eval.npz", refine=2, metric="cosine", provider="cpu")
    assert result.evaluations == 3 and result.metric == "mean cosine to FP32" and result.base_ratio < 0.5
    refined = [n for n in result.nodes if n.metric_gain is not None]
    assert sorted(n.name for n in refined) == ["mm1", "mm2"]  # the two lowest SQNR
    by_name = {n.name: n for n in result.nodes}
    # mm2 alone wrecks the output: leaving mm1 in float gains nothing while mm2 stays in FP8
    assert by_name["mm2"].metric_gain > 0.5 and by_name["mm1"].metric_gain == pytest.approx(0, abs=0.02)
    assert by_name["mm2"].metric_ratio == pytest.approx(result.base_ratio + by_name["mm2"].metric_gain)
    assert [n.name for n in result.order()] == ["mm2", "mm1", "mm3", "mm0"]
    assert "gain if float" in result.table() and "3 models evaluated" in result.table()
    doc = result.to_json()
    assert doc["order"] == ["mm2", "mm1", "mm3", "mm0"] and doc["evaluations"] == 3


def lm(path, vocab=1200, dim=16, tied=True):
    """ids -> Gather(embedding [vocab, dim]) -> MatMul(w) -> MatMul(lm_head [dim, vocab]) -> logits."""
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((vocab, dim)).astype(np.float32)
    head = emb.T.copy() if tied else rng.standard_normal((dim, vocab)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
            helper.make_node("MatMul", ["e", "w"], ["h"], name="block"),
            helper.make_node("MatMul", ["h", "head"], ["logits"], name="lm_head"),
        ],
        "lm",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
        [
            numpy_helper.from_array(emb, "emb"),
            numpy_helper.from_array(rng.standard_normal((dim, dim)).astype(np.float32), "w"),
            numpy_helper.from_array(head, "head"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    np.savez(path.with_suffix(".npz"), ids=rng.integers(0, vocab, (4, 8)))
    return path, path.with_suffix(".npz")


def test_a_vocabulary_projection_is_flagged_high_risk(tmp_path):
    path, data = lm(tmp_path / "lm.onnx")
    result = sensitivity(path, data, provider="cpu")
    risks = {n.name: n.risk for n in result.nodes}
    assert risks["block"] is None and "1200 outputs, the rows of an embedding table" in risks["lm_head"]
    assert "HIGH RISK" in result.table()
    fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")
    for model in (path, tmp_path / "q.onnx"):  # float or already quantized: inspect says so too
        r = CliRunner().invoke(main, ["inspect", str(model)])
        assert r.exit_code == 0 and "HIGH RISK for FP8: lm_head" in r.output, r.output
    fp8onnx.quantize(path, tmp_path / "kept.onnx", data, exclude=("lm_head",), provider="cpu")
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "kept.onnx")])
    assert r.exit_code == 0 and "HIGH RISK" not in r.output, r.output  # already kept in float: no warning
    small, small_data = lm(tmp_path / "small.onnx", vocab=300)  # not vocabulary-sized
    assert all(n.risk is None for n in sensitivity(small, small_data, provider="cpu").nodes)


def test_the_report_has_a_sensitivity_section(tmp_path):
    path, data = chain(tmp_path / "m.onnx", outlier=True)
    fp8onnx.quantize(path, tmp_path / "q.onnx", data, report=tmp_path / "r.json", provider="cpu")
    doc = json.loads((tmp_path / "r.json").read_text())
    measured = sensitivity(path, data, provider="cpu")
    assert [n["name"] for n in doc["sensitivity"]] == ["first", "second"]
    assert [n["sqnr_db"] for n in doc["sensitivity"]] == [n.sqnr_db for n in measured.nodes]
    fp8onnx.quantize(path, tmp_path / "d.onnx", activations="dynamic", report=tmp_path / "d.json", provider="cpu")
    doc = json.loads((tmp_path / "d.json").read_text())
    assert "sensitivity" not in doc and "needs calibration data" in doc["sensitivity_not_measured"]
    # smoothing renames the tensors the statistics are for: the report says why it has no section
    fp8onnx.quantize(path, tmp_path / "s.onnx", data, smooth=0.5, report=tmp_path / "s.json", provider="cpu")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert "sensitivity" not in doc and "not --smooth" in doc["sensitivity_not_measured"]


def test_float_vocab_leaves_the_vocabulary_projection_in_float(tmp_path):
    path, data = lm(tmp_path / "lm.onnx")
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, float_vocab=True, provider="cpu")
    assert [n.name for n in report.quantized] == ["block"]
    assert "vocabulary projection (1200 outputs" in {n.name: n.reason for n in report.skipped}["lm_head"]
    r = CliRunner().invoke(
        main, ["quantize", str(path), "--calib", str(data), "--float-vocab", "-o", str(tmp_path / "c.onnx")]
    )
    assert r.exit_code == 0 and "quantized 1 of 2 MatMul" in r.output, r.output
