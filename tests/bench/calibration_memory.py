"""Peak RSS of calibration as the number of calibration samples grows (SPEC §4: flat).

Each run is its own process (``ru_maxrss`` of the child), on the same model, with the calibration
set tiled to N samples. Prints a table and the ratio of the largest to the smallest run.
``--command calibrate`` (default) records amax and |x| histograms of every MatMul/Gemm activation;
``--command quantize`` runs `fp8onnx quantize` with amax scaling (in-graph amax scalars only).

Usage: python tests/bench/calibration_memory.py MODEL CALIB.npz [--samples 128 1024] [--batch-size 16]
       [--command calibrate|quantize]
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np


def tiled(calib: pathlib.Path, n: int, out: pathlib.Path) -> pathlib.Path:
    with np.load(calib, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files if not k.startswith("_")}
    count = len(next(iter(arrays.values())))
    idx = np.arange(n) % count
    np.savez(out, **{k: v[idx] for k, v in arrays.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("--samples", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--command", choices=["calibrate", "quantize"], default="calibrate")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size; the median peak is compared")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.samples:
            data = tiled(pathlib.Path(args.calib), n, pathlib.Path(tmp) / f"calib{n}.npz")
            out_name = f"stats{n}.json" if args.command == "calibrate" else f"model{n}.onnx"
            inner = [
                sys.executable,
                "-m",
                "fp8onnx.cli",
                args.command,
                args.model,
                "--calib",
                str(data),
                "-o",
                str(pathlib.Path(tmp) / out_name),
                "--batch-size",
                str(args.batch_size),
                "--provider",
                "cpu",
            ]
            # A wrapper process per run, so that ru_maxrss belongs to that run alone.
            probe = (
                "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
            )
            peaks, secs = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", probe, *inner], capture_output=True, text=True, check=True)
                secs.append(time.perf_counter() - t0)
                peaks.append(int(out.stdout.strip()) / 1024)
            rows.append((n, peaks, float(np.median(secs))))
    print(f"fp8onnx {args.command}, model {args.model}, batch size {args.batch_size}")
    print(f"{'samples':>8}  {'median peak RSS MiB':>19}  {'all runs':>24}  {'median wall s':>13}")
    for n, peaks, secs in rows:
        runs = " ".join(f"{p:.0f}" for p in peaks)
        print(f"{n:>8}  {np.median(peaks):>19.1f}  {runs:>24}  {secs:>13.1f}")
    ratio = np.median(rows[-1][1]) / np.median(rows[0][1])
    print(f"peak RSS ratio {rows[-1][0]} vs {rows[0][0]} samples (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
