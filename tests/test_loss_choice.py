"""--w8a8-share: which GEMMs keep float activations, chosen by each one's measured share of the output loss.

The toy chain's second MatMul reads an activation with one huge channel (static E4M3 leaves the others a
few subnormal steps): FP8 on it costs the output far more than on the first, whatever the nodes are
called. The gate pass's numbers are checked against models quantized one node at a time."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from test_fallback import _activation_outlier_chain

import fp8onnx
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.passes import GATE_PREFIX, GateInputsPass, InsertQDQPass, TensorQuant
from fp8onnx.workflows.loss_choice import _by_loss

from helpers import run_ort


def test_the_node_whose_fp8_activation_costs_the_loss_stays_w8a16(tmp_path):
    path, calib, _ = _activation_outlier_chain(tmp_path)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", calib, activations="static", w8a8_share=0.1, provider="cpu")
    assert report.w8a16["nodes"] == ["second"] and report.w8a16["how"].startswith("by measured loss")
    assert report.w8a16["losses"]["second"] > 10 * max(report.w8a16["losses"]["first"], 0)
    line = next(p for p in report.prepared if p.startswith("W8A16 by measured loss (KL of the output distribution"))
    assert "1 nodes keep float activations" in line and "MACs W8A8" in line
    producers = {o: n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node for o in n.output}
    nodes = {n.name: n for n in onnx.load(tmp_path / "q.onnx").graph.node}
    assert producers[nodes["first"].input[0]] == "DequantizeLinear"  # W8A8
    assert producers[nodes["second"].input[0]] != "DequantizeLinear"  # W8A16: the float activation
    # the same model with its nodes renamed gets the same choice (no names involved)
    model = onnx.load(path)
    for i, node in enumerate(model.graph.node):
        node.name = f"node_linear_{i}"
    onnx.save(model, tmp_path / "renamed.onnx")
    renamed = fp8onnx.quantize(
        tmp_path / "renamed.onnx", tmp_path / "r.onnx", calib, activations="static", w8a8_share=0.1, provider="cpu"
    )
    second = next(n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] == "b")
    assert renamed.w8a16["nodes"] == [second]


def test_the_loss_is_measured_on_enough_rows(tmp_path):
    """One output row per sample (an encoder's pooled output): every calibration sample up to 64, not the
    first 4; an LLM's windows of 128 positions: 4 windows (512 rows)."""
    path, _, _ = _activation_outlier_chain(tmp_path)
    x = np.abs(np.random.default_rng(3).standard_normal((80, 16))).astype(np.float32)
    for n, measured in ((48, 48), (80, 64)):
        np.savez(tmp_path / f"c{n}.npz", x=x[:n])
        report = fp8onnx.quantize(
            path, tmp_path / "q.onnx", tmp_path / f"c{n}.npz", activations="static", w8a8_share=0.1, provider="cpu"
        )
        assert f"to FP32 on {measured} calibration samples" in report.w8a16["how"]


def test_without_data_to_measure_on_the_names_are_the_fallback(tmp_path):
    path, calib, _ = _activation_outlier_chain(tmp_path)
    stats = fp8onnx.calibrate(path, calib, provider="cpu")
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", stats=stats, activations="static", w8a8_share=0.5)
    assert report.w8a16["how"].startswith("by names (the fallback: no calibration data")
    assert report.w8a16["nodes"] == []  # no attention projection and no layer index among these names


def test_the_budget_takes_the_cheapest_per_mac_first():
    losses = {"a": 0.5, "b": 0.1, "c": 2.0, "d": -0.01}
    macs = {"a": 100, "b": 100, "c": 100, "d": 10, "w": 50}  # w: a node without an activation to choose
    # per MAC: d (free), b, a, c; w8a8 starts at w's 50 of 360 MACs
    assert _by_loss(losses, macs, ["a", "b", "c", "d"], 0.3) == ["a", "c"]  # d, b: 160 of 360
    assert _by_loss(losses, macs, ["a", "b", "c", "d"], 0.5) == ["c"]  # d, b, a: 260 of 360
    assert _by_loss(losses, macs, ["a", "b", "c", "d"], 0.9) == []  # 0.9 needs all


def test_a_gate_at_one_is_the_quantized_input_and_at_zero_the_float_one(tmp_path):
    path, calib, _ = _activation_outlier_chain(tmp_path)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(onnx.load(path)))
    second = next(n for n in model.graph if n.name == "second")
    x = second.inputs[0]
    scale = float(np.abs(np.load(calib)["x"]).max()) / 448
    InsertQDQPass([(second, 0)], {x.name: TensorQuant(Fp8Format.E4M3FN, scale * 1e3)})(model)
    quantized_model = ir.to_proto(model)
    GateInputsPass([("second", 0, x)])(model)
    assert [v.name for v in model.graph.inputs if v.name.startswith(GATE_PREFIX)] == [f"{GATE_PREFIX}0"]
    assert not GateInputsPass([("second", 0, x)])(model).modified  # idempotent
    onnx.save(ir.to_proto(model), tmp_path / "gated.onnx")
    onnx.save(quantized_model, tmp_path / "quantized.onnx")
    feed = {"x": np.load(calib)["x"][:4]}
    closed = run_ort(tmp_path / "gated.onnx", {**feed, f"{GATE_PREFIX}0": np.array(0, np.float32)})[0]
    opened = run_ort(tmp_path / "gated.onnx", {**feed, f"{GATE_PREFIX}0": np.array(1, np.float32)})[0]
    # onnxruntime's float arithmetic: x + (q - x) differs from q by its rounding (SPEC §11), so a tolerance
    np.testing.assert_allclose(closed, run_ort(path, feed)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opened, run_ort(tmp_path / "quantized.onnx", feed)[0], rtol=1e-4, atol=1e-4)
    assert np.abs(opened - closed).max() > 1e-3  # the gate matters


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_a_share_outside_zero_to_one_is_one_sentence(share):
    from fp8onnx.base.errors import Fp8OnnxError
    from fp8onnx.settings.config import QuantizeConfig

    with pytest.raises(Fp8OnnxError, match=r"--w8a8-share must be a fraction in \(0, 1\]"):
        QuantizeConfig(w8a8_share=share)
    assert RunOptions  # the module's imports stay used


