import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.accuracy.metrics import _OutputStats, next_token_labels
from fp8onnx.base.errors import Fp8OnnxError

from helpers import SAMPLE, mlp_data, mlp_model, run_ort


def test_output_stats_metrics():
    s = _OutputStats()
    ref = np.array([[1.0, 0.0], [0.0, 2.0]])
    out = np.array([[1.0, 0.0], [2.0, 0.0]])  # second row orthogonal, argmax flipped
    s.update(ref, out, logits=True)
    d = s.to_json()
    assert d["cosine_mean"] == pytest.approx(0.5) and d["cosine_min"] == pytest.approx(0.0)
    assert d["rel_l2"] == pytest.approx(np.sqrt(8 / 5))
    assert d["max_abs_err"] == 2.0 and d["top1_agreement"] == 0.5


def _classifier(path, w):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc")],
        "clf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 4])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_accuracy_with_labels_and_criteria(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    x = rng.standard_normal((200, 16)).astype(np.float32)
    labels = (x @ w).argmax(-1)
    labels[:20] = (labels[:20] + 1) % 4  # the reference is 90% accurate
    np.savez(tmp_path / "eval.npz", x=x, labels=labels)
    ref = _classifier(tmp_path / "ref.onnx", w)
    noisy = _classifier(tmp_path / "noisy.onnx", w + rng.standard_normal(w.shape).astype(np.float32) * 0.8)
    fp8onnx.quantize(ref, tmp_path / "q.onnx", tmp_path / "eval.npz", provider="cpu")
    result = fp8onnx.compare(ref, [tmp_path / "q.onnx", noisy], tmp_path / "eval.npz", batch_size=64, provider="cpu")
    names = [r.name for r in result.rows]
    assert names == ["FP32 (reference)", "FP16", "q.onnx", "noisy.onnx"]
    assert result.baseline == "FP16" and result.to_json()["baseline"] == "FP16"
    fp32, fp16, q, bad = result.rows
    assert fp16.outputs["logits"]["nonfinite_rows"] == 0
    assert fp32.accuracy == pytest.approx(0.9)
    assert q.headline == "task accuracy" and q.ratio_to_fp16 == pytest.approx(q.accuracy / fp16.accuracy)
    assert q.accuracy > 0.87 and q.passes_llm == (q.ratio_to_fp16 >= 0.995)
    assert q.passes_ptq == (q.rel_loss_vs_fp16 <= 0.01)
    assert bad.accuracy < 0.8 and bad.passes_llm is False and bad.passes_ptq is False
    assert result.samples == 200 and result.batches == 4
    assert "FAIL" in result.table() and "pass" in result.table()
    # the accuracy's noise against FP32's, paired over the 200 samples: for a mean of per-sample differences
    # the jackknife is the textbook standard error, std(d, ddof=1) / sqrt(n)
    ref_hit = run_ort(ref, {"x": x})[0].argmax(-1) == labels
    bad_hit = run_ort(noisy, {"x": x})[0].argmax(-1) == labels
    assert fp32.accuracy_noise is None and (ref_hit != bad_hit).sum() > 10
    d = bad_hit.astype(float) - ref_hit
    assert bad.accuracy_noise == pytest.approx(d.std(ddof=1) / np.sqrt(200), rel=1e-9)
    assert f"{bad.accuracy:.4f} ±{bad.accuracy_noise:.4f}" in result.table() and "jackknife" in result.table()
    # the ratio to FP16 carries its own, paired with FP16's samples
    assert 0 < bad.ratio_noise < 0.2 and f"±{bad.ratio_noise:.2%}" in result.table()
    assert result.to_json()["rows"][3]["noise"]["ratio_to_fp16"] == bad.ratio_noise
    logits = (x @ w).astype(np.float64)  # perplexity: exp of the mean cross-entropy at the labels
    log_softmax = logits - logits.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    assert fp32.perplexity == pytest.approx(np.exp(-log_softmax[np.arange(200), labels].mean()), rel=1e-6)
    assert bad.perplexity > fp32.perplexity and "ppl" in result.table()


