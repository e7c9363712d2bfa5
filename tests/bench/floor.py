"""How close `fp8onnx quantize` is to the floor: one FP32 onnxruntime pass over the calibration data
plus one read and one write of the model, in one run per model.

Per model, each in its own process (wall time and peak RSS from wait4, median of --repeat runs):
  floor     import numpy and onnxruntime, read the model file (and its external data) and write a
            copy, one InferenceSession, one run per batch of the calibration data (same batch size);
  quantize  `fp8onnx -v quantize MODEL --calib CALIB -o OUT` with defaults (and the options after --);
then the median quantize run's phase table (``-v``; the startup row is the process's time before
the command started: interpreter and imports; the rest of the wall time is the summary and exit),
and the ratios quantize / floor for wall time and peak RSS, and peak RSS / the FP32 model's size.

Usage: python tests/bench/floor.py [decoder] [all-MiniLM-L6-v2] [llama-1b-random] [NAME:MODEL:CALIB ...]
       [--repeat N] [--json out.json] [--keep DIR] [-- extra quantize options]
``--keep DIR`` writes each model's quantized copy to ``DIR/NAME.onnx`` (the last run's) instead of a temporary
folder, for the accuracy runs that follow: a large model is then quantized once, not twice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import _FLOOR as _FP32_PASS
from peers import SUITE, file_size, machine, median_run

# peers' floor (one FP32 pass over the calibration data) plus one read and one write of the model
_FLOOR = (
    _FP32_PASS
    + """
import os, tempfile
with tempfile.TemporaryDirectory() as tmp:
    for src in (model, model + ".data"):
        if os.path.exists(src):
            with open(src, "rb") as f:
                blob = f.read()
            with open(os.path.join(tmp, os.path.basename(src)), "wb") as f:
                f.write(blob)
            del blob
"""
)

BATCH = 16  # fp8onnx's default --batch-size


def cases(names: list[str]) -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    out = []
    for name in names:
        if name in SUITE:
            model, calib, *_ = SUITE[name]
            out.append((name, pathlib.Path(model), pathlib.Path(calib)))
        else:
            label, model, calib = name.split(":")
            out.append((label, pathlib.Path(model), pathlib.Path(calib)))
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["decoder", "all-MiniLM-L6-v2"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--keep", type=pathlib.Path, help="write each quantized model to DIR/NAME.onnx")
    args = ap.parse_args(argv)
    limits = {"memory_limit_gib": 20.0, "timeout_s": 3600.0}
    print(machine())
    results = []
    for name, model, calib in cases(args.models):
        if not model.exists():
            print(f"[{name}] {model} is missing; build it first")
            continue
        size_mib = file_size(model) / 2**20
        floor = median_run([sys.executable, "-c", _FLOOR, str(model), str(calib), str(BATCH)], args.repeat, **limits)
        with tempfile.TemporaryDirectory() as tmp:
            out = args.keep / f"{name}.onnx" if args.keep else pathlib.Path(tmp) / "q.onnx"
            # -v prints the phase table (no --report: its sensitivity section is a pass of its own)
            cmd = [sys.executable, "-m", "fp8onnx.cli", "-v", "quantize", str(model), "--calib", str(calib)]
            cmd += ["-o", str(out), *extra]
            runs = []
            for _ in range(args.repeat):  # keep each run's phase table: the median run's is shown
                run = median_run(cmd, 1, keep_stdout=True, **limits)
                if "error" in run:
                    raise SystemExit(f"[{name}] quantize failed: {run['error']}")
                lines = run.pop("stdout").splitlines()
                first = next(i for i, ln in enumerate(lines) if ln.strip().startswith("phase"))
                last = next(i for i, ln in enumerate(lines) if ln.strip().startswith("total") and i > first)
                run["phases"] = "\n".join(lines[first : last + 1])
                runs.append(run)
            q = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
        row = {
            "model": name,
            "options": extra,  # the quantize options after --
            "calibration": str(calib),
            "fp32_mib": size_mib,
            "floor": {k: floor[k] for k in ("wall_s", "peak_rss_mib", "runs_wall_s")},  # the median run's
            "quantize": {"wall_s": q["wall_s"], "peak_rss_mib": q["peak_rss_mib"], "phases": q["phases"]},
            "runs_wall_s": [r["wall_s"] for r in runs],
            "time_ratio": q["wall_s"] / floor["wall_s"],
            "rss_ratio": q["peak_rss_mib"] / floor["peak_rss_mib"],
            "rss_over_model": q["peak_rss_mib"] / size_mib,
        }
        results.append(row)
        print(f"\n## {name} ({size_mib:.0f} MiB FP32; calibration {calib.name}, batch {BATCH})")
        print(
            f"floor {floor['wall_s']:.2f} s, {floor['peak_rss_mib']:.0f} MiB; quantize {q['wall_s']:.2f} s, "
            f"{q['peak_rss_mib']:.0f} MiB -> time {row['time_ratio']:.2f}x the floor, peak RSS "
            f"{row['rss_ratio']:.2f}x the floor's and {row['rss_over_model']:.2f}x the model's size"
        )
        print(q["phases"])
    if args.json:
        doc = {"machine": machine(), "date": datetime.date.today().isoformat(), "results": results}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