def test_a_larger_recorded_batch_gives_only_its_first_samples():
    """An export folder's recorded feeds hold 16 prompts a file: the loss takes the first 4 of them (every
    array whose first axis is the batch's, an empty KV cache too), not all 16 at 4x the time."""
    from fp8onnx.data.feeds import Batch
    from fp8onnx.workflows.loss_choice import _first

    feed = {
        "input_ids": np.arange(16 * 5).reshape(16, 5),
        "past_key_values.0.key": np.zeros((16, 2, 0, 8), np.float32),
        "shared": np.ones(3, np.float32),  # no batch axis: as it is
    }
    head = _first(Batch(feed, np.arange(16 * 5).reshape(16, 5)), 4)
    assert head.size == 4 and head.feed["past_key_values.0.key"].shape == (4, 2, 0, 8)
    assert head.feed["shared"].shape == (3,) and head.labels.shape == (4, 5)
    np.testing.assert_array_equal(head.feed["input_ids"], feed["input_ids"][:4])
    small = Batch({"input_ids": feed["input_ids"][:2]})
    assert _first(small, 4) is small


def test_a_folders_manifest_keeps_the_choice(tmp_path):
    """requires: an export folder quantized with --w8a8-share; ensures: its fp8onnx.json says which nodes kept
    float activations, how they were chosen and each one's loss (it kept only counts and sizes)."""
    import json
    import shutil

    from click.testing import CliRunner

    from fp8onnx.cli import main
    from fp8onnx.workflows.exports import MANIFEST

    path, calib, _ = _activation_outlier_chain(tmp_path)
    (tmp_path / "export").mkdir()
    shutil.copy(path, tmp_path / "export" / "model.onnx")
    args = ["quantize", str(tmp_path / "export"), "--calib", str(calib), "-o", str(tmp_path / "out")]
    r = CliRunner().invoke(main, [*args, "--activations", "static", "--w8a8-share", "0.1", "--provider", "cpu"])
    assert r.exit_code == 0, r.output
    kept = json.loads((tmp_path / "out" / MANIFEST).read_text())["models"]["model.onnx"]["w8a16"]
    assert kept["nodes"] == ["second"] and kept["how"].startswith("by measured loss") and "first" in kept["losses"]


def test_feeds_given_as_a_one_shot_iterator_still_measure_the_loss(tmp_path):
    """requires: calibration feeds as a generator (read once), static activations and --w8a8-share without
    GPTQ; ensures: the choice is still made by measured loss on the same node, not refused for want of data
    (the statistics and the choice read the data: it is kept in memory, as for any recipe reading it twice)."""
    path, calib, _ = _activation_outlier_chain(tmp_path)
    x = np.load(calib)["x"]
    feeds = ({"x": x[i : i + 8]} for i in range(0, len(x), 8))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", feeds, activations="static", w8a8_share=0.1, provider="cpu")
    assert report.w8a16["nodes"] == ["second"] and report.w8a16["how"].startswith("by measured loss")