def _overflowing_classifier(path, w):
    """(Reshape(x) * 1e-4) @ w with x past float16's 65,504: finite in float32, inf in the FP16 baseline (as
    Gemma 3's residual stream passes 65,504 inside its graph). onnxruntime's CPU EP runs float16 nodes it has
    no float16 kernel for (Mul, MatMul) in float32 and drops the Cast pairs between them, so the overflow
    needs a node it runs in float16 (Reshape; in Gemma's genai folder, the skip-add norms)."""
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["xr"], name="rows"),
            helper.make_node("Mul", ["xr", "small"], ["xs"], name="shrink"),
            helper.make_node("MatMul", ["xs", "w"], ["logits"], name="fc"),
        ],
        "clf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 4])],
        [
            numpy_helper.from_array(np.array([-1, 16], np.int64), "shape"),
            numpy_helper.from_array(np.array(1e-4, np.float32), "small"),
            numpy_helper.from_array(w, "w"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_where_fp16_overflows_the_ratios_are_to_fp32_and_a_note_says_so(tmp_path):
    """requires: a model whose FP16 baseline overflows (Gemma 3's residual stream passes 65,504 in float16:
    its genai folder's FP16 logits are NaN); ensures: the FP16 row counts its non-finite rows, the headline
    ratios (and an accuracy target's) are to FP32's, and the table, the JSON and a note say so."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    x = (rng.standard_normal((200, 16)) * 1e5).astype(np.float32)  # most rows hold a value past 65,504
    ref = _overflowing_classifier(tmp_path / "ref.onnx", w)
    labels = run_ort(ref, {"x": x})[0].argmax(-1)
    labels[:20] = (labels[:20] + 1) % 4  # the reference is 90% accurate
    np.savez(tmp_path / "eval.npz", x=x, labels=labels)
    fp8onnx.quantize(ref, tmp_path / "q.onnx", tmp_path / "eval.npz", provider="cpu")
    result = fp8onnx.compare(ref, [tmp_path / "q.onnx"], tmp_path / "eval.npz", batch_size=64, provider="cpu")
    fp32, fp16, q = result.rows
    assert fp32.accuracy == pytest.approx(0.9)  # the FP8 model runs in float32 between its Q/DQ: finite
    assert fp16.outputs["logits"]["nonfinite_rows"] > 100 and q.outputs["logits"]["nonfinite_rows"] == 0
    assert result.baseline == "FP32 (reference)" and result.to_json()["baseline"] == "FP32 (reference)"
    assert q.ratio_to_fp16 == pytest.approx(q.accuracy / fp32.accuracy) and 0.9 < q.ratio_to_fp16 <= 1.05
    assert q.ratio_noise is not None and q.passes_llm == (q.ratio_to_fp16 >= 0.995)
    note = next(n for n in result.notes if n.startswith("FP16 overflows"))
    assert f"in {fp16.outputs['logits']['nonfinite_rows']} of 200 rows" in note
    assert "relative to the FP32 reference's (FP16 overflows: note)" in result.table()
    # an accuracy target measures against the same baseline instead of refusing "no FP16 baseline"
    done = fp8onnx.quantize_to_target(
        ref, tmp_path / "t.onnx", tmp_path / "eval.npz", tmp_path / "eval.npz", accuracy_target=90, provider="cpu"
    )
    assert done.met and (tmp_path / "t.onnx").is_file() and done.baseline == "FP32"
    summary = done.summary()
    assert "accuracy target 90% of FP32 (FP16 overflows on this model)" in summary
    assert "samples, not used to choose): " in summary and "of FP16" not in summary


def test_without_labels_a_linear_head_is_a_classifier_and_an_embedding_gets_cosine(tmp_path):
    """A 2-D output of a linear head (MatMul/Gemm, bias included) is class scores whatever the family: top-1
    agreement. An output computed after it (a Tanh, a pooling, a normalization) is an embedding: cosine."""
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")
    head = fp8onnx.compare(path, [tmp_path / "q.onnx"], data, provider="cpu").rows[-1]
    assert head.headline == "top-1 agreement with FP32" and head.value == head.outputs["y"]["top1_agreement"]
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
        "embedding",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "e.onnx")
    np.savez(tmp_path / "e.npz", x=rng.standard_normal((32, 16)).astype(np.float32))
    fp8onnx.quantize(tmp_path / "e.onnx", tmp_path / "eq.onnx", tmp_path / "e.npz", provider="cpu")
    q = fp8onnx.compare(tmp_path / "e.onnx", [tmp_path / "eq.onnx"], tmp_path / "e.npz", provider="cpu").rows[-1]
    assert q.headline == "mean cosine to FP32"
    assert 0.99 < q.outputs["y"]["cosine_mean"] <= 1.0
    assert q.outputs["y"]["top1_agreement"] is None  # 'y' does not look like logits


def test_a_decoder_without_labels_is_judged_by_its_next_tokens(tmp_path):
    """A decoder LLM's data needs no labels: each attended position's next token is one (padding and a
    row's last position are not scored), so compare (and the accuracy target) report next-token accuracy
    and perplexity, the same as with those labels written into the data."""
    ids = np.load(SAMPLE / "eval.npz")["input_ids"][:32]
    np.savez(tmp_path / "plain.npz", input_ids=ids)  # the sample decoder takes no attention_mask
    labels = np.full(ids.shape, -1, np.int64)
    labels[:, :-1] = ids[:, 1:]
    model = tmp_path / "d.onnx"
    model.write_bytes((SAMPLE / "decoder.onnx").read_bytes())
    mine = fp8onnx.compare(model, [], tmp_path / "plain.npz", provider="cpu", generate=0, fp16=False)
    assert any("the next token of each position of 'input_ids'" in n for n in mine.notes)
    # the same labels, written into the data (-1: not scored)
    assert next_token_labels(ids, None).tolist() == labels.tolist()
    ref = mine.rows[0]
    assert ref.headline == "task accuracy" and ref.accuracy is not None and ref.perplexity is not None
    logits = run_ort(onnx.load(SAMPLE / "decoder.onnx"), {"input_ids": ids})[0]
    scored = labels >= 0
    expected = ((logits.argmax(-1) == labels) & scored).sum() / scored.sum()
    assert ref.accuracy == pytest.approx(expected, abs=2 / scored.sum())  # a near-tie may flip at most one


def test_next_token_labels_with_a_kv_cache_mask():
    ids = np.array([[5, 6, 7]])
    mask = np.array([[1, 1, 0, 1, 1, 1]])  # 3 past positions (one padded), then the 3 new ones
    assert next_token_labels(ids, mask).tolist() == [[6, 7, -1]]
    assert next_token_labels(ids, np.array([[1, 1, 1, 1, 1, 0]])).tolist() == [[6, -1, -1]]
    assert next_token_labels(ids, None).tolist() == [[6, 7, -1]]


def test_candidate_with_other_outputs_is_refused(tmp_path):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    other = _classifier(tmp_path / "other.onnx", np.ones((16, 4), np.float32))
    with pytest.raises(Fp8OnnxError, match="has outputs \\['logits'\\]; the reference has \\['y', 'gram'\\]"):
        fp8onnx.compare(path, [other], data, provider="cpu")


def test_labels_that_match_no_output(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 16), np.float32), labels=np.zeros((4, 3)))
    with pytest.raises(Fp8OnnxError, match="'labels' of shape \\(4, 3\\) match no output"):
        fp8onnx.compare(path, [], tmp_path / "d.npz", provider="cpu")


@pytest.mark.parametrize("where", ["conversion", "session"])
def test_a_baseline_that_cannot_run_leaves_fp32_only(tmp_path, monkeypatch, where):
    compare_module = sys.modules["fp8onnx.accuracy.compare"]
    if where == "conversion":

        class Broken:
            def __call__(self, model):
                raise RuntimeError("converter cannot handle this graph")

        monkeypatch.setattr(sys.modules["fp8onnx.accuracy.evaluation"], "ConvertFloat16Pass", Broken)
    else:

        def broken(*args):
            raise Fp8OnnxError("The FP16 baseline of 'm.onnx' does not load in onnxruntime (cpu): Resize refused.")

        monkeypatch.setattr(compare_module, "_fp16_session", broken)
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    result = fp8onnx.compare(path, [path], data, provider="cpu")
    assert [r.name for r in result.rows] == ["FP32 (reference)", "m.onnx"]
    assert result.rows[1].ratio_to_fp16 is None
    assert len(result.notes) == 1 and result.notes[0].startswith("No FP16 baseline: The FP16 baseline of ")
    assert result.notes[0].endswith("Results are against FP32 only.")
    assert ("could not be built" if where == "conversion" else "Resize refused") in result.notes[0]
    assert "note: No FP16 baseline" in result.table()


def test_language_models_get_generation_fidelity_and_every_model_its_run_time_cost(tmp_path):
    """The sample decoder (input_ids -> logits, no KV cache: each step reruns the sequence): FP32's
    own copy generates FP32's tokens exactly, FP8 diverges somewhere; each row says its time per
    batch and the memory its session holds."""
    from helpers import SAMPLE

    fp8 = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", fp8, SAMPLE / "calib.npz", provider="cpu")
    same = tmp_path / "same.onnx"
    same.write_bytes((SAMPLE / "decoder.onnx").read_bytes())
    result = fp8onnx.compare(
        SAMPLE / "decoder.onnx", [same, fp8], SAMPLE / "eval.npz", generate=12, prompts=3, provider="cpu"
    )
    rows = {r.name: r for r in result.rows}
    assert result.generation == {"prompts": 3, "prompt_tokens": 32, "tokens": 12}
    assert rows["same.onnx"].generation == {
        "tokens_before_divergence": 12.0,
        "token_agreement": 1.0,
        "identical": 1.0,
        "tokens": 12,
        "prompts": 3,
    }
    assert 0 <= rows["q.onnx"].generation["token_agreement"] <= 1
    assert rows["FP32 (reference)"].generation is None and rows["FP16"].generation is not None
    assert all(r.latency_ms > 0 for r in result.rows)
    # each session holds at least its weights: the FP32 model's 3.7 MB, the FP8 model's 1.2 MB
    assert rows["same.onnx"].session_mib > 3.5 and rows["q.onnx"].session_mib > 1.1
    table = result.table()
    assert "greedy generation, 3 prompts of 32 tokens" in table and "ms/batch" in table
    assert (
        fp8onnx.compare(SAMPLE / "decoder.onnx", [fp8], SAMPLE / "eval.npz", generate=0, fp16=False).generation is None
    )


def test_models_that_are_not_language_models_get_no_generation(tmp_path):
    data = mlp_data(tmp_path / "d.npz")
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(mlp_model(tmp_path / "m.onnx"), out, data, provider="cpu")
    result = fp8onnx.compare(tmp_path / "m.onnx", [out], data, provider="cpu")
    assert result.generation is None and all(r.generation is None for r in result.rows)


def test_compare_plot_is_written_into_a_new_folder(tmp_path):
    from click.testing import CliRunner

    from fp8onnx.cli import main

    from helpers import SAMPLE

    fp8 = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", fp8, activations="dynamic", provider="cpu")
    args = ["compare", str(SAMPLE / "decoder.onnx"), str(fp8), "--data", str(SAMPLE / "eval.npz")]
    r = CliRunner().invoke(main, [*args, "--generate", "4", "--plot", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    png = tmp_path / "plots" / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _softmax_classifier(path, w):
    """x -> MatMul -> Softmax -> 'output': class scores under a name that says nothing."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["z"], name="fc"), helper.make_node("Softmax", ["z"], ["output"])],
        "clf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["b", 4])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_the_headline_follows_the_output_and_can_be_chosen(tmp_path):
    """A classifier (a Softmax computes its output) is judged by top-1 agreement, not by cosine, which
    hides changed decisions; --metric chooses any headline; one that cannot be measured is refused."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((64, 16)).astype(np.float32))
    ref = _softmax_classifier(tmp_path / "ref.onnx", w)
    noisy = _softmax_classifier(tmp_path / "noisy.onnx", w + rng.standard_normal(w.shape).astype(np.float32) * 0.5)
    auto = fp8onnx.compare(ref, [noisy], tmp_path / "d.npz", provider="cpu").rows[-1]
    assert auto.headline == "top-1 agreement with FP32" and auto.value == auto.outputs["output"]["top1_agreement"]
    assert auto.value < auto.outputs["output"]["cosine_mean"]  # cosine would have hidden the changed decisions
    for metric, label in (("cosine", "mean cosine to FP32"), ("rel-l2", "1 - relative L2 error to FP32")):
        row = fp8onnx.compare(ref, [noisy], tmp_path / "d.npz", metric=metric, provider="cpu").rows[-1]
        assert row.headline == label
    assert row.value == pytest.approx(1 - row.outputs["output"]["rel_l2"])
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "m.npz")
    top1 = fp8onnx.compare(path, [path], data, metric="top1", provider="cpu").rows[-1]  # 'y': 8 scores per row
    assert top1.headline == "top-1 agreement with FP32" and top1.value == 1.0
    with pytest.raises(Fp8OnnxError, match="--metric accuracy needs 'labels'"):
        fp8onnx.compare(ref, [noisy], tmp_path / "d.npz", metric="accuracy", provider="cpu")
    with pytest.raises(Fp8OnnxError, match="--metric must be one of"):
        fp8onnx.compare(ref, [noisy], tmp_path / "d.npz", metric="f1", provider="cpu")


def test_a_byte_input_classifier_is_class_scores_whatever_its_family():
    """A content-type classifier: bytes in (no token input, family "other"), MatMul + bias Add out."""
    import onnx_ir as ir

    from fp8onnx.accuracy.metrics import class_outputs
    from fp8onnx.techniques.family import detect_family

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Cast", ["bytes"], ["x"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["scores"]),
        helper.make_node("ReduceMean", ["x"], ["pooled"], axes=[1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "bytes",
        [helper.make_tensor_value_info("bytes", TensorProto.INT32, ["n", 32])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 5]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["n"]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((32, 5)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b"),
        ],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert detect_family(model).name == "other"
    assert class_outputs(model) == {"scores"}


def test_a_softmax_written_out_is_class_scores():
    """jax2tf / tf2onnx write a softmax as Div(Exp(x - max), sum) (Magika's content-type classifier)."""
    import onnx_ir as ir

    from fp8onnx.accuracy.metrics import class_outputs

    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Exp", ["d"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
        helper.make_node("Div", ["e", "s"], ["p"]),
    ]
    graph = helper.make_graph(
        nodes,
        "softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", 6])],
        [numpy_helper.from_array(np.array([-1], np.int64), "axes")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert class_outputs(model) == {"p"}


def test_outputs_too_big_for_the_disk_run_side_by_side_with_the_same_numbers(tmp_path, monkeypatch):
    """Where the reference's outputs over the data would not fit the free disk (a language model's logits
    over a whole benchmark: SmolLM2 on LAMBADA, about 100 GB), every model runs beside the reference batch by
    batch: the same figures, per sample too, a note says so, and nothing was spilled; where every session at
    once would not fit half of the available memory, in pairs (the reference beside each model), the same
    figures again; feeds given as a one-shot iterator get one sentence instead of wrong figures."""
    from fp8onnx.accuracy import evaluation

    fp8 = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", fp8, SAMPLE / "calib.npz", provider="cpu")
    args = (SAMPLE / "decoder.onnx", [fp8], SAMPLE / "eval.npz")
    kw = {"provider": "cpu", "generate": 0, "batch_size": 8}
    spilled = fp8onnx.compare(*args, **kw)
    monkeypatch.setattr(evaluation, "SPILL_MARGIN", 1 << 62)  # no disk is that free
    saved = []
    monkeypatch.setattr(evaluation.Spill, "save", lambda self, *a: saved.append(a[:2]))
    side = fp8onnx.compare(*args, **kw)
    assert saved == []  # it gave up before writing a batch (the batch count is known)
    assert any("The models ran side by side" in n for n in side.notes)
    assert [r.name for r in side.rows] == [r.name for r in spilled.rows] == ["FP32 (reference)", "FP16", "q.onnx"]
    for a, b in zip(spilled.rows, side.rows):
        assert (a.accuracy, a.perplexity, a.outputs) == (b.accuracy, b.perplexity, b.outputs)
        assert all(np.array_equal(a.columns[k], b.columns[k]) for k in a.columns)
    monkeypatch.setattr(evaluation, "available_memory", lambda: 1 << 20)  # too little for every session at once
    paired = fp8onnx.compare(*args, **kw)
    assert saved == []
    assert any("The models ran in pairs, the reference again beside each model" in n for n in paired.notes)
    assert [r.name for r in paired.rows] == [r.name for r in spilled.rows]
    for a, b in zip(spilled.rows, paired.rows):
        assert (a.accuracy, a.perplexity, a.outputs) == (b.accuracy, b.perplexity, b.outputs)
        assert all(np.array_equal(a.columns[k], b.columns[k]) for k in a.columns)
    feeds = iter([dict(np.load(SAMPLE / "eval.npz"))])
    with pytest.raises(Fp8OnnxError, match="cannot be read again beside the other models"):
        fp8onnx.compare(SAMPLE / "decoder.onnx", [fp8], feeds, **kw)


def test_the_per_position_loss_reads_a_large_vocabulary_in_bounded_slices(monkeypatch):
    """requires: logits [batch, seq, vocab] with positions not scored (label -1);
    ensures: -log softmax at each label, the same whether the rows go through in one slice or many (a
    262k-token vocabulary's 1,024 rows at once took 3 GiB of temporaries: Gemma 3's HellaSwag runs were
    killed for memory), 0 where not scored."""
    from fp8onnx.accuracy import metrics

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 7, 50)) * 4).astype(np.float32)
    labels = rng.integers(0, 50, (3, 7))
    labels[1, 2:] = -1
    x = logits.astype(np.float64)
    want = np.log(np.exp(x).sum(-1)) - np.take_along_axis(x, np.maximum(labels, 0)[..., None], -1)[..., 0]
    want[labels < 0] = 0
    whole = metrics._nll(logits, labels)
    monkeypatch.setattr(metrics, "ROW_CHUNK", 120)  # two rows a slice
    sliced = metrics._nll(logits, labels)
    np.testing.assert_allclose(whole, want.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sliced, whole)


