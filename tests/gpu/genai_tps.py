"""The GPU check's onnxruntime-genai step: tokens per second of an FP16 folder against fp8onnx's CUDA folder
of the same model, and whether their greedy texts agree.

The folders are built on the lent machine itself (about 4 GB: more than a device call carries):

    python tests/gpu/genai_tps.py build OUT [--dims JSON]

1. a Llama-style model with random weights and real widths (:data:`LLAMA_1B`: about 1.0 B parameters,
   the widths of Llama 3.2 1B, a 32,000-entry vocabulary), made on the GPU in float16 and saved as a Hugging
   Face folder, with a byte-level BPE tokenizer that onnxruntime-genai reads (every byte one token);
2. ``fp16/``: onnxruntime-genai's model builder, as a user runs it offline:
   ``python -m onnxruntime_genai.models.builder -i HF -o fp16 -p fp16 -e cuda`` (no fp8onnx);
3. ``fp8/``: ``fp8onnx quantize fp16 -o fp8 --target onnxruntime-cuda`` (the fast form), on the CPU EP (the
   GPU is timing GEMMs meanwhile), with nearest rounding instead of the LLM preset's GPTQ (minutes of
   NumPy at this size; it changes the weights' values, not the graph that is timed) and a short text to
   calibrate on (the recipe is weight-only: the data goes unused).
It needs onnxruntime-genai's CUDA build (the onnxruntime-genai-cuda wheel, carried as
tests/gpu/run_gpu_checks.sh says), torch and transformers (on the machine's image).

Generation: per folder one warm-up, then greedy generation of ``new_tokens`` (default 128, never
stopped early) from each of :data:`PROMPTS`; tokens per second over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
LLAMA_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 32000}
PROMPTS = (
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):",
    "The three most important inventions of the 20th century are",
    "Explain why the sky is blue in one paragraph.",
)
CALIB_TEXT = " ".join(PROMPTS) * 4  # a few 128-token windows: the weight-only recipe uses none


def genai_cuda_missing() -> str | None:
    """Why onnxruntime-genai's CUDA build cannot run here, or None."""
    try:
        import onnxruntime_genai as og
    except Exception as exc:  # not installed, or its library does not load
        return f"onnxruntime-genai is not importable ({type(exc).__name__}: {exc})"
    if getattr(og, "__id__", "") != "onnxruntime-genai-cuda":
        return f"onnxruntime-genai {og.__version__} is not the CUDA build (onnxruntime-genai-cuda)"
    return None


def byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer without merges (every byte one token), padded to ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def random_llama(folder: pathlib.Path, dims: dict, device: str = "cuda", seed: int = 0) -> pathlib.Path:
    """A Llama with random weights saved as a Hugging Face folder (float16), made on ``device``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["ffn"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    model.save_pretrained(folder)
    save_tokenizer(folder, dims["vocab"])
    return folder


def save_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
    """:func:`byte_tokenizer` as a Hugging Face folder's tokenizer files, written without transformers'
    tokenizer classes (whose names changed in transformers 5, the machine's)."""
    tokenizer = byte_tokenizer(vocab_size)
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def _run(command: list[str], what: str, cwd: pathlib.Path) -> None:
    """``command`` in ``cwd``, not the checkout: ``python -m`` puts its folder first on the path, and the
    checkout's fp8onnx/ lacks fp8onnx.passes (pyproject maps it from passes/)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def build_folders(out: pathlib.Path, dims: dict, device: str = "cuda") -> dict:
    """{"fp16": folder, "fp8": folder, "seconds": {...}}; the Hugging Face folder is removed afterwards."""
    out = out.resolve()  # the commands run in it
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    start = time.perf_counter()
    source = random_llama(out / "hf", dims, device)
    seconds["random_model"] = time.perf_counter() - start
    fp16, fp8 = out / "fp16", out / "fp8"
    start = time.perf_counter()
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(fp16)]
    _run(builder + ["-p", "fp16", "-e", "cuda", "-c", str(out / "cache")], "onnxruntime-genai's builder", out)
    seconds["builder"] = time.perf_counter() - start
    shutil.rmtree(source)
    shutil.rmtree(out / "cache", ignore_errors=True)
    calib = out / "calib.txt"
    calib.write_text(CALIB_TEXT)
    start = time.perf_counter()
    quantize = [sys.executable, "-m", "fp8onnx.cli", "quantize", str(fp16), "-o", str(fp8)]
    quantize += ["--target", "onnxruntime-cuda", "--provider", "cpu", "--weight-rounding", "nearest"]
    _run(quantize + ["--calib", str(calib)], "fp8onnx quantize", out)
    seconds["fp8onnx_quantize"] = time.perf_counter() - start
    return {"fp16": str(fp16), "fp8": str(fp8), "seconds": seconds, "dims": dims}


def _prompt_tokens(og, model, folder: pathlib.Path) -> tuple[list[list[int]], object]:
    """Token ids of :data:`PROMPTS` and the tokenizer; a folder whose tokenizer onnxruntime-genai cannot read
    (a word-level one) gets seeded random ids from its vocabulary, and no tokenizer."""
    vocab = int(json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"])
    try:
        kind = json.loads((folder / "tokenizer.json").read_text())["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        kind = None
    # onnxruntime-genai's tokenizer reads BPE, Unigram and WordPiece; on a word-level one it raises from
    # its C++ side ("Cannot know how to parse line"), the likeliest cause of one CI run's SIGSEGV
    try:
        if kind not in ("BPE", "Unigram", "WordPiece"):
            raise ValueError(f"a {kind} tokenizer")
        tokenizer = og.Tokenizer(model)
        prompts = [[int(t) for t in tokenizer.encode(text)] for text in PROMPTS]
        if all(len(set(p)) >= 4 for p in prompts):
            return prompts, tokenizer
    except Exception as exc:  # no tokenizer the runtime reads: ids instead
        print(f"  tokenizer: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, 16).tolist() for _ in PROMPTS], None


def _greedy(og, model, prompt: list[int], new_tokens: int) -> list[int]:
    params = og.GeneratorParams(model)
    length = len(prompt) + new_tokens  # min_length: an end-of-sequence token does not stop it early
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt) :]


def _measure(og, folder: pathlib.Path, new_tokens: int) -> dict:
    entry: dict = {"folder": str(folder)}
    start = time.perf_counter()
    model = og.Model(str(folder))
    entry["load_s"] = time.perf_counter() - start
    ids, tokenizer = _prompt_tokens(og, model, folder)
    _greedy(og, model, ids[0], new_tokens)  # warm-up: kernels chosen, memory allocated
    start = time.perf_counter()
    tokens = [_greedy(og, model, p, new_tokens) for p in ids]
    seconds = time.perf_counter() - start
    entry.update(tokens=tokens, seconds=seconds, tokens_per_s=sum(map(len, tokens)) / seconds)
    if tokenizer is not None:
        entry["texts"] = [str(tokenizer.decode(np.asarray(t, np.int32))) for t in tokens]
    return entry


def genai_checks(folders: dict, new_tokens: int = 128) -> dict:
    """Tokens per second and greedy tokens (texts) of each onnxruntime-genai folder, against the first."""
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        return {"skipped": f"onnxruntime-genai is not installed ({exc})"}
    out: dict = {"onnxruntime_genai": getattr(og, "__version__", "?"), "new_tokens": new_tokens, "folders": {}}
    out["prompts"] = list(PROMPTS)
    baseline = None
    for name, folder in folders.items():
        try:
            entry = _measure(og, pathlib.Path(folder), new_tokens)
        except Exception as exc:
            entry = {"folder": str(folder), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            out["folders"][name] = entry
            print(f"genai {name}: {entry['error']}", flush=True)
            continue
        if baseline is None:
            baseline = entry
        else:
            tokens = entry["tokens"]
            same = [a == b for x, y in zip(tokens, baseline["tokens"]) for a, b in zip(x, y)]
            entry["token_agreement"] = sum(same) / max(1, len(same))
            entry["identical_sequences"] = sum(x == y for x, y in zip(tokens, baseline["tokens"]))
            entry["texts_agree"] = entry["identical_sequences"] == len(tokens)
            entry["speed_vs_baseline"] = entry["tokens_per_s"] / baseline["tokens_per_s"]
        out["folders"][name] = entry
        shown = {k: v for k, v in entry.items() if k not in ("tokens", "folder", "texts")}
        print(f"genai {name}: {json.dumps(shown)}", flush=True)
        if entry.get("texts"):
            print(f"  greedy text of {PROMPTS[0]!r}: {entry['texts'][0][:120]!r}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("build",))
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--dims", type=json.loads, default=LLAMA_1B, help=f"the model's sizes (default {LLAMA_1B})")
    ap.add_argument("--device", default="cuda", help="where the random weights are made")
    args = ap.parse_args()
    sys.path.append(str(REPO))  # after an installed fp8onnx (a source tree lacks fp8onnx.passes)
    built = build_folders(args.out, args.dims, args.device)
    (args.out / "folders.json").write_text(json.dumps(built, indent=1) + "\n")
    print(f"genai folders built: {json.dumps(built['seconds'])}", flush=True)


if __name__ == "__main__":
    main()
