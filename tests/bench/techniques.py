"""Each accuracy technique of `fp8onnx quantize` against plain amax, on real models, in one run.

Per model: every technique is quantized in its own subprocess (wall time and peak RSS of that
process), then all outputs are evaluated in one `fp8onnx compare` run (the FP32 reference and the
FP16 baseline run once). Printed per technique: the headline metric relative to FP16, mean cosine
and top-1 agreement with FP32, the file size relative to FP32, and quantize time and peak RSS
relative to plain amax (the same model, the same calibration data); with next-token ``labels`` in
the eval data also each model's perplexity (from the same `compare` run), FP16's on its own row.

Usage: python tests/bench/techniques.py NAME:MODEL:CALIB:EVAL [...] [--techniques amax per-token ...]
       [--exclude-vocab] [--skip NAME:TECHNIQUE ...] [--json out.json] [--timing-only]

With --timing-only: no accuracy; quantize time per technique and onnxruntime CPU latency of one
batch of 4 eval rows (median of 5 after a warm-up), against FP32's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

# label -> quantize options (CLI); "{calib}" is replaced by the calibration data
TECHNIQUES = {
    "amax": ["--calib", "{calib}"],
    "amax per-channel": ["--calib", "{calib}", "--per-channel"],
    "dynamic": ["--activations", "dynamic"],
    "per-token": ["--activations", "dynamic-per-token"],
    "weight-only": ["--activations", "none"],
    "amax + fp8 embeddings": ["--calib", "{calib}", "--embeddings", "fp8"],
    "per-token + fp8 embeddings": ["--activations", "dynamic-per-token", "--embeddings", "fp8"],
    "amax + smooth 0.5": ["--calib", "{calib}", "--smooth", "0.5"],
    "amax + bias correction": ["--calib", "{calib}", "--bias-correction"],
    "amax + gptq": ["--calib", "{calib}", "--weight-rounding", "gptq"],
    "amax + smooth + gptq": ["--calib", "{calib}", "--smooth", "0.5", "--weight-rounding", "gptq"],
    "per-token + gptq": ["--calib", "{calib}", "--activations", "dynamic-per-token", "--weight-rounding", "gptq"],
    "per-token + smooth + gptq": [
        "--calib",
        "{calib}",
        "--activations",
        "dynamic-per-token",
        "--smooth",
        "0.5",
        "--weight-rounding",
        "gptq",
    ],
    "weight-only + gptq": ["--calib", "{calib}", "--activations", "none", "--weight-rounding", "gptq"],
    # granularity (issue "Finer than per-channel"), without a preset: static per-tensor and per-channel,
    # per-token activations with per-channel weights or weight blocks of N along K, per-group
    # activations (1 x 32 tiles) with 32-blocks, and MXFP8 (the same with power-of-two scales)
    "g per-tensor": ["--preset", "none", "--calib", "{calib}"],
    "g per-channel": ["--preset", "none", "--calib", "{calib}", "--per-channel"],
    "g per-token": ["--preset", "none", "--activations", "dynamic-per-token"],
    "g block 128": ["--preset", "none", "--activations", "dynamic-per-token", "--weight-block-size", "128"],
    "g block 64": ["--preset", "none", "--activations", "dynamic-per-token", "--weight-block-size", "64"],
    "g block 32": ["--preset", "none", "--activations", "dynamic-per-token", "--weight-block-size", "32"],
    "g per-group 32": ["--preset", "none", "--activations", "dynamic-per-group", "--group-size", "32"]
    + ["--weight-block-size", "32"],
    "g mxfp8": ["--preset", "none", "--format", "mxfp8"],
    "g mxfp8 weight-only": ["--preset", "none", "--format", "mxfp8", "--activations", "none"],
    # the same for a CNN, Conv included (static activations; MXFP8's Conv inputs take one dynamic
    # power-of-two scale per tensor: per-group scales run along the last axis, a Conv's W)
    "conv per-tensor": ["--preset", "none", "--calib", "{calib}", "--op-types", "MatMul,Gemm,Conv", "--per-tensor"],
    "conv per-channel": ["--preset", "none", "--calib", "{calib}", "--op-types", "MatMul,Gemm,Conv", "--per-channel"],
    "conv block 32": ["--preset", "none", "--calib", "{calib}", "--op-types", "MatMul,Gemm,Conv"]
    + ["--weight-block-size", "32"],
    "conv block 16": ["--preset", "none", "--calib", "{calib}", "--op-types", "MatMul,Gemm,Conv"]
    + ["--weight-block-size", "16"],
    "conv mxfp8": ["--preset", "none", "--format", "mxfp8", "--op-types", "MatMul,Gemm,Conv"],
    # the finest recipe with FP8 activations: a preset's techniques with per-group scales and blocks of 16
    "encoder + group 16 + block 16": ["--calib", "{calib}", "--preset", "encoder"]
    + ["--activations", "dynamic-per-group", "--group-size", "16", "--weight-block-size", "16"],
    "llm + group 32 + block 32": ["--calib", "{calib}", "--preset", "llm"]
    + ["--activations", "dynamic-per-group", "--group-size", "32", "--weight-block-size", "32"],
    "llm + group 16 + block 16": ["--calib", "{calib}", "--preset", "llm"]
    + ["--activations", "dynamic-per-group", "--group-size", "16", "--weight-block-size", "16"],
    "preset llm": ["--calib", "{calib}", "--preset", "llm"],
    "preset encoder": ["--calib", "{calib}", "--preset", "encoder"],
    "preset cnn": ["--calib", "{calib}", "--preset", "cnn"],
}


def quantize(model, out, calib, options, exclude) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one `fp8onnx quantize` in its own process."""
    args = [a.format(calib=calib) for a in options] + [x for name in exclude for x in ("--exclude", name)]
    code = (
        "import sys, time\nfrom fp8onnx.cli import main\nt0 = time.perf_counter()\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        # VmHWM (KiB): this process's own peak; ru_maxrss would carry the parent's over the exec
        "rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print('BENCH', time.perf_counter() - t0, rss, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "quantize", str(model), "-o", str(out), *args], capture_output=True, text=True
    )
    if proc.returncode:
        said = [x for x in proc.stderr.strip().splitlines() if not x.startswith("BENCH")]
        raise SystemExit(f"quantize {options} failed: {said[-1] if said else proc.returncode}")
    line = next(x for x in proc.stderr.splitlines() if x.startswith("BENCH"))
    _, seconds, rss_kib = line.split()
    return float(seconds), float(rss_kib) / 1024


