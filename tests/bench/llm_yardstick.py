"""The field's yardsticks for language models, FP32 / FP16 / FP8 side by side in one run, with their noise:
next-token accuracy and greedy generation on held-out windows, sliding-window perplexity on PTB, C4 and code,
LAMBADA and HellaSwag accuracy (files from ``models/eval_corpora.py``), each through ``fp8onnx.compare``
(the FP32 reference, its FP16 baseline and every FP8 model on the same samples; ``±`` one standard error
of the difference from FP32's, or of the ratio to FP16's, paired over windows or items).

Usage: python tests/bench/llm_yardstick.py REFERENCE.onnx MODEL.onnx [MODEL.onnx ...] --tokenizer tokenizer.json
       [--eval eval.npz] [--corpora models/corpora] [--seq-len 512] [--windows 48] [--lambada 500]
       [--hellaswag 200] [--start 0] [--prompts 20] [--batch 4] [--only eval,ptb,c4,code,lambada,hellaswag]
       [--json out.json] [--columns out.npz] [--progress]
Subsets are the first windows or items of each set (stated in the output); the noise says what they resolve.
``--start N`` scores the task files (LAMBADA, HellaSwag) from their item N on: a long run split into parts, one
part a session, that ``yardstick_table.py`` joins end to end (each part's ``meta`` says where it starts).
``--columns`` keeps every row's per-sample (per-item for tasks) sums, ``{set}/{row}/{column}``, beside ``meta``
(machine, date, onnxruntime's version): ``tests/bench/yardstick_table.py`` pairs them with the torch anchor's
(``tests/bench/fp8_anchor.py``, run with the same ``--batch`` and limits).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import fp8onnx
from fp8onnx.data.feeds import TextSource


def _row(r) -> dict:
    n = r.noise
    top1 = next(iter(r.outputs.values()))["top1_agreement"]
    return {
        "model": r.name,
        "accuracy": r.accuracy,
        "accuracy_se": n.get("accuracy"),
        "ratio_to_fp16": r.ratio_to_fp16,
        "ratio_se": n.get("ratio_to_fp16"),
        "perplexity": r.perplexity,
        "perplexity_se": n.get("perplexity"),
        "top1_agreement": top1,
        "generation": r.generation,
    }


def _sets(args) -> dict:
    corpora = pathlib.Path(args.corpora)
    text = {"tokenizer": args.tokenizer, "seq_len": args.seq_len}  # windows side by side: each token once
    start = getattr(args, "start", 0)
    only = args.only.split(",")
    if start and set(only) - {"lambada", "hellaswag"}:
        raise SystemExit(f"--start {start} splits the task files only: run --only lambada,hellaswag with it")
    sets = {  # built only when asked for (a later part copies its file)
        "eval": lambda: (args.eval, None),
        "ptb": lambda: (TextSource(corpora / "ptb.test.txt", **text), args.windows),
        "c4": lambda: (TextSource(corpora / "c4.txt", **text), args.windows),
        "code": lambda: (TextSource(corpora / "code.txt", **text), args.windows),
        "lambada": lambda: (TextSource(_from_item(corpora / "lambada.jsonl", start), args.tokenizer), args.lambada),
        "hellaswag": lambda: (
            TextSource(_from_item(corpora / "hellaswag.jsonl", start), args.tokenizer),
            4 * args.hellaswag,
        ),
    }
    built = {k: make() for k, make in sets.items() if k in only}
    return {k: v for k, v in built.items() if v[0] is not None}


def _from_item(path: pathlib.Path, start: int) -> pathlib.Path:
    """``path`` (one item a line) from its item ``start`` on: the file itself for 0, else a copy of its lines
    from there in a temporary folder (removed when the process ends)."""
    if not start:
        return path
    import atexit
    import shutil
    import tempfile

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if start >= len(lines):
        raise SystemExit(f"--start {start}: {path} holds {len(lines)} items")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="yardstick-part-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    part = folder / path.name
    part.write_text("\n".join(lines[start:]) + "\n")
    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--eval")
    parser.add_argument("--corpora", default="models/corpora")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--lambada", type=int, default=500)
    parser.add_argument("--hellaswag", type=int, default=200)
    parser.add_argument("--start", type=int, default=0, help="the task files from this item on (a later part)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--only", default="eval,ptb,c4,code,lambada,hellaswag")
    parser.add_argument("--json")
    parser.add_argument("--columns", type=pathlib.Path)
    parser.add_argument("--progress", action="store_true", help="compare's progress bars (stderr)")
    args = parser.parse_args()
    out: dict = {}
    arrays: dict = {}
    for name, (data, limit) in _sets(args).items():
        start = time.perf_counter()
        generate = 32 if name == "eval" else 0
        result = fp8onnx.compare(
            args.reference,
            args.models,
            data,
            max_samples=limit,
            generate=generate,
            prompts=args.prompts,
            memory=False,
            batch_size=args.batch,
            provider="cpu",
            progress=args.progress,
        )
        out[name] = {
            "samples": result.samples,
            "rows": [_row(r) for r in result.rows],
            "notes": result.notes,
            "seconds": time.perf_counter() - start,
        }
        print(f"== {name}: {result.samples} samples, {out[name]['seconds']:.0f} s", flush=True)
        print(result.table(), flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        if args.columns:
            for row in result.rows:
                arrays.update({f"{name}/{row.name}/{k}": v for k, v in row.columns.items()})
            save_columns(args.columns, arrays, {"sets": list(out), "start": args.start, **machine()})


def machine() -> dict:
    """Where and when: CPU model, cores, date, onnxruntime's version (a result file's provenance)."""
    import datetime
    import os
    import platform

    import onnxruntime

    cpu = platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "onnxruntime": onnxruntime.__version__,
        "fp8onnx": fp8onnx.__version__,
    }


def save_columns(path: pathlib.Path, arrays: dict, meta: dict) -> None:
    """``arrays`` and ``meta`` (as JSON) to ``path``, written whole or not at all."""
    import numpy as np

    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
    tmp.replace(path)


if __name__ == "__main__":
    main()
