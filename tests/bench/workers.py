"""Ray workers against one process, in one run: wall time, and whether the outputs are the same bytes.

    python tests/bench/workers.py NAME:MODEL:CALIB:EVAL [...] [--workers 2] [--json out.json]

For each model: ``fp8onnx quantize`` and ``fp8onnx compare`` (each in its own process, as a user
runs them, start-up of Ray and its workers included) with one process and with ``--workers N``;
the quantized files and the compare JSON are compared byte for byte. Then the scheduling cost of one
batch: a pool of N workers maps a task that does nothing over 400 small batches, against the same
loop in this process. Ratios, not absolute times: this machine's cores bound any speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _noop(session, feed):
    return len(feed)


def _no_session(model, threads):
    return None


def scheduling_cost(workers: int, items: int = 400) -> dict:
    from fp8onnx.pipeline.distributed import WorkerPool

    feeds = [{"x": np.zeros((16, 64), np.float32)} for _ in range(items)]
    t0 = time.perf_counter()
    for f in feeds:
        _noop(None, f)
    local = time.perf_counter() - t0
    t0 = time.perf_counter()
    with WorkerPool(workers=workers) as pool:
        started = time.perf_counter() - t0
        pool.load(b"", _no_session)
        t1 = time.perf_counter()
        list(pool.map(_noop, ((f,) for f in feeds)))
        mapped = time.perf_counter() - t1
    return {
        "workers": workers,
        "batches": items,
        "pool_start_s": round(started, 2),
        "per_batch_ms": round(1e3 * mapped / items, 3),
        "per_batch_local_ms": round(1e3 * local / items, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="NAME:MODEL:CALIB:EVAL")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    exe = [sys.executable, "-m", "fp8onnx.cli"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for spec in args.models:
            name, model, calib, data = spec.split(":")
            row = {"model": name}
            for label, extra in (("one", []), ("workers", ["--workers", str(args.workers)])):
                (tmp / label).mkdir(exist_ok=True)
                out = tmp / label / f"{name}.onnx"  # one name: an external-data file's name is in the graph
                row[f"quantize_{label}_s"] = round(
                    timed([*exe, "quantize", model, "--calib", calib, "-o", str(out), *extra]), 2
                )
                cmp_json = tmp / f"{name}.{label}.json"
                row[f"compare_{label}_s"] = round(
                    timed([*exe, "compare", model, str(out), "--data", data, "--json", str(cmp_json), *extra]), 2
                )
            row["quantize_identical"] = all(
                (tmp / "one" / f.name).read_bytes() == f.read_bytes() for f in (tmp / "workers").glob(f"{name}.onnx*")
            )
            one, two = (json.loads((tmp / f"{name}.{x}.json").read_text()) for x in ("one", "workers"))
            for doc in (one, two):  # the candidate's folder differs between the two runs
                for r in doc["rows"]:
                    r.pop("path", None)
            row["compare_identical"] = one == two
            row["quantize_ratio"] = round(row["quantize_workers_s"] / row["quantize_one_s"], 2)
            row["compare_ratio"] = round(row["compare_workers_s"] / row["compare_one_s"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    sched = scheduling_cost(args.workers)
    print(json.dumps(sched), flush=True)
    result = {"cpus": os.cpu_count(), "rows": rows, "scheduling": sched}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