def size(path: pathlib.Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def latency_ms(path, eval_data, batch: int = 4, repeat: int = 5) -> float:
    """Median onnxruntime CPU time of one batch of the eval data (``batch`` rows) after a warm-up run,
    with the session options compare uses (fp8onnx.graph.runtime.make_session)."""
    import numpy as np

    from fp8onnx.graph.runtime import make_session, median_latency_ms

    session = make_session(str(path), "cpu")
    data = np.load(eval_data)
    names = {i.name for i in session.get_inputs()}
    return median_latency_ms(session, {k: data[k][:batch] for k in data.files if k in names}, warmup=1, runs=repeat)


def timing(name, model, calib, eval_data, techniques, exclude, tmp) -> list[dict]:
    """Quantize time (each in its own process) and CPU latency per technique, no accuracy: for a quiet
    machine after an accuracy run. Ratios: time to the first technique's, latency to FP32's."""
    fp32 = latency_ms(model, eval_data)
    rows = []
    for label in techniques:
        out = tmp / f"{len(rows)}.onnx"
        seconds, rss = quantize(model, out, calib, TECHNIQUES[label], exclude)
        ms = latency_ms(out, eval_data)
        rows.append({"model": name, "technique": label, "seconds": seconds, "rss_mib": rss, "latency_ms": ms})
        print(f"  {name}: {label}: {seconds:.1f} s, {rss:.0f} MiB, {ms:.1f} ms", file=sys.stderr, flush=True)
    for r in rows:
        r.update(time_ratio=r["seconds"] / rows[0]["seconds"], latency_ratio=r["latency_ms"] / fp32, fp32_ms=fp32)
    return rows


def vocabulary_exclusions(model) -> list[str]:
    from fp8onnx.accuracy.sensitivity import vocabulary_projections
    from fp8onnx.graph.prepare import prepare_model

    ir_model = prepare_model(model, "model")[0]
    nodes = [n for n in ir_model.graph if n.op_type in ("MatMul", "Gemm")]
    return sorted(vocabulary_projections(ir_model, nodes))


def bench(name, model, calib, eval_data, techniques, exclude_vocab, tmp) -> list[dict]:
    import fp8onnx

    exclude = vocabulary_exclusions(model) if exclude_vocab else []
    rows = []
    for label in techniques:
        out = tmp / f"{len(rows)}.onnx"
        seconds, rss = quantize(model, out, calib, TECHNIQUES[label], exclude)
        rows.append({"model": name, "technique": label, "file": out, "seconds": seconds, "rss_mib": rss})
        print(f"  {name}: {label}: {seconds:.1f} s, {rss:.0f} MiB", file=sys.stderr, flush=True)
    result = fp8onnx.compare(model, [r["file"] for r in rows], eval_data, provider="cpu")
    by_file = {r.name: r for r in result.rows}
    fp32_bytes = size(pathlib.Path(model))
    fp32_ms = next((r.latency_ms for r in result.rows if r.name.startswith("FP32")), None)
    base = rows[0]
    for r in rows:
        row = by_file[r["file"].name]
        first = next(iter(row.outputs.values()))
        r.update(
            ratio_to_fp16=row.ratio_to_fp16,
            headline=row.headline,
            cosine=first["cosine_mean"],
            top1=first["top1_agreement"],
            size_ratio=size(r["file"]) / fp32_bytes,
            time_ratio=r["seconds"] / base["seconds"],
            rss_ratio=r["rss_mib"] / base["rss_mib"],
            perplexity=row.perplexity,
            latency_ratio=None if row.latency_ms is None or fp32_ms is None else row.latency_ms / fp32_ms,
            excluded=exclude,
        )
    fp16 = by_file.get("FP16")
    if fp16 is not None and fp16.perplexity is not None:
        rows.append({"model": name, "technique": "FP16", "perplexity": fp16.perplexity})
    for r in rows:
        r.pop("file", None)
    return rows


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", metavar="NAME:MODEL:CALIB:EVAL")
    ap.add_argument("--techniques", nargs="+", default=list(TECHNIQUES), choices=list(TECHNIQUES))
    ap.add_argument("--exclude-vocab", action="store_true", help="leave vocabulary projections (lm_head) in float")
    ap.add_argument("--skip", nargs="*", default=[], metavar="NAME:TECHNIQUE", help="combinations not to run")
    ap.add_argument("--json")
    ap.add_argument("--timing-only", action="store_true", help="quantize time and CPU latency only, no accuracy")
    args = ap.parse_args()
    print(f"started {time.strftime('%Y-%m-%d %H:%M')}", file=sys.stderr)
    rows = []
    for case in args.cases:
        name, model, calib, eval_data = case.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            techniques = [t for t in args.techniques if f"{name}:{t}" not in args.skip]
            if args.timing_only:
                exclude = vocabulary_exclusions(model) if args.exclude_vocab else []
                rows += timing(name, model, calib, eval_data, techniques, exclude, pathlib.Path(tmp))
                continue
            rows += bench(name, model, calib, eval_data, techniques, args.exclude_vocab, pathlib.Path(tmp))
    head = (
        f"{'model':<10} {'technique':<27} {'vs FP16':>8} {'cosine':>8} {'top-1':>6} {'ppl':>6} {'size':>5} "
        f"{'time':>5} {'RSS':>5} {'CPU ms':>6}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['model']:<10} {r['technique']:<27} {_f(r.get('ratio_to_fp16'), '.2%'):>8} "
            f"{_f(r.get('cosine'), '.5f'):>8} {_f(r.get('top1'), '.3f'):>6} {_f(r.get('perplexity'), '.2f'):>6} "
            f"{_f(r.get('size_ratio'), '.2f'):>5} {_f(r.get('time_ratio'), '.2f'):>5} "
            f"{_f(r.get('rss_ratio'), '.2f'):>5} {_f(r.get('latency_ratio'), '.2f'):>6}"
        )
    print(
        "vs FP16: headline metric / FP16's; size: file / FP32 file (scales included); time, RSS: quantize relative "
        "to the first technique; CPU ms: onnxruntime CPU time per batch / FP32's (compare's median)"
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
