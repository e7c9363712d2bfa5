"""GPU checks for fp8onnx on onnxruntime's CUDA EP: placement, accuracy, latency. Not run in CI.

Run on a CUDA machine with onnxruntime-gpu (see ../shared/hooks/gpu/README.md):
    python tests/gpu/run_gpu_checks.py --out "$OUT"
``--cpu-dry-run`` runs the same steps on the CPU EP without the native GEMM, to check the script.

1. Placement: every node of the FP16, FP8-QDQ and FP8-native (com.microsoft.GemmFloat8) sample
   decoders, from onnxruntime's profiler, counted per execution provider (no silent CPU fallback).
2. Accuracy: `fp8onnx compare` of FP32 vs FP16 vs FP8 (QDQ and native) on the sample decoder's
   eval set, on the CUDA EP.
3. Latency, warm-up then the median of many runs, one process: FP16 vs FP8-QDQ vs FP8-native for
   the sample decoder at 64 x 64 = 4,096 tokens, and for a GEMM-bound stack at Llama-7B widths
   (d=4096, ffn=11008, 2 blocks of QKV/O projections and SwiGLU MLP, random weights) at 4,096 rows.
4. Finer than per-channel: the sample decoder with weight blocks of 32 in the CUDA EP's per-axis
   form (``--target onnxruntime-cuda --gemm-op qdq``) and per-group activations of 32: where each
   node runs, and its logits on the EP against the same recipe's blocked form on the CPU EP (the two
   forms are bit-identical on the CPU EP; the CUDA EP has no blocked float8 DequantizeLinear).
5. Decode: the Llama-7B-width stack at M = 1..8 rows, every form (the fast form's GEMV path).
6. The fast form (``--target onnxruntime-cuda``: com.microsoft.MatMulBlockQuantizedFp8Weight, W8A16
   from the decoder's default recipe and W8A8 from static activations; blocks of 128): in steps 1-3 and
   5 next to FP16, Q/DQ and GemmFloat8, and its logits on the EP against fp8onnx's CPU emulation of
   the op (the CPU EP has no kernel for it: the dry run runs the emulation in its place).
7. onnxruntime-genai (``--genai NAME=FOLDER``, repeated; the first is the baseline): greedy generation
   of 48 tokens from 5 prompts per folder after one warm-up, tokens per second against the baseline's,
   and how many tokens are the baseline's. The folders come from tests/gpu/stage_genai.py (the FP16
   folder onnxruntime-genai's builder writes for CUDA, and fp8onnx's CUDA folder of the same model).
   ``--only genai`` runs this step alone.
Writes gpu_checks.json into --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _ort():
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA 13 libraries from the nvidia-* packages
    return ort


def session(path, provider, profile_dir=None):
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if profile_dir:
        so.enable_profiling = True
        so.profile_file_prefix = str(pathlib.Path(profile_dir) / pathlib.Path(path).stem)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    if provider == "cpu":
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(str(path), so, providers=providers)


def placement(path, provider, feed, tmp):
    """{op_type: {provider: count}} from one profiled run."""
    sess = session(path, provider, profile_dir=tmp)
    sess.run(None, feed)
    trace = json.loads(pathlib.Path(sess.end_profiling()).read_text())
    counts: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    seen = set()
    for event in trace:
        args = event.get("args", {})
        if event.get("cat") == "Node" and "provider" in args and event.get("name", "").endswith("_kernel_time"):
            node = event["name"][: -len("_kernel_time")]
            if node not in seen:
                seen.add(node)
                counts[args.get("op_name", "?")][args["provider"]] += 1
    return {"session_providers": sess.get_providers(), "nodes": {k: dict(v) for k, v in counts.items()}}


def runnable(path, provider):
    """``path`` itself, or on the CPU EP a copy with the CUDA-only fast-form op emulated (standard ops)."""
    from fp8onnx.graph.cpu_ep import cuda_only_ops

    path = pathlib.Path(path)
    if provider != "cpu" or not cuda_only_ops(path):
        return path
    import onnx_ir as ir

    from fp8onnx.passes import EmulateBlockFp8MatMulPass

    model = ir.load(path)
    EmulateBlockFp8MatMulPass()(model)
    emulated = path.with_name(path.stem + ".emulated.onnx")
    ir.save(model, emulated, external_data=emulated.name + ".data")
    return emulated


def fast_form_checks(models, ids, tmp, provider):
    """Step 6: the fast form's logits on the EP against fp8onnx's CPU emulation of it."""
    feed = {"input_ids": ids[:16]}
    out = {}
    for key in ("fp8_fast", "fp8_fast_w8a8"):
        got = session(runnable(models[key], provider), provider).run(None, feed)[0].astype(np.float64)
        ref = session(runnable(models[key], "cpu"), "cpu").run(None, feed)[0].astype(np.float64)
        out[key] = {
            "max_abs_vs_cpu_emulation": float(np.abs(got - ref).max()),
            "rel_l2_vs_cpu_emulation": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "top1_agreement_vs_cpu_emulation": float((got.argmax(-1) == ref.argmax(-1)).mean()),
        }
    return out


PROMPTS = (
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):",
    "The three most important inventions of the 20th century are",
    "Explain why the sky is blue in one paragraph.",
)


def _prompt_tokens(og, model, folder: pathlib.Path, count: int, length: int = 16) -> list[list[int]]:
    """Token ids of :data:`PROMPTS` from the folder's tokenizer; a tokenizer that maps English to few
    distinct ids (the random model's word-level one) gets seeded random ids from its vocabulary."""
    vocab = int(json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"])
    try:
        kind = json.loads((folder / "tokenizer.json").read_text())["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        kind = None
    # onnxruntime-genai's tokenizer reads BPE, Unigram and WordPiece; on the random model's word-level one it
    # raises from its C++ side ("Cannot know how to parse line"), the likeliest cause of one CI run's SIGSEGV
    try:
        if kind not in ("BPE", "Unigram", "WordPiece"):
            raise ValueError(f"a {kind} tokenizer")
        tokenizer = og.Tokenizer(model)
        prompts = [list(tokenizer.encode(text)) for text in PROMPTS[:count]]
        if all(len(set(p)) >= 4 for p in prompts):
            return prompts
    except Exception as exc:  # no tokenizer the runtime reads: ids instead
        print(f"  tokenizer: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


def _greedy(og, model, prompt: list[int], new_tokens: int) -> list[int]:
    params = og.GeneratorParams(model)
    length = len(prompt) + new_tokens  # min_length: an end-of-sequence token does not stop it early
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt) :]


def genai_checks(folders: dict, new_tokens: int = 48, prompts: int = 5) -> dict:
    """Step 7: tokens per second and tokens of each onnxruntime-genai folder, against the first."""
    import time

    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        return {"skipped": f"onnxruntime-genai is not installed ({exc})"}
    out: dict = {"onnxruntime_genai": getattr(og, "__version__", "?"), "new_tokens": new_tokens, "folders": {}}
    baseline = None
    for name, folder in folders.items():
        folder = pathlib.Path(folder)
        entry: dict = {"folder": str(folder)}
        try:
            start = time.perf_counter()
            model = og.Model(str(folder))
            entry["load_s"] = time.perf_counter() - start
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            out["folders"][name] = entry
            print(f"genai {name}: {entry['error']}", flush=True)
            continue
        ids = _prompt_tokens(og, model, folder, prompts)
        _greedy(og, model, ids[0], new_tokens)  # warm-up: kernels chosen, memory allocated
        start = time.perf_counter()
        tokens = [_greedy(og, model, p, new_tokens) for p in ids]
        seconds = time.perf_counter() - start
        entry.update(tokens=tokens, seconds=seconds, tokens_per_s=sum(map(len, tokens)) / seconds)
        if baseline is None:
            baseline = entry
        else:
            same = [a == b for x, y in zip(tokens, baseline["tokens"]) for a, b in zip(x, y)]
            entry["token_agreement"] = sum(same) / max(1, len(same))
            entry["identical_sequences"] = sum(x == y for x, y in zip(tokens, baseline["tokens"]))
            entry["speed_vs_baseline"] = entry["tokens_per_s"] / baseline["tokens_per_s"]
        out["folders"][name] = entry
        shown = {k: v for k, v in entry.items() if k not in ("tokens", "folder")}
        print(f"genai {name}: {json.dumps(shown)}", flush=True)
    return out


def latency_ms(path, provider, feed, warmup=10, runs=50):
    from fp8onnx.graph.runtime import median_latency_ms

    return median_latency_ms(session(runnable(path, provider), provider), feed, warmup=warmup, runs=runs)


def gemm_stack(path, d=4096, ffn=11008, blocks=2, seed=0):
    """x[rows, d] -> blocks of (QKV projection, output projection, SwiGLU MLP), random weights."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(seed)
    nodes, inits, cur = [], [], "x"

    def weight(name, k, n):
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), name))
        return name

    for b in range(blocks):
        qkv = f"b{b}_qkv"
        nodes.append(helper.make_node("MatMul", [cur, weight(f"w{b}_qkv", d, 3 * d)], [qkv], name=qkv))
        nodes.append(
            helper.make_node(
                "Split", [qkv], [f"b{b}_q", f"b{b}_k", f"b{b}_v"], name=f"b{b}_split", axis=-1, num_outputs=3
            )
        )
        nodes.append(helper.make_node("Add", [f"b{b}_q", f"b{b}_v"], [f"b{b}_mix"], name=f"b{b}_mix"))
        nodes.append(helper.make_node("MatMul", [f"b{b}_mix", weight(f"w{b}_o", d, d)], [f"b{b}_o"], name=f"b{b}_o"))
        nodes.append(
            helper.make_node("MatMul", [f"b{b}_o", weight(f"w{b}_gate", d, ffn)], [f"b{b}_g"], name=f"b{b}_gate")
        )
        nodes.append(helper.make_node("MatMul", [f"b{b}_o", weight(f"w{b}_up", d, ffn)], [f"b{b}_u"], name=f"b{b}_up"))
        nodes.append(helper.make_node("Sigmoid", [f"b{b}_g"], [f"b{b}_sg"], name=f"b{b}_sig"))
        nodes.append(helper.make_node("Mul", [f"b{b}_g", f"b{b}_sg"], [f"b{b}_silu"], name=f"b{b}_silu"))
        nodes.append(helper.make_node("Mul", [f"b{b}_silu", f"b{b}_u"], [f"b{b}_h"], name=f"b{b}_h"))
        nodes.append(
            helper.make_node("MatMul", [f"b{b}_h", weight(f"w{b}_down", ffn, d)], [f"b{b}_y"], name=f"b{b}_down")
        )
        cur = f"b{b}_y"
    nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "gemm_stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", d])],
        inits,
    )
    save(
        # IR 10 (opset 21's): onnx 1.23 stamps 14 by default, which onnxruntime(-gpu) 1.31 refuses (it reads <= 13)
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10),
        path,
        save_as_external_data=True,
        location=pathlib.Path(path).name + ".data",
    )
    return path


def block_checks(sample, ids, tmp, provider):
    """Step 4: block scales in the CUDA form and per-group activations, placement and logits."""
    import fp8onnx

    recipe = {"preset": "none", "weight_block_size": 32, "activations": "dynamic-per-group", "group_size": 32}
    recipe["gemm_op"] = "qdq"  # the per-axis Q/DQ form (step 6 checks the fast form)
    cuda_form, cpu_form = tmp / "blocks.cuda.onnx", tmp / "blocks.cpu.onnx"
    fp8onnx.quantize(sample / "decoder.onnx", cuda_form, target="onnxruntime-cuda", provider="cpu", **recipe)
    fp8onnx.quantize(sample / "decoder.onnx", cpu_form, provider="cpu", **recipe)
    feed = {"input_ids": ids[:16]}
    got = session(cuda_form, provider).run(None, feed)[0].astype(np.float64)
    ref = session(cpu_form, "cpu").run(None, feed)[0].astype(np.float64)
    fp32 = session(sample / "decoder.onnx", "cpu").run(None, feed)[0].astype(np.float64)
    return {
        "placement": placement(cuda_form, provider, feed, tmp),
        "max_abs_vs_cpu_blocked": float(np.abs(got - ref).max()),
        "rel_l2_vs_cpu_blocked": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        "rel_l2_vs_fp32": float(np.linalg.norm(got - fp32) / np.linalg.norm(fp32)),
        "cpu_blocked_rel_l2_vs_fp32": float(np.linalg.norm(ref - fp32) / np.linalg.norm(fp32)),
        "top1_agreement_vs_cpu_blocked": float((got.argmax(-1) == ref.argmax(-1)).mean()),
    }


def variants(model, calib, tmp, provider, native):
    """FP16 baseline, FP8-QDQ, the fast form (W8A16 with the model's default recipe, W8A8 with static
    activations) and FP8-native versions of ``model`` (FP16 graphs around FP8 GEMMs)."""
    import fp8onnx

    out = {"fp16": tmp / f"{model.stem}.fp16.onnx", "fp8_qdq": tmp / f"{model.stem}.fp8.onnx"}
    fp8onnx.convert_fp16(model, out["fp16"])
    fp8onnx.quantize(model, out["fp8_qdq"], calib, precision="fp16", provider="cpu")
    out["fp8_fast"] = tmp / f"{model.stem}.fast.onnx"
    report = fp8onnx.quantize(model, out["fp8_fast"], calib, target="onnxruntime-cuda", provider="cpu")
    form = report.fast_form
    print(f"  fast form ({report.config.get('preset')}): {len(form['w8a16'])} W8A16, {len(form['w8a8'])} W8A8 nodes")
    out["fp8_fast_w8a8"] = tmp / f"{model.stem}.fast_w8a8.onnx"
    report = fp8onnx.quantize(
        model, out["fp8_fast_w8a8"], calib, target="onnxruntime-cuda", preset="none", provider="cpu"
    )
    print(f"  fast form W8A8: {len(report.fast_form['w8a8'])} W8A8 nodes, kept Q/DQ: {report.fast_form['kept_qdq']}")
    if native:
        out["fp8_native"] = tmp / f"{model.stem}.fp8native.onnx"
        report = fp8onnx.quantize(
            model, out["fp8_native"], calib, precision="fp16", native_gemm=True, provider=provider
        )
        print(f"  native GEMM: {len(report.lowered)} nodes lowered, kept Q/DQ: {report.not_lowered}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--genai", action="append", default=[], metavar="NAME=FOLDER", help="step 7's folders")
    ap.add_argument("--only", choices=("genai",), help="run this step alone")
    args = ap.parse_args()
    genai = dict(item.split("=", 1) for item in args.genai)
    ort = _ort()
    provider = "cpu" if args.cpu_dry_run else "cuda"
    native = not args.cpu_dry_run
    print(f"onnxruntime {ort.__version__}, available providers {ort.get_available_providers()}")
    if provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        sys.exit("no CUDA EP in this onnxruntime")
    sample = REPO / "models" / "decoder"
    results: dict = {"onnxruntime": ort.__version__, "provider": provider}
    if args.only != "genai":
        steps_1_to_6(results, sample, provider, native, args.runs, args.cpu_dry_run)
        _write(results, args.out)  # kept if step 7 takes the process down
    if genai:
        results["genai"] = genai_checks(genai)
    else:
        results["genai"] = {"skipped": "no --genai folders (tests/gpu/stage_genai.py builds them)"}
    _write(results, args.out)


def steps_1_to_6(results: dict, sample, provider: str, native: bool, runs: int, dry_run: bool) -> None:
    import fp8onnx

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        models = variants(sample / "decoder.onnx", sample / "calib.npz", tmp, provider, native)
        ids = np.load(sample / "eval.npz")["input_ids"]
        feed_small = {"input_ids": ids[:4]}
        results["placement"] = {
            k: placement(runnable(p, provider), provider, feed_small, tmp) for k, p in models.items()
        }
        for k, v in results["placement"].items():
            print(f"placement {k}: session providers {v['session_providers']}; nodes {v['nodes']}")
        cmp = fp8onnx.compare(
            sample / "decoder.onnx",
            [models[k] for k in ("fp8_qdq", "fp8_fast", "fp8_fast_w8a8", "fp8_native") if k in models],
            sample / "eval.npz",
            provider=provider,
        )
        print(cmp.table())
        results["accuracy"] = cmp.to_json()
        tokens = {"input_ids": np.tile(ids, (1, 1))[:64]}  # 64 sequences x 64 bytes = 4,096 tokens
        results["decoder_latency_ms"] = {k: latency_ms(p, provider, tokens, runs=runs) for k, p in models.items()}
        stack = gemm_stack(tmp / "stack.onnx", *((512, 1376, 1) if dry_run else ()))
        d = 512 if dry_run else 4096
        rng = np.random.default_rng(1)
        np.savez(tmp / "stack_calib.npz", x=rng.standard_normal((256, d)).astype(np.float32))
        stack_models = variants(stack, tmp / "stack_calib.npz", tmp, provider, native)
        x = {"x": rng.standard_normal((4096 if not dry_run else 256, d)).astype(np.float32)}
        results["stack_latency_ms"] = {k: latency_ms(p, provider, x, runs=runs) for k, p in stack_models.items()}
        decode = {}
        for m in range(1, 9):  # decode: M rows (the fast form's GEMV path for M <= 8)
            xm = {"x": x["x"][:m]}
            decode[m] = {k: latency_ms(p, provider, xm, runs=runs) for k, p in stack_models.items()}
            print(f"decode M={m}: " + ", ".join(f"{k} {v / decode[m]['fp16']:.2f}x" for k, v in decode[m].items()))
        results["stack_decode_ms"] = decode
        results["fast_form"] = fast_form_checks(models, ids, tmp, provider)
        print(f"fast form vs its CPU emulation: {json.dumps(results['fast_form'])}")
        results["blocks"] = block_checks(sample, ids, tmp, provider)
        print(f"blocks (CUDA form, per-group activations): {json.dumps(results['blocks'])}")
    for key in ("decoder_latency_ms", "stack_latency_ms"):
        lat = results[key]
        # latency relative to FP16's (the goal is FP8-native <= 0.7x); below 1 is faster
        ratios = {k: v / lat["fp16"] for k, v in lat.items()}
        results[key.replace("latency_ms", "latency_vs_fp16")] = ratios
        print(f"{key}: " + ", ".join(f"{k} {v:.2f} ms ({ratios[k]:.2f}x FP16's latency)" for k, v in lat.items()))


def _write(results: dict, where) -> None:
    out = pathlib.Path(where)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_checks.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {out / 'gpu_checks.json'}")


if __name__ == "__main__":
    main()