def test_an_fp8_model_whose_dequantized_weights_would_not_fit_memory_dequantizes_them_at_every_run(
    tmp_path, monkeypatch
):
    """requires: an FP8 candidate on the CPU EP; ensures: its session dequantizes the float8 weights once at
    load while they fit FOLD_SHARE of the memory available (the weights held in float: about the FP32
    model's memory), else keeps them float8 and dequantizes them at every run (a third of that memory, an
    8B model's FP8 copy beside nothing else), says so in a note, and scores the same within rounding."""
    from fp8onnx.graph import runtime
    from fp8onnx.graph.model_io import load_model

    fp8 = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", fp8, SAMPLE / "calib.npz", provider="cpu")
    model = load_model(fp8)
    float8 = [v.const_value for v in model.graph.initializers.values() if v.const_value.dtype.name.startswith("FLOAT8")]
    assert float8 and runtime.dequantized_bytes(model) == 4 * sum(t.size for t in float8)
    assert runtime.dequantized_bytes(load_model(SAMPLE / "decoder.onnx")) == 0
    args = (SAMPLE / "decoder.onnx", [fp8], SAMPLE / "eval.npz")
    kw = {"provider": "cpu", "generate": 0, "fp16": False}
    folded = fp8onnx.compare(*args, **kw)
    assert not any("dequantized at every run" in n for n in folded.notes)
    monkeypatch.setattr(runtime, "available_memory", lambda: 1 << 20)
    assert runtime.folds_at_load(load_model(SAMPLE / "decoder.onnx")) == (True, "")  # no float8: nothing to fold
    each_run = fp8onnx.compare(*args, **kw)
    assert any(n.startswith("q.onnx: its float8 weights were dequantized at every run") for n in each_run.notes)
    a, b = folded.rows[-1], each_run.rows[-1]
    # the folded weights' float32 copies (3.6 MB here) are not held: 2.2 MiB less measured on the sample
    assert a.session_mib - b.session_mib > 0.4 * runtime.dequantized_bytes(model) / 2**20
    assert abs(a.accuracy - b.accuracy) <= 0.01 and abs(a.perplexity / b.perplexity - 1) < 1e-3
    assert np.allclose(a.columns["nll"], b.columns["nll"], rtol=1e-3, atol=1e-4)


def test_generation_holds_one_models_session_at_a_time(tmp_path, monkeypatch):
    """requires: a language model and a candidate, generation asked for. ensures: greedy generation holds
    one model's session at a time (FP32's, FP16's and each candidate's one after the other): when a model's
    generator is made from its new session, no earlier model's generator (and session) is alive."""
    import weakref

    from fp8onnx.accuracy import compare as compare_module

    from helpers import SAMPLE

    real = compare_module.Generator
    made: list = []
    alive_when_made: list[int] = []

    def counted(sessions, **kw):
        alive_when_made.append(sum(r() is not None for r in made))
        generator = real(sessions, **kw)
        made.append(weakref.ref(generator))
        return generator

    monkeypatch.setattr(compare_module, "Generator", counted)
    same = tmp_path / "same.onnx"
    same.write_bytes((SAMPLE / "decoder.onnx").read_bytes())
    result = fp8onnx.compare(
        SAMPLE / "decoder.onnx", [same], SAMPLE / "eval.npz", generate=4, prompts=2, provider="cpu"
    )
    assert result.generation is not None
    assert alive_when_made == [0, 0, 0]  # FP32, FP16, same.onnx
