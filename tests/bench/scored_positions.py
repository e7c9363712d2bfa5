"""What computing a task's logits at its scored positions only saves: ``fp8onnx.compare`` on a task file (the
FP32 reference, its FP16 baseline and the candidates) run as it runs, then with every model's whole logits
(the trimming turned off), in one process, one after the other; the scores must be the same.

Writes ``--json``: per order (``trimmed``, ``whole``) the wall time, each row's accuracy and perplexity, and per
row whether every item's hit and target cross-entropy agree between the two runs (and the largest relative
difference of the latter), beside the machine, date and onnxruntime's version.

Usage: python tests/bench/scored_positions.py models/smollm2/model.onnx models/smollm2/defaults.onnx
       --tokenizer models/smollm2/tokenizer.json --task models/corpora/lambada.jsonl --items 200 [--batch 8]
       --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
from llm_yardstick import machine

import fp8onnx
import fp8onnx.accuracy.compare as compare_module
from fp8onnx.data.feeds import TextSource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("models", nargs="*")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", type=pathlib.Path, required=True)
    args = parser.parse_args()
    data = TextSource(args.task, args.tokenizer)
    per_item = 4 if "hellaswag" in pathlib.Path(args.task).name else 1
    trimmable = compare_module.trimmable
    out: dict = {"task": args.task, "items": args.items, "batch": args.batch, **machine(), "runs": {}}
    columns = {}
    for order in ("trimmed", "whole"):
        compare_module.trimmable = trimmable if order == "trimmed" else (lambda model, logits="logits": False)
        start = time.perf_counter()
        result = fp8onnx.compare(
            args.reference, args.models, data, max_samples=args.items * per_item, batch_size=args.batch,
            provider="cpu", memory=False, generate=0,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        out["runs"][order] = {
            "seconds": seconds,
            "rows": {r.name: {"accuracy": r.accuracy, "perplexity": r.perplexity} for r in result.rows},
        }
        columns[order] = {r.name: (r.columns["correct"], r.columns["nll"]) for r in result.rows}
        print(f"{order}: {seconds:.1f} s", flush=True)
    compare_module.trimmable = trimmable
    out["same"] = {
        name: {
            "hits": bool(np.array_equal(hits, columns["whole"][name][0])),
            "nll_max_rel": float(np.max(np.abs(nll - columns["whole"][name][1]) / np.abs(columns["whole"][name][1]))),
        }
        for name, (hits, nll) in columns["trimmed"].items()
    }
    out["ratio"] = out["runs"]["trimmed"]["seconds"] / out["runs"]["whole"]["seconds"]
    print(json.dumps(out["same"]), f"time ratio {out['ratio']:.2f}")
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(args.json)


if __name__ == "__main__":
    main()
