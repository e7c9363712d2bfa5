"""Models from the wild, end to end: every graph of the exporter corpus (``corpus.py``: torch TorchScript
at opsets 11-17 and dynamo, Optimum, onnxruntime-genai's builder, tf2onnx- and paddle2onnx-style, IR 3)
is quantized with `fp8onnx quantize MODEL --calib DATA -o OUT` and its default options. The output must
pass fp8onnx's own checks, load and run in onnxruntime at its default optimisation level (as users run
it), quantize at least one node, and stay within the format's error bound of FP32.

The bound: one E4M3 rounding has a relative RMS error of eps / sqrt(12) (eps = 2**-3, its relative
step); n quantized tensors on the path add up to about sqrt(n) times that. Each row reports the worst
relative L2 error over the float outputs divided by that bound; it must be below 1.

Marked ``wild``: it needs the ``[wild]`` extra (torch, transformers, optimum-onnx, onnxruntime-genai)
and takes about a minute. ``python tests/wild/test_wild.py FOLDER`` prints the table.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import numpy as np
import onnx
import pytest

from fp8onnx.passes.common import proto_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from corpus import CASES, available, build, run_onnxruntime

E4M3_EPS = 2.0**-3
QUANTIZABLE = ("MatMul", "Gemm", "Conv", "ConvTranspose")


def _counts(path: pathlib.Path) -> dict[str, int]:
    proto = onnx.load(str(path), load_external_data=False)
    counts = dict.fromkeys(QUANTIZABLE, 0)
    for root in (proto.graph, *proto.functions):
        for g in proto_graphs(root):
            for node in g.node:
                if node.op_type in counts:
                    counts[node.op_type] += 1
    return counts


def check_case(name: str, folder: pathlib.Path, preset: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """Build, quantize with defaults (or ``--preset preset``, and ``extra`` options) through the CLI, run both
    on ORT; one row of the corpus table."""
    from click.testing import CliRunner

    from fp8onnx.cli import main

    case = CASES[name]
    model, data = build(name, folder)
    calib = folder / f"{name}.npz"
    np.savez(calib, **data)
    out, report = folder / f"{name}.fp8.onnx", folder / f"{name}.json"
    args = ["quantize", str(model), "--calib", str(calib), "-o", str(out), "--report", str(report)]
    t0 = time.perf_counter()
    result = CliRunner().invoke(main, args + (["--preset", preset] if preset else []) + list(extra))
    seconds = time.perf_counter() - t0
    assert result.exit_code == 0, f"{name}: {result.output}"
    rep = json.loads(report.read_text())
    quantized = [n for n in rep["nodes"] if n["quantized"]]
    tensors = len({t["name"] for n in quantized for t in n["tensors"]})
    reference = run_onnxruntime(model, data, case.layout)
    candidate = run_onnxruntime(out, data, case.layout)  # the default optimisation level
    worst = 0.0
    for ref_feed, got_feed in zip(reference, candidate):
        for r, c in zip(ref_feed, got_feed):
            if r.dtype.kind != "f" or r.size == 0:
                continue
            r64, c64 = r.astype(np.float64), c.astype(np.float64)
            norm = np.linalg.norm(r64)
            if norm > 0:
                worst = max(worst, float(np.linalg.norm(c64 - r64) / norm))
    bound = math.sqrt(max(tensors, 1)) * E4M3_EPS / math.sqrt(12)
    src = onnx.load(str(model), load_external_data=False)
    return {
        "case": name,
        "exporter": case.exporter,
        "opset": next(o.version for o in src.opset_import if o.domain in ("", "ai.onnx")),
        "ir": src.ir_version,
        **_counts(model),
        "quantized": len(quantized),
        "rel_l2": worst,
        "bound": bound,
        "ratio": worst / bound,
        "prepared": rep["prepared"],
        "family": (rep.get("family") or {}).get("family"),
        "preset": rep["config"].get("preset", "none"),
        "output_bytes": rep["output_bytes"],
        "seconds": seconds,
    }


NAMES = [n for n in CASES]


@pytest.mark.wild
@pytest.mark.parametrize("name", NAMES)
def test_model_from_the_wild_quantizes_with_defaults(name, tmp_path_factory):
    if not available(name):
        pytest.skip(f"needs {', '.join(CASES[name].requires)} (pip install -e .[wild])")
    row = check_case(name, tmp_path_factory.mktemp(name))
    assert row["quantized"] > 0, row
    assert row["ratio"] < 1.0, row


@pytest.mark.wild
@pytest.mark.parametrize(
    "name", ["torch-llama-o17", "torch-llama-dynamo", "hf-llama-past", "genai-llama", "genai-llama-dml"]
)
def test_kept_channels_in_every_llm_export(name, tmp_path):
    """--keep-channels on llm-w8a8 in every exporter's decoder (separate or packed q/k/v, a float16 graph, an
    empty KV past): every quantized input gets its float side product, and the output stays within the
    format's bound of FP32 in onnxruntime at its default optimisation level."""
    if not available(name):
        pytest.skip(f"needs {', '.join(CASES[name].requires)} (pip install -e .[wild])")
    row = check_case(name, tmp_path, "llm-w8a8", ("--keep-channels", "2"))
    kept = [line for line in row["prepared"] if line.startswith("kept the 2 largest input channels")]
    assert kept and " 0 activations" not in kept[0], row["prepared"]
    assert row["quantized"] > 0 and row["ratio"] < 1.0, row


