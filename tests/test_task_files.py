"""Zero-shot task files (LAMBADA-style completions, HellaSwag-style multiple choice) in ``compare``:
the items are scored from the per-sample sums exactly as a harness scores them one by one."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from test_sources import _docs, _model

import fp8onnx
from fp8onnx.cli import main
from fp8onnx.data.feeds import TextSource
from fp8onnx.data.tasks import is_task_file

tokenizers = pytest.importorskip("tokenizers")


def _word_tokenizer(folder, vocab_size: int):
    """A word-level tokenizer.json trained on the test documents, ``<bos>`` (id 2) before every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        _docs(), trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "<bos>"])
    )
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    return _word_tokenizer(tmp_path_factory.mktemp("tok"), 400)


def _items(n: int = 12):
    words = " ".join(_docs()[:20]).split()
    completions = [{"context": " ".join(words[i * 9 : i * 9 + 8]), "target": words[i * 9 + 8]} for i in range(n)]
    choices = [
        {
            "context": " ".join(words[i * 7 : i * 7 + 5]),
            "endings": [" ".join(words[j : j + 2]) for j in (i, 40 + i, 80 + i)],
            "label": i % 3,
        }
        for i in range(n)
    ]
    return completions, choices


def _write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True))


def _one(session, tok, context, continuation):
    """(log-probabilities of the continuation's tokens, whether each is the argmax), one sample alone."""
    head = tok.encode(context, add_special_tokens=False).ids
    whole = tok.encode(context + " " + continuation, add_special_tokens=False).ids
    ids = np.array([[2, *whole]], np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    feed["position_ids"] = np.arange(ids.shape[1])[None]
    logp = _log_softmax(session.run(["logits"], feed)[0][0])
    cont = whole[len(head) :]
    at = np.arange(len(head), len(head) + len(cont))  # position of each continuation token's predictor (after <bos>)
    return logp[at, cont], logp[at].argmax(-1) == np.array(cont)


def test_task_items_score_as_a_harness_scores_them_one_by_one(tmp_path, bos_tokenizer):
    model = _model(tmp_path / "lm.onnx", past=False)
    completions, choices = _items()
    lam, hs = _write(tmp_path / "lambada.jsonl", completions), _write(tmp_path / "hellaswag.jsonl", choices)
    assert is_task_file(lam) and is_task_file(hs) and not is_task_file(_write(tmp_path / "t.jsonl", [{"text": "a"}]))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    tok = tokenizers.Tokenizer.from_file(str(bos_tokenizer))

    result = fp8onnx.compare(model, [], TextSource(lam, bos_tokenizer), batch_size=5, provider="cpu", memory=False)
    fp32 = result.rows[0]
    scored = [_one(session, tok, r["context"], r["target"]) for r in completions]
    assert fp32.accuracy == pytest.approx(np.mean([hits.all() for _, hits in scored]))
    assert fp32.perplexity == pytest.approx(np.exp(np.mean([-lp.sum() for lp, _ in scored])), rel=1e-5)
    assert any("12 completions (LAMBADA-style)" in n for n in result.notes)
    # item by item in file order, though the batches took them longest first
    np.testing.assert_array_equal(fp32.columns["correct"], [hits.all() for _, hits in scored])
    np.testing.assert_allclose(fp32.columns["nll"], [-lp.sum() for lp, _ in scored], rtol=1e-5)
    first = fp8onnx.compare(model, [], TextSource(lam, bos_tokenizer), max_samples=5, batch_size=2, provider="cpu")
    assert first.samples == 5  # the file's first five items, whole, not the five longest
    np.testing.assert_allclose(first.rows[0].columns["nll"], [-lp.sum() for lp, _ in scored[:5]], rtol=1e-5)

    result = fp8onnx.compare(model, [], TextSource(hs, bos_tokenizer), batch_size=4, provider="cpu", memory=False)
    expected = []
    for r in choices:
        norm = [_one(session, tok, r["context"], e)[0].sum() / len(e) for e in r["endings"]]
        expected.append(int(np.argmax(norm)) == r["label"])
    assert result.rows[0].accuracy == pytest.approx(np.mean(expected)) and result.rows[0].perplexity is None
    fp16 = result.rows[1]
    assert fp16.name == "FP16" and len(fp16.columns["correct"]) == 12  # an item, not an ending, per unit


def test_task_batches_go_longest_first_with_an_items_samples_together(tmp_path, bos_tokenizer):
    from fp8onnx.data.feeds import InputSpec
    from fp8onnx.data.tasks import TaskData

    _, choices = _items()
    choices[5]["context"] = " ".join(["the"] * 30)  # the longest item, sixth in the file
    specs = [
        InputSpec("input_ids", np.dtype("int64"), (None, None)),
        InputSpec("attention_mask", np.dtype("int64"), (None, None)),
    ]
    data = TaskData(_write(tmp_path / "hs.jsonl", choices), specs, bos_tokenizer)
    batches = list(data.batches(6))
    assert sorted(data.task.order.tolist()) == list(range(36)) and data.task.order[:3].tolist() == [15, 16, 17]
    widths = [b.feed["input_ids"].shape[1] for b in batches]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    padding = sum(int((b.feed["attention_mask"] == 0).sum()) for b in batches)
    lengths = [len(ids) for ids, _ in data._tokenized()]
    in_file_order = sum(max(lengths[a : a + 6]) * 6 - sum(lengths[a : a + 6]) for a in range(0, 36, 6))
    assert padding < in_file_order
    columns = {"correct": np.arange(36.0), "labelled": np.ones(36), "nll": np.arange(36.0)}
    with pytest.raises(fp8onnx.Fp8OnnxError, match="35 samples scored of 36"):
        data.task.rescore({k: v[:35] for k, v in columns.items()})
    data.task.order = np.arange(36)[::-1].copy()  # given back to front: item 0's samples came last
    assert data.task.rescore({**columns, "nll": np.arange(36.0)[::-1].copy()})["nll"][0] == choices[0]["label"]
    with pytest.raises(fp8onnx.Fp8OnnxError, match=r"its first item has 3 samples .* more than the 2 asked for"):
        data.limit(2)
    data.limit(10)  # whole items only: three of three endings
    assert data.task.sizes == [3, 3, 3] and sum(b.size for b in data.batches(4)) == 9


def test_a_bad_task_file_is_one_sentence(tmp_path, bos_tokenizer):
    model = _model(tmp_path / "lm.onnx", past=False)
    bad = _write(tmp_path / "bad.jsonl", [{"context": "a b", "endings": ["c", "d"], "label": 5}])
    r = CliRunner().invoke(main, ["compare", str(model), "--data", str(bad), "--tokenizer", str(bos_tokenizer)])
    assert r.exit_code == 2 and "line 1: 'label' 5 but 2 endings" in r.output


@pytest.fixture(scope="module")
def sample_tokenizer(tmp_path_factory):  # ids below the sample decoder's 256
    return _word_tokenizer(tmp_path_factory.mktemp("tok"), 250)


def test_a_task_computes_its_logits_at_the_scored_positions_only(tmp_path, sample_tokenizer, monkeypatch):
    """The sample decoder (a TorchScript export) and two FP8 copies (lm_head in float; every MatMul static
    FP8, lm_head's input quantized too) score a task's items as they do with every position's logits,
    targets of one to three words (padded scored positions) and endings of one to four."""
    import fp8onnx.accuracy.compare as compare_module

    from helpers import SAMPLE

    words = " ".join(_docs()[:20]).split()
    cut = [(i * 9, i * 9 + 5 + i % 4, i * 9 + 6 + i % 4 + i % 3) for i in range(14)]
    completions = [{"context": " ".join(words[a:b]), "target": " ".join(words[b:c])} for a, b, c in cut]
    choices = [
        {
            "context": " ".join(words[i * 7 : i * 7 + 5]),
            "endings": [" ".join(words[j : j + 1 + (j + k) % 4]) for k, j in enumerate((i, 40 + i, 80 + i))],
            "label": i % 3,
        }
        for i in range(10)
    ]
    reference = SAMPLE / "decoder.onnx"
    defaults, static = tmp_path / "defaults.onnx", tmp_path / "static.onnx"
    fp8onnx.quantize(reference, defaults, SAMPLE / "calib.npz", provider="cpu")
    fp8onnx.quantize(reference, static, SAMPLE / "calib.npz", preset="encoder", provider="cpu")
    for records in (completions, choices):
        data = TextSource(_write(tmp_path / "task.jsonl", records), sample_tokenizer)
        run = {"batch_size": 4, "provider": "cpu", "memory": False}
        trimmed = fp8onnx.compare(reference, [defaults, static], data, **run)
        monkeypatch.setattr(compare_module, "trimmable", lambda model: False)
        whole = fp8onnx.compare(reference, [defaults, static], data, **run)
        monkeypatch.undo()
        assert any("scored positions only" in n for n in trimmed.notes)
        assert not any("scored positions only" in n for n in whole.notes)
        assert [r.name for r in trimmed.rows] == [r.name for r in whole.rows] and len(trimmed.rows) == 4
        for a, b in zip(trimmed.rows, whole.rows):
            np.testing.assert_array_equal(a.columns["correct"], b.columns["correct"])
            np.testing.assert_allclose(a.columns["nll"], b.columns["nll"], rtol=1e-5)
            assert a.accuracy == b.accuracy and len(a.columns["nll"]) == len(records)
        assert trimmed.rows[3].accuracy is not None


def _head(path, soft_cap: bool, flat: bool):
    """hidden [batch, seq, 8] -> logits [batch, seq, 16]: a MatMul, soft-capped, or through a flat Reshape."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w")]
    inits += [numpy_helper.from_array(np.float32(3.0), "cap")]
    nodes = [helper.make_node("Relu", ["hidden"], ["h"])]
    if flat:
        inits += [
            numpy_helper.from_array(np.array([-1, 8]), "flat"),
            numpy_helper.from_array(np.array([2, -1, 16]), "back"),
        ]
        nodes += [helper.make_node("Reshape", ["h", "flat"], ["h2"]), helper.make_node("MatMul", ["h2", "w"], ["p"])]
        nodes += [helper.make_node("Reshape", ["p", "back"], ["logits"])]
    elif soft_cap:
        nodes += [helper.make_node("MatMul", ["h", "w"], ["p"]), helper.make_node("Div", ["p", "cap"], ["d"])]
        nodes += [helper.make_node("Tanh", ["d"], ["t"]), helper.make_node("Mul", ["t", "cap"], ["logits"])]
    else:
        nodes += [helper.make_node("MatMul", ["h", "w"], ["logits"])]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 16])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_trimming_gathers_the_scored_rows_or_leaves_the_model_alone(tmp_path):
    import onnx_ir as ir

    from fp8onnx.accuracy.scored_positions import POSITIONS, scored, trimmed
    from fp8onnx.graph.model_io import load_model

    hidden = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    labels = np.array([[-1, -1, 7, 3, -1], [-1, 4, -1, -1, -1]])
    fed = scored({"hidden": hidden}, labels)
    np.testing.assert_array_equal(fed["feed"][POSITIONS][..., 0], [[2, 3], [1, -1]])
    np.testing.assert_array_equal(fed["labels"], [[7, 3], [4, -1]])
    for cap in (False, True):
        path = _head(tmp_path / f"head{cap}.onnx", soft_cap=cap, flat=False)
        full = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"hidden": hidden})[0]
        model = load_model(path)
        assert trimmed(model) and not trimmed(model)  # once: the input is there
        onnx.save(ir.to_proto(model), tmp_path / "trimmed.onnx")
        session = ort.InferenceSession(str(tmp_path / "trimmed.onnx"), providers=["CPUExecutionProvider"])
        rows = session.run(None, fed["feed"])[0]
        np.testing.assert_allclose(rows[0], full[0, [2, 3]], rtol=1e-6)
        np.testing.assert_allclose(rows[1, 0], full[1, 1], rtol=1e-6)  # its padding reads the last row: unscored
    flat = load_model(_head(tmp_path / "flat.onnx", soft_cap=False, flat=True))
    before = ir.to_proto(flat).SerializeToString()
    assert not trimmed(flat) and ir.to_proto(flat).SerializeToString() == before
