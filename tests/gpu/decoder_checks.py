"""The GPU check's step on the sample decoder (models/decoder): where its nodes run and what its numbers
are on the EP, for FP16, Q/DQ, the fast form (W8A16 and W8A8) and GemmFloat8.

- placement: every node of each form, from onnxruntime's profiler, counted per execution provider (no
  silent CPU fallback);
- accuracy: ``fp8onnx.compare`` of FP32 vs Q/DQ, the fast form and GemmFloat8 on the eval set;
- the fast form's logits on the EP against fp8onnx's CPU emulation of the op (the CPU EP has no kernel
  for it: the dry run runs the emulation in its place);
- finer than per-channel: weight blocks of 32 in the CUDA EP's per-axis form (``--gemm-op qdq``) with
  per-group activations of 32, where each node runs and its logits against the same recipe's blocked
  form on the CPU EP (bit-identical there; the CUDA EP has no blocked float8 DequantizeLinear).
"""

from __future__ import annotations

import collections
import json
import pathlib
import tempfile

import numpy as np
from gpu_common import ort_module

REPO = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = REPO / "models" / "decoder"


def session(path, provider, profile_dir=None):
    ort = ort_module(cuda=provider == "cuda")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if profile_dir:
        so.enable_profiling = True
        so.profile_file_prefix = str(pathlib.Path(profile_dir) / pathlib.Path(path).stem)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    if provider == "cpu":
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(str(path), so, providers=providers)


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


def _versus(got: np.ndarray, ref: np.ndarray, what: str) -> dict:
    return {
        f"max_abs_vs_{what}": float(np.abs(got - ref).max()),
        f"rel_l2_vs_{what}": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        f"top1_agreement_vs_{what}": float((got.argmax(-1) == ref.argmax(-1)).mean()),
    }


def fast_form_checks(models, ids, provider):
    """The fast form's logits on the EP against fp8onnx's CPU emulation of it."""
    feed = {"input_ids": ids[:16]}
    out = {}
    for key in ("fp8_fast", "fp8_fast_w8a8"):
        got = session(runnable(models[key], provider), provider).run(None, feed)[0].astype(np.float64)
        ref = session(runnable(models[key], "cpu"), "cpu").run(None, feed)[0].astype(np.float64)
        out[key] = _versus(got, ref, "cpu_emulation")
    return out


def block_checks(ids, tmp, provider):
    """Block scales in the CUDA form and per-group activations: placement and logits."""
    import fp8onnx

    recipe = {"preset": "none", "weight_block_size": 32, "activations": "dynamic-per-group", "group_size": 32}
    recipe["gemm_op"] = "qdq"  # the per-axis Q/DQ form (the fast form is checked above)
    cuda_form, cpu_form = tmp / "blocks.cuda.onnx", tmp / "blocks.cpu.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", cuda_form, target="onnxruntime-cuda", provider="cpu", **recipe)
    fp8onnx.quantize(SAMPLE / "decoder.onnx", cpu_form, provider="cpu", **recipe)
    feed = {"input_ids": ids[:16]}
    got = session(cuda_form, provider).run(None, feed)[0].astype(np.float64)
    ref = session(cpu_form, "cpu").run(None, feed)[0].astype(np.float64)
    fp32 = session(SAMPLE / "decoder.onnx", "cpu").run(None, feed)[0].astype(np.float64)
    out = {"placement": placement(cuda_form, provider, feed, tmp), **_versus(got, ref, "cpu_blocked")}
    out["rel_l2_vs_fp32"] = float(np.linalg.norm(got - fp32) / np.linalg.norm(fp32))
    out["cpu_blocked_rel_l2_vs_fp32"] = float(np.linalg.norm(ref - fp32) / np.linalg.norm(fp32))
    return out


def variants(model, calib, tmp, provider, native):
    """FP16, Q/DQ, the fast form (W8A16 with the model's default recipe, W8A8 with static activations)
    and, on CUDA, GemmFloat8 versions of ``model`` (FP16 graphs around FP8 GEMMs)."""
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


def decoder_checks(provider: str) -> dict:
    """Placement, accuracy, the fast form against its emulation and the block forms, on ``provider``."""
    import fp8onnx

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        models = variants(SAMPLE / "decoder.onnx", SAMPLE / "calib.npz", tmp, provider, provider == "cuda")
        ids = np.load(SAMPLE / "eval.npz")["input_ids"]
        feed = {"input_ids": ids[:4]}
        results["placement"] = {k: placement(runnable(p, provider), provider, feed, tmp) for k, p in models.items()}
        for k, v in results["placement"].items():
            print(f"placement {k}: session providers {v['session_providers']}; nodes {v['nodes']}")
        keys = ("fp8_qdq", "fp8_fast", "fp8_fast_w8a8", "fp8_native")
        cmp = fp8onnx.compare(
            SAMPLE / "decoder.onnx", [models[k] for k in keys if k in models], SAMPLE / "eval.npz", provider=provider
        )
        print(cmp.table())
        results["accuracy"] = cmp.to_json()
        results["fast_form"] = fast_form_checks(models, ids, provider)
        print(f"fast form vs its CPU emulation: {json.dumps(results['fast_form'])}")
        results["blocks"] = block_checks(ids, tmp, provider)
        print(f"blocks (CUDA form, per-group activations): {json.dumps(results['blocks'])}")
    return results
