"""fp8onnx next to onnxruntime.quantization's FP8 mode, on the same model and data, in one run.

Per tool, each quantize step in its own process (wall time and peak RSS of that process): output
size, accuracy against FP32 and FP16 (the `compare` metrics), and CPU inference latency. Also the
floor: one plain FP32 onnxruntime pass over the same calibration data. Ratios fp8onnx/peer are
what to read: absolute times depend on the machine, which the report describes.

The peer is run the way its documentation shows for FP8: QDQ format, QFLOAT8E4M3FN activations and
weights, its Distribution calibration (the only one its FP8 mode accepts), MatMul and Gemm only.

Usage: python tests/bench/peers.py MODEL CALIB.npz EVAL.npz [--name NAME] [--out DIR] [--batch-size 16]
Writes DIR/NAME.json and DIR/NAME.md (default DIR: bench-results/).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

# Each tool runs in a child process; the parent reads the child's peak RSS from RUSAGE_CHILDREN.
_CHILD = """
import resource, sys, time, json
t0 = time.perf_counter()
{body}
print(json.dumps({{"wall_s": time.perf_counter() - t0,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""

_FP8ONNX = """
import fp8onnx
fp8onnx.quantize(sys.argv[1], sys.argv[2], sys.argv[3], batch_size=int(sys.argv[4]), provider="cpu")
"""

_PEER = """
import numpy as np
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)

class Reader(CalibrationDataReader):
    def __init__(self, path, batch, full_only):
        data = np.load(path)
        keys = [k for k in data.files if not k.startswith("_") and k != "labels"]
        n = len(data[keys[0]])
        n = n - n % batch if full_only else n
        self.feeds = iter([{k: data[k][i:i + batch] for k in keys} for i in range(0, n, batch)])
    def get_next(self):
        return next(self.feeds, None)

reader = Reader(sys.argv[3], int(sys.argv[4]), FULL_ONLY)
quantize_static(sys.argv[1], sys.argv[2], reader, quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                calibrate_method=CalibrationMethod.Distribution, op_types_to_quantize=["MatMul", "Gemm"])
"""

_FLOOR = """
import numpy as np, onnxruntime as ort
data = np.load(sys.argv[3])
names = [i.name for i in ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"]).get_inputs()]
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
n, b = len(data[names[0]]), int(sys.argv[4])
for i in range(0, n, b):
    sess.run(None, {k: data[k][i:i + b] for k in names})
"""


def run_child(body: str, model: str, out: str, calib: str, batch: int) -> dict:
    code = _CHILD.format(body=body.strip())
    proc = subprocess.run([sys.executable, "-c", code, model, out, calib, str(batch)], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def latency_ms(path: str, feed: dict, runs: int = 20) -> float:
    from fp8onnx.runtime import make_session, median_latency_ms

    return median_latency_ms(make_session(path, "cpu"), feed, runs=runs)


def machine() -> str:
    import onnxruntime as ort

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
        platform.processor(),
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    python = platform.python_version()
    return f"{os.cpu_count()} cores {cpu}, {mem:.0f} GiB, onnxruntime {ort.__version__} CPU, Python {python}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("data")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    import fp8onnx

    name = args.name or pathlib.Path(args.model).stem
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "machine": machine(), "tools": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"fp8onnx": os.path.join(tmp, "fp8onnx.onnx"), "onnxruntime": os.path.join(tmp, "ort.onnx")}
        result["floor_fp32_pass"] = run_child(_FLOOR, args.model, "", args.calib, args.batch_size)
        for tool, body in (("fp8onnx", _FP8ONNX), ("onnxruntime", _PEER.replace("FULL_ONLY", "False"))):
            stats = run_child(body, args.model, paths[tool], args.calib, args.batch_size)
            if tool == "onnxruntime" and "error" in stats:
                # It fails on a short last batch (SPEC §7); give it whole batches only and say so.
                first_error = stats["error"]
                stats = run_child(
                    _PEER.replace("FULL_ONLY", "True"), args.model, paths[tool], args.calib, args.batch_size
                )
                stats["note"] = f"failed with all calibration samples ({first_error}); rerun on whole batches only"
            if "error" not in stats:
                stats["size_mb"] = os.path.getsize(paths[tool]) / 1e6
            result["tools"][tool] = stats
        ok = [t for t, s in result["tools"].items() if "error" not in s]
        cmp = fp8onnx.compare(args.model, [paths[t] for t in ok], args.data, batch_size=args.batch_size, provider="cpu")
        with np.load(args.data) as npz:
            feed = {i: npz[i][: args.batch_size] for i in npz.files if not i.startswith("_") and i != "labels"}
        result["fp32_latency_ms"] = latency_ms(args.model, feed)
        for row in cmp.rows[2:]:
            tool = next(t for t in ok if paths[t] == row.path)
            first = next(iter(row.outputs.values()))
            result["tools"][tool].update(
                accuracy=row.value,
                metric=row.headline,
                ratio_to_fp16=row.ratio_to_fp16,
                cosine_mean=first["cosine_mean"],
                latency_ms=latency_ms(paths[tool], feed),
            )
        result["fp16_metric"] = cmp.rows[1].value
        result["fp32_metric"] = cmp.rows[0].value
        result["fp32_size_mb"] = os.path.getsize(args.model) / 1e6
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(name, result)
    (out_dir / f"{name}.md").write_text(md)
    print(md)


def markdown(name: str, r: dict) -> str:
    a, b = r["tools"]["fp8onnx"], r["tools"]["onnxruntime"]

    def cell(d, key, spec):
        return "-" if key not in d or d[key] is None else format(d[key], spec)

    def ratio(key):
        if key not in a or key not in b or not b.get(key):
            return "-"
        return f"{a[key] / b[key]:.2f}"

    rows = [
        ("quantize wall s", "wall_s", ".1f"),
        ("quantize peak RSS MiB", "peak_rss_mib", ".0f"),
        ("output MB", "size_mb", ".2f"),
        ("mean cosine vs FP32", "cosine_mean", ".5f"),
    ]
    if "cosine" not in a.get("metric", "cosine"):
        rows.append((a["metric"], "accuracy", ".4f"))
    rows += [("vs FP16", "ratio_to_fp16", ".2%"), ("CPU latency ms (batch)", "latency_ms", ".1f")]
    lines = [
        f"### {name}",
        "",
        f"{r['machine']}; FP32 {r['fp32_size_mb']:.2f} MB, FP32 latency "
        f"{r['fp32_latency_ms']:.1f} ms, FP32 pass over the calibration data (the floor) "
        f"{cell(r['floor_fp32_pass'], 'wall_s', '.1f')} s / {cell(r['floor_fp32_pass'], 'peak_rss_mib', '.0f')} MiB",
        "",
        "| | fp8onnx | onnxruntime FP8 | fp8onnx / onnxruntime |",
        "|---|---|---|---|",
    ]
    for label, key, spec in rows:
        lines.append(
            f"| {label} | {cell(a, key, spec)} | {cell(b, key, spec)} | {ratio(key) if spec != '.2%' else '-'} |"
        )
    for tool, stats in r["tools"].items():
        if "error" in stats:
            lines.append(f"\n{tool} failed: {stats['error']}")
        if "note" in stats:
            lines.append(f"\n{tool}: {stats['note']}")
    floor = r["floor_fp32_pass"].get("wall_s")
    if floor and "wall_s" in a:
        lines.append(f"\nfp8onnx quantize / FP32 pass over the calibration data: {a['wall_s'] / floor:.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