@pytest.mark.wild
@pytest.mark.parametrize("name", ["torch-llama-o17", "torch-llama-dynamo", "hf-llama-past", "genai-llama"])
def test_per_group_activations_are_per_group_in_every_llm_export(name, tmp_path, caplog):
    """Every activation of an exported LLM (all its widths are multiples of 8) gets its groups of 8:
    shape inference loses the attention output's width after a Reshape to a computed shape in torch's
    export, which once sent those activations to one scale per row."""
    from click.testing import CliRunner

    from fp8onnx.cli import main

    if not available(name):
        pytest.skip(f"needs {', '.join(CASES[name].requires)} (pip install -e .[wild])")
    model, data = build(name, tmp_path)
    out = tmp_path / "g8.onnx"
    args = ["quantize", str(model), "--activations", "dynamic-per-group", "--group-size", "8", "-o", str(out)]
    with caplog.at_level("WARNING"):
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "one scale per row" not in caplog.text
    nodes = [n for g in proto_graphs(onnx.load(str(out), load_external_data=False).graph) for n in g.node]
    groups = sum(n.op_type == "Reshape" and n.name.endswith("/groups") for n in nodes)
    assert groups > 0 and not any(n.name.endswith("/per_token_scaled") for n in nodes), groups
    for outputs in run_onnxruntime(out, data, CASES[name].layout):
        assert all(np.all(np.isfinite(o)) for o in outputs if o.dtype.kind == "f")


def main(folder: str) -> None:
    root = pathlib.Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    head = f"{'case':<18} {'exporter':<40} {'opset':>5} {'ir':>3} {'MM':>3} {'Gemm':>4} {'Conv':>4} {'CvT':>3}"
    print(head + f" {'quant':>5} {'rel L2':>8} {'bound':>6} {'ratio':>6}  loads at ORT default")
    for name in NAMES:
        if not available(name):
            print(f"{name:<18} skipped: needs {', '.join(CASES[name].requires)}")
            continue
        r = check_case(name, root / name)
        print(
            f"{r['case']:<18} {r['exporter']:<40} {r['opset']:>5} {r['ir']:>3} {r['MatMul']:>3} {r['Gemm']:>4} "
            f"{r['Conv']:>4} {r['ConvTranspose']:>3} {r['quantized']:>5} {r['rel_l2']:>8.4f} {r['bound']:>6.3f} "
            f"{r['ratio']:>6.2f}  yes"
        )


if __name__ == "__main__":
    main(sys.argv[1])


def _docs_text(path: pathlib.Path) -> pathlib.Path:
    import pydoc_data.topics as topics
    import re

    docs = [re.sub(r"\s+", " ", topics.topics[n]).strip() for n in sorted(topics.topics)[:30]]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.mark.wild