def test_one_models_weights_are_in_onnxruntime_at_a_time(tmp_path, monkeypatch):
    """The float model's session (FP32's outputs) is closed before the gated copy's opens: measuring the loss
    holds one model's weights in onnxruntime, not two (a 1.5B decoder's llm-w8a8 was killed for memory there).

    requires: a model whose choice is measured. ensures: no session of the float model is alive when the
    gated copy's session is made; the choice is the one of the first test."""
    import gc
    import weakref

    from fp8onnx.workflows import loss_choice

    made, alive_at = [], []
    real = loss_choice.session_for_model

    def tracked(model, provider, what, **kw):
        gc.collect()
        alive_at.append((what, [w for w, ref in made if ref() is not None]))
        session = real(model, provider, what, **kw)
        made.append((what, weakref.ref(session)))
        return session

    monkeypatch.setattr(loss_choice, "session_for_model", tracked)
    path, calib, _ = _activation_outlier_chain(tmp_path)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", calib, activations="static", w8a8_share=0.1, provider="cpu")
    assert report.w8a16["nodes"] == ["second"]
    assert alive_at == [("the float model", []), ("the loss-measuring copy", [])]


def test_over_the_weight_budget_the_loss_is_measured_layer_by_layer(tmp_path, monkeypatch):
    """A model whose weights exceed --weight-memory: FP32's outputs and every gate setting run segment by
    segment (one segment's weights at a time), and the losses are the whole graph's.

    requires: the outlier chain, a budget smaller than one weight. ensures: no whole-model session is made
    for the measurement; each node's loss equals the whole-graph measurement's to 1e-5 relative; the same
    choice."""
    from fp8onnx.workflows import loss_choice

    path, calib, _ = _activation_outlier_chain(tmp_path)
    whole = fp8onnx.quantize(path, tmp_path / "w.onnx", calib, activations="static", w8a8_share=0.1, provider="cpu")
    made = []
    real = loss_choice.session_for_model
    monkeypatch.setattr(loss_choice, "session_for_model", lambda *a, **k: made.append(a[2]) or real(*a, **k))
    layered = fp8onnx.quantize(
        path,
        tmp_path / "l.onnx",
        calib,
        activations="static",
        w8a8_share=0.1,
        run=RunOptions(provider="cpu", weight_memory=64),
    )
    assert made == []
    assert layered.w8a16["nodes"] == whole.w8a16["nodes"] == ["second"]
    for name, loss in whole.w8a16["losses"].items():
        assert layered.w8a16["losses"][name] == pytest.approx(loss, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("kl", [True, False])
def test_the_loss_reads_the_rows_in_bounded_slices(kl, monkeypatch):
    """requires: a reference output [samples, rows, width] and a candidate's;
    ensures: the loss is the per-row mean KL (or 1 - cosine) summed over samples, the same number whether
    the rows go in one slice or many (its temporaries of the whole batch set llm-w8a8's peak memory:
    SmolLM2-135M's vocabulary projection segment went from ~480 to 1,071 MiB)."""
    from fp8onnx.workflows import loss_choice

    rng = np.random.default_rng(0)
    ref = (rng.standard_normal((2, 5, 30)) * 3).astype(np.float32)
    out = ref + rng.standard_normal(ref.shape).astype(np.float32)
    r, c = ref.astype(np.float64), out.astype(np.float64)
    if kl:
        log_p = r - np.log(np.exp(r).sum(-1, keepdims=True))
        log_q = c - np.log(np.exp(c).sum(-1, keepdims=True))
        per_row = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    else:
        per_row = 1 - (r * c).sum(-1) / np.linalg.norm(r, axis=-1) / np.linalg.norm(c, axis=-1)
    want = per_row.mean(axis=1).sum()
    whole = loss_choice._Reference(ref, kl).loss(out)
    monkeypatch.setattr(loss_choice, "ROW_CHUNK", 2 * 30)  # one row of each sample a slice
    sliced = loss_choice._Reference(ref, kl).loss(out)
    assert whole == pytest.approx(want, rel=1e-5) and sliced == pytest.approx(whole, rel=1e-12)
