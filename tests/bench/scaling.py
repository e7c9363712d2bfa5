"""How quantize's cost grows with model size on the layer-by-layer executor, in one run.

Per model (a folder from ``models/build_llama.py``: ``<name>.onnx`` with external data and
``calib.npz``), each in its own process (wall time and peak RSS from wait4):
  fp32 layered  one FP32 pass over the calibration data, layer by layer (fp8onnx's segment runner,
                --weight-memory's budget, no statistics): the floor a model larger than memory has;
  fp32 whole    the same pass in one onnxruntime session (only where the weights fit in half of this
                machine's memory);
  quantize      `fp8onnx quantize MODEL --calib CALIB --preset none` (and the options after --);
then quantize / fp32 layered, and peak RSS against the FP32 weights' size. The first ``--rows``
samples of each calib.npz are used, so every model sees the same data.

Usage: python tests/bench/scaling.py models/llama1b models/llama7b [--rows 4] [--batch 4]
       [--json out.json] [-- extra quantize options]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import _FLOOR as _FP32_WHOLE
from peers import file_size, machine, run_child

_FP32_LAYERED = """
import sys
import numpy as np
from fp8onnx.graph.model_io import load_model
from fp8onnx.pipeline.segments import run_segmented
model, calib, batch, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = load_model(model)
data = np.load(calib)
names = [v.name for v in m.graph.inputs if v.const_value is None]
n = len(data[names[0]])
feeds = ({k: data[k][i:i + batch] for k in names} for i in range(0, n, batch))
run_segmented(m, [v.name for v in m.graph.outputs], feeds, lambda b, v: None, budget=budget)
"""


def _memory_gib() -> float:
    with open("/proc/meminfo", encoding="ascii") as fh:
        return int(next(line for line in fh if line.startswith("MemTotal")).split()[1]) / 2**20


def bench(folder: pathlib.Path, rows: int, batch: int, extra: list[str], tmp: pathlib.Path) -> dict:
    model = next(p for p in sorted(folder.glob("*.onnx")))
    weights = file_size(model)
    calib = tmp / f"{folder.name}-calib.npz"
    with np.load(folder / "calib.npz") as data:
        np.savez(calib, **{k: data[k][:rows] for k in data.files})
    limits = {"memory_limit_gib": _memory_gib() * 0.9, "timeout_s": 3600}
    row = {"model": folder.name, "fp32_gb": weights / 1e9, "samples": rows, "batch": batch}
    budget = str(512 << 20)
    print(f"[{folder.name}] FP32 pass, layer by layer", flush=True)
    row["fp32_layered"] = run_child(
        [sys.executable, "-c", _FP32_LAYERED, str(model), str(calib), str(batch), budget], **limits
    )
    if weights < _memory_gib() * 2**30 / 2:
        print(f"[{folder.name}] FP32 pass, one session", flush=True)
        row["fp32_whole"] = run_child([sys.executable, "-c", _FP32_WHOLE, str(model), str(calib), str(batch)], **limits)
    out = tmp / f"{folder.name}-q" / "model.onnx"
    out.parent.mkdir()
    cmd = ["fp8onnx", "quantize", str(model), "--calib", str(calib), "--preset", "none", "--batch-size", str(batch)]
    print(f"[{folder.name}] quantize {' '.join(extra)}", flush=True)
    row["quantize"] = run_child([*cmd, *extra, "-o", str(out)], **limits)
    row["output_gb"] = file_size(out) / 1e9 if out.exists() else None
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | FP32 GB | FP32 pass layered s | FP32 pass whole s | quantize s | quantize / layered pass "
        "| peak RSS quantize MiB | RSS / FP32 size | peak RSS layered pass MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lay, q = r["fp32_layered"], r["quantize"]
        whole = r.get("fp32_whole")
        whole_s = f"{whole['wall_s']:.0f}" if whole and "error" not in whole else "-"
        lines.append(
            f"| {r['model']} | {r['fp32_gb']:.1f} | {lay['wall_s']:.0f} | {whole_s} | {q['wall_s']:.0f} | "
            f"{q['wall_s'] / lay['wall_s']:.2f}x | {q['peak_rss_mib']:.0f} | "
            f"{q['peak_rss_mib'] * 2**20 / (r['fp32_gb'] * 1e9):.2f}x | {lay['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=pathlib.Path)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fp8onnx-scaling-") as tmp:
        rows = [bench(f, args.rows, args.batch, extra, pathlib.Path(tmp)) for f in args.folders]
    for r in rows:
        for key in ("fp32_layered", "fp32_whole", "quantize"):
            if key in r and "error" in r[key]:
                print(f"{r['model']} {key}: {r[key]['error']}")
    print(f"machine: {machine()}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