@pytest.mark.parametrize("name", ["hf-llama-past", "genai-llama"])
def test_kv_cache_decoders_calibrate_from_a_text_file_alone(name, tmp_path):
    """An export folder and a .txt file: the tokenizer.json beside the model tokenizes it, the
    KV-cache inputs are filled as empty prefill caches, quantize and compare run on the text."""
    if not available(name):
        pytest.skip(f"needs {', '.join(CASES[name].requires)} (pip install -e .[wild])")
    from click.testing import CliRunner

    from fp8onnx.cli import main

    model, _ = build(name, tmp_path)
    folder = model.parent
    if not (folder / "tokenizer.json").exists():  # Optimum exports the model only: a BPE trained here
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()[:200]
        trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=alphabet)
        tok.train_from_iterator(_docs_text(tmp_path / "train.txt").read_text().split("\n\n"), trainer)
        tok.save(str(folder / "tokenizer.json"))
    text = _docs_text(tmp_path / "docs.txt")
    r = CliRunner().invoke(main, ["quantize", str(folder), "--calib", str(text), "-o", str(tmp_path / "q.onnx")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["data", str(folder), str(text), "--seq-len", "32", "-o", str(tmp_path / "d.npz")])
    assert r.exit_code == 0 and "empty cache for prefill" in r.output, r.output
    data = np.load(tmp_path / "d.npz")
    past = [k for k in data.files if "past" in k]
    assert past and all(data[k].shape[2] == 0 for k in past) and "labels" in data.files
    r = CliRunner().invoke(main, ["compare", str(folder), str(tmp_path / "q.onnx"), "--data", str(tmp_path / "d.npz")])
    assert r.exit_code == 0 and "ppl" in r.output, r.output


@pytest.mark.wild
@pytest.mark.parametrize("precision", ["fp16"])
def test_a_vit_quantizes_at_fp16_without_crashing_onnxruntime(tmp_path, precision):
    """The same crash in quantize's own sessions (calibration, the load check): --precision fp16, which
    --target onnxruntime-cuda implies, killed the process with SIGSEGV on the corpus ViT before
    fp8onnx's sessions left NchwcTransformer out of float16 Conv graphs."""
    import fp8onnx

    if not available("torch-vit-o14"):
        pytest.skip("needs torch (pip install -e .[wild])")
    path, data = build("torch-vit-o14", tmp_path)
    np.savez(tmp_path / "data.npz", **data)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "data.npz", precision=precision, provider="cpu")
    assert report.quantized and report.config["precision"] == "fp16"


def test_the_fp16_baseline_of_a_vit_loads_in_onnxruntime(tmp_path):
    """onnxruntime 1.32's NchwcTransformer crashed the process (SIGSEGV) building the FP16 baseline's
    session of the corpus ViT (a float16 Conv patch embedding); compare leaves that transformer out."""
    import fp8onnx

    if not available("torch-vit-o17"):
        pytest.skip("needs torch (pip install -e .[wild])")
    path, data = build("torch-vit-o17", tmp_path)
    np.savez(tmp_path / "data.npz", **data)
    result = fp8onnx.compare(path, [], tmp_path / "data.npz", provider="cpu")
    fp16 = next(r for r in result.rows if r.name == "FP16")
    assert fp16.outputs[next(iter(fp16.outputs))]["cosine_mean"] > 0.999


@pytest.mark.wild
def test_a_merged_decoder_at_fp16_is_one_sentence_and_the_cuda_target_keeps_float32(tmp_path):
    """onnxruntime's float16 converter writes an invalid graph for Optimum's merged decoder (If branches
    reading the same outer values): --precision fp16 says so; --target onnxruntime-cuda, which only
    implied fp16, keeps the graph float32 with Casts around its fast-form ops."""
    import fp8onnx
    from fp8onnx.base.errors import Fp8OnnxError

    if not available("hf-gpt2-merged"):
        pytest.skip("needs the [wild] extra")
    path, data = build("hf-gpt2-merged", tmp_path)
    np.savez(tmp_path / "d.npz", **data)
    with pytest.raises(Fp8OnnxError, match=r"--precision fp16 cannot convert .* invalid graph"):
        fp8onnx.quantize(path, tmp_path / "a.onnx", tmp_path / "d.npz", precision="fp16", provider="cpu")
    report = fp8onnx.quantize(path, tmp_path / "b.onnx", tmp_path / "d.npz", target="onnxruntime-cuda", provider="cpu")
    assert report.config["precision"] == "model" and report.fast_form["w8a16"]
