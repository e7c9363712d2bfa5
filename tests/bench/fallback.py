"""The accuracy-target fallback on real models: what it keeps in float, what it costs, whether it holds.

Per model: its calibration data and two disjoint evaluation sets (``models/split_eval.py`` cuts an
``eval.npz`` into halves); the search sees only the first, and the chosen model is then measured on
the second. In one run, per model:

* a plain ``quantize`` (the cost unit) and its headline metric relative to FP16 on both halves;
* ``quantize --accuracy-target T`` for each target (99.5 and 99 by default), with and without
  ``--refine N``: nodes kept in float, models evaluated, wall time relative to the plain quantize,
  and the metric reached on the search half and on the held-out half.

Usage: python tests/bench/fallback.py MODEL:CALIB:SEARCH:HOLDOUT [...] [--targets 99.5 99] [--refine 0 4]
       [--op-types MatMul,Gemm] [--json out.json]
``--op-types`` applies to every model (e.g. MatMul,Gemm,Conv).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import fp8onnx
from fp8onnx.workflows.fallback import TargetNotMet, quantize_to_target


def ratio(model, candidate, data) -> float | None:
    return fp8onnx.compare(model, [candidate], data, provider="cpu", progress=False).rows[-1].ratio_to_fp16


def bench(model, calib, search, holdout, targets, refines, op_types, tmp: pathlib.Path) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    fp8onnx.quantize(model, tmp / "plain.onnx", calib, op_types=op_types, provider="cpu", progress=False)
    plain = time.perf_counter() - t0
    base = {"model": model, "target": None, "refine": None, "seconds": plain, "x_plain": 1.0, "kept": 0}
    base.update(
        search_ratio=ratio(model, tmp / "plain.onnx", search), holdout_ratio=ratio(model, tmp / "plain.onnx", holdout)
    )
    rows.append(base)
    for target in targets:
        for refine in refines:
            out = tmp / f"t{target}-r{refine}.onnx"
            t0 = time.perf_counter()
            row = {"model": model, "target": target, "refine": refine}
            try:
                result = quantize_to_target(
                    model,
                    out,
                    calib,
                    search,
                    target=target,
                    refine=refine,
                    op_types=op_types,
                    provider="cpu",
                    progress=False,
                )
            except TargetNotMet as e:
                result, met = e.result, False
            else:
                met = True
            row["seconds"] = time.perf_counter() - t0
            row["x_plain"] = row["seconds"] / plain
            row.update(met=met, kept=len(result.kept_in_float), kept_in_float=result.kept_in_float)
            row.update(evaluations=result.evaluations, tried={str(k): v for k, v in sorted(result.tried.items())})
            row["search_ratio"] = result.tried[len(result.kept_in_float)]
            row["holdout_ratio"] = ratio(model, out, holdout) if met else None
            rows.append(row)
    return rows


def _pct(v) -> str:
    return "-" if v is None else f"{v:.2%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", metavar="MODEL:CALIB:SEARCH:HOLDOUT")
    ap.add_argument("--targets", type=float, nargs="+", default=[99.5, 99.0])
    ap.add_argument("--refine", type=int, nargs="+", default=[0], help="values of --refine to run (0: SQNR order)")
    ap.add_argument("--op-types", default="MatMul,Gemm")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for case in args.cases:
        model, calib, search, holdout = case.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench(
                model, calib, search, holdout, args.targets, args.refine, args.op_types.split(","), pathlib.Path(tmp)
            )
    print(
        f"{'model':<28} {'target':>6} {'refine':>6} {'kept':>4} {'evals':>5} {'search':>8} {'held-out':>8} "
        f"{'time s':>7} {'x plain':>7}"
    )
    for r in rows:
        target = "-" if r["target"] is None else f"{r['target']:g}"
        refine = "-" if r["refine"] is None else str(r["refine"])
        kept = str(r["kept"]) if r.get("met", True) else f"{r['kept']}!"
        print(
            f"{pathlib.Path(r['model']).name:<28} {target:>6} {refine:>6} {kept:>4} {r.get('evaluations', 0):>5} "
            f"{_pct(r['search_ratio']):>8} {_pct(r['holdout_ratio']):>8} {r['seconds']:>7.1f} {r['x_plain']:>7.1f}"
        )
    print("ratios: the headline metric relative to FP16's; search = the half the search saw; '!': target not met")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
