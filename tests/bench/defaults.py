"""The defaults before issue "Accurate with no flags" (``--preset none``: plain per-tensor static amax)
against ``--preset auto`` (the family's preset, the default since) on every model at hand: per model,
the family seen, the headline metric's ratio to FP16 (``compare``), quantize wall time, output size
and onnxruntime CPU time per batch relative to FP32's, side by side in one run.

Models (each skipped with a note when it is not built): the sample decoder (``models/decoder``), the
zoo's ViT, small Llama and dynamo BERT (``models/build_zoo.py``), all-MiniLM-L6-v2
(``models/export_minilm.py``), the digits CNN (``models/build_cnn.py``), and SmolLM2's torch and
onnxruntime-genai export folders (``tests/bench/deploy.py --out DIR``: calib.txt / eval.txt there).

Usage: python tests/bench/defaults.py [--zoo models/zoo] [--smollm2 DIR] [--out DIR]
Prints a Markdown table; writes OUT/defaults.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def models(
    zoo: pathlib.Path, smollm2: pathlib.Path | None
) -> list[tuple[str, pathlib.Path, pathlib.Path, pathlib.Path]]:
    found = [
        (
            "decoder",
            ROOT / "models/decoder/decoder.onnx",
            ROOT / "models/decoder/calib.npz",
            ROOT / "models/decoder/eval.npz",
        )
    ]
    for name, file in (("vit", "model.onnx"), ("llama-small", "llama-small.onnx"), ("bert-dynamo", "model.onnx")):
        found.append((name, zoo / name / file, zoo / name / "calib.npz", zoo / name / "eval.npz"))
    found.append(
        (
            "minilm",
            ROOT / "models/minilm/minilm.onnx",
            ROOT / "models/minilm/calib.npz",
            ROOT / "models/minilm/eval.npz",
        )
    )
    found.append(("cnn", ROOT / "models/cnn/cnn.onnx", ROOT / "models/cnn/calib.npz", ROOT / "models/cnn/eval.npz"))
    if smollm2 is not None:
        for name in ("torch", "genai"):
            found.append((f"smollm2-{name}", smollm2 / name, smollm2 / "calib.txt", smollm2 / "eval.txt"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=pathlib.Path, default=ROOT / "models/zoo")
    parser.add_argument("--smollm2", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(tempfile.mkdtemp(prefix="defaults-")))
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--corpus", action="store_true", help="also every graph of the exporter corpus (tests/wild)")
    args = parser.parse_args()
    import fp8onnx
    from fp8onnx.settings.config import QuantizeConfig

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, model, calib, data in models(args.zoo, args.smollm2):
        if args.only and name not in args.only.split(","):
            continue
        if not (model.exists() and calib.exists() and data.exists()):
            print(f"skipped {name}: {model} (or its data) is not built", file=sys.stderr)
            continue
        outs, row = [], {"model": name}
        for preset in ("none", "auto"):
            out = args.out / f"{name}.{preset}" if model.is_dir() else args.out / f"{name}.{preset}.onnx"
            t0 = time.perf_counter()
            config = QuantizeConfig.for_preset(preset)
            if model.is_dir():
                report = fp8onnx.quantize_folder(model, out, calib, config=config, provider="cpu")
                family = next(iter(report.reports.values())).family
                size = sum(p.stat().st_size for p in out.glob("*.onnx*"))
            else:
                report = fp8onnx.quantize(model, out, calib, config=config, provider="cpu")
                family, size = report.family, report.output_bytes
            row[f"{preset} seconds"] = round(time.perf_counter() - t0, 1)
            row[f"{preset} MB"] = round(size / 1e6, 1)
            if family:
                row["family"], row["auto preset"] = family["family"], family["preset"]
            outs.append(out)
        result = fp8onnx.compare(model, outs, data, provider="cpu", generate=0, memory=False, progress=False)
        by_name = {r.name: r for r in result.rows}
        row["metric"] = result.rows[0].headline
        for preset, out in zip(("none", "auto"), outs):
            r = by_name[out.name]
            row[f"{preset} vs FP16"] = None if r.ratio_to_fp16 is None else round(100 * r.ratio_to_fp16, 2)
            row[f"{preset} value"] = r.value
            if r.latency_ms and result.rows[0].latency_ms:  # onnxruntime CPU time per batch, vs FP32's
                row[f"{preset} ms x FP32"] = round(r.latency_ms / result.rows[0].latency_ms, 2)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    (args.out / "defaults.json").write_text(json.dumps(rows, indent=1) + "\n")
    head = [
        "model",
        "family",
        "auto preset",
        "metric",
        "none vs FP16",
        "auto vs FP16",
        "none seconds",
        "auto seconds",
        "none MB",
        "auto MB",
        "none ms x FP32",
        "auto ms x FP32",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row.get(h, "-")) for h in head) + " |")
    if args.corpus:
        print()
        corpus_table(args.out)


def corpus_table(out: pathlib.Path) -> None:
    """Every graph of the exporter corpus (``tests/wild/corpus.py``, tiny seeded random models) quantized
    both ways from its calibration feed: the family seen, the worst relative L2 error of the float
    outputs against FP32 on that feed (onnxruntime at its defaults), quantize time and output size."""
    sys.path.insert(0, str(ROOT / "tests" / "wild"))
    from corpus import CASES, available
    from test_wild import check_case

    rows = []
    for name in CASES:
        if not available(name):
            print(f"skipped {name}: its exporter is not installed", file=sys.stderr)
            continue
        row = {"case": name}
        for preset in ("none", "auto"):
            r = check_case(name, out / f"corpus-{preset}", preset)
            row[f"{preset} rel L2"], row[f"{preset} s"] = round(r["rel_l2"], 4), round(r["seconds"], 1)
            row[f"{preset} KB"] = round(r["output_bytes"] / 1e3)
            row["family"] = r["family"] or row.get("family")
            row["auto preset"] = r["preset"] if preset == "auto" else row.get("auto preset")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    (out / "corpus.json").write_text(json.dumps(rows, indent=1) + "\n")
    head = ["case", "family", "auto preset", "none rel L2", "auto rel L2", "none s", "auto s", "none KB", "auto KB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row.get(h, "-")) for h in head) + " |")
    better = sum(r["auto rel L2"] <= r["none rel L2"] for r in rows)
    print(f"\nauto's error at or below none's on {better} of {len(rows)} graphs")


if __name__ == "__main__":
    main()
