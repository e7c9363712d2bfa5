"""Measured per-batch costs of calibration on one model, scaled on paper to N Ray workers.

    python tests/bench/ray_estimate.py MODEL CALIB [--samples 1000000] [--workers 1 8 64] [--runs 3]

Measures, on this machine, one calibration batch of the whole graph (no layer-by-layer split) with 1
and with 2 onnxruntime threads, both for quantize's statistics (amax) and calibrate's (amax and
histograms: the summary a worker sends back, and what merging it costs here), and the scheduling
cost of one batch on a local Ray pool. The estimate for S samples on N one-thread workers is

    startup + max(S / batch * t_batch(1 thread) / N,  S / batch * (schedule + merge))

(the driver hands out and merges batches one at a time, so it bounds the speed-up). It is an
estimate: it assumes the cluster's cores are as fast as this machine's and its network moves a
batch (16 x 128 token ids: 16 KB) and a summary in less time than a batch takes to compute.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.graph.plan import candidate_activations
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.graph.runtime import portable_model, session_from_portable
from fp8onnx.passes.common import keep_only_outputs
from fp8onnx.pipeline.statistics import Ranges, reduce_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--startup", type=float, default=30.0, help="seconds to start a cluster's workers (assumed)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, _, _ = prepare_model(args.model)
    names = candidate_activations(model)
    source = as_data(args.calib, input_specs(model), model)
    feed = next(iter(source.batches(args.batch))).feed
    result = {"model": args.model, "batch": args.batch, "tensors": len(names)}
    for mode, histograms in (("amax", False), ("histograms", True)):
        inst = model.clone()
        outputs = Ranges(names, histograms).instrument(inst, "")  # what a calibration pass adds
        keep_only_outputs(inst, outputs)
        portable = portable_model(inst)
        for threads in (1, 2):
            session = session_from_portable(portable, "cpu", "model", arena=False, instrumented=True, threads=threads)
            session.run(outputs, feed)
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                values = session.run(outputs, feed)
                times.append(time.perf_counter() - t0)
            result[f"{mode}_batch_s_{threads}t"] = round(statistics.median(times), 3)
            del session
        t0 = time.perf_counter()
        summary = reduce_batch(dict(zip(outputs, values)))  # on the worker
        result[f"{mode}_summarize_s"] = round(time.perf_counter() - t0, 3)
        result[f"{mode}_summary_kib"] = round(len(pickle.dumps(summary)) / 1024, 1)
        running = Ranges(names, histograms)
        t0 = time.perf_counter()
        running.merge(summary)  # on the driver, in batch order
        result[f"{mode}_merge_ms"] = round(1e3 * (time.perf_counter() - t0), 2)
        del values
        print(json.dumps(result), flush=True)
    from workers import scheduling_cost  # tests/bench/workers.py

    sched = scheduling_cost(2)
    result["schedule_ms"] = sched["per_batch_ms"]
    result["local_pool_start_s"] = sched["pool_start_s"]
    batches = -(-args.samples // args.batch)
    rows = []
    for mode in ("amax", "histograms"):
        t1 = result[f"{mode}_batch_s_1t"] + result[f"{mode}_summarize_s"]
        driver = (result["schedule_ms"] + result[f"{mode}_merge_ms"]) / 1e3
        for n in args.workers:
            compute = batches * t1 / n
            total = args.startup + max(compute, batches * driver)
            rows.append(
                {
                    "mode": mode,
                    "workers": n,
                    "hours": round(total / 3600, 2),
                    "driver_bound": batches * driver > compute,
                }
            )
    result["estimate"] = rows
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
