"""The vocabulary projection and its tied embedding table: FP8 per row against float in 16 or 32 bits, in one run.

Usage: python tests/bench/vocab_tables.py MODEL.onnx --calib calib.npz --eval eval.npz [--preset llm-weight-only]
       [--out DIR] [--batch 4] [--json out.json]

Quantizes MODEL three times with the preset, changing only where the lm_head (and a tied table) goes:
- ``fp8-table``: lm_head quantized (float8 weights with one scale per output channel, which is one per
  row of the tied table; the Gather reads the same float8 copy),
- ``fp16-table``: lm_head in float (``--float-vocab``), the table stored as float16 (the default),
- ``fp32-table``: the same in float32 (``--wide-tables``),
then compares the three on ``--eval`` against FP32 and FP16 (``fp8onnx.compare``: the ratio to FP16's
accuracy with one standard error paired over windows, perplexity, top-1 agreement, the session's heap)
and prints the file sizes. Ratios, not times: one run, one machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import fp8onnx


def variants(preset: str) -> dict[str, fp8onnx.QuantizeConfig]:
    """The preset three ways; only float_vocab and wide_tables differ."""
    return {
        "fp8-table": fp8onnx.QuantizeConfig.for_preset(preset, float_vocab=False),
        "fp16-table": fp8onnx.QuantizeConfig.for_preset(preset, float_vocab=True),
        "fp32-table": fp8onnx.QuantizeConfig.for_preset(preset, float_vocab=True, wide_tables=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--calib", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--preset", default="llm-weight-only")
    parser.add_argument("--out", default=None, help="where the three models go (default: beside MODEL)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    model = pathlib.Path(args.model)
    out = pathlib.Path(args.out) if args.out else model.parent
    out.mkdir(parents=True, exist_ok=True)
    sizes, paths = {}, []
    for name, config in variants(args.preset).items():
        path = out / f"{args.preset}.{name}.onnx"
        start = time.perf_counter()
        report = fp8onnx.quantize(model, path, calib=args.calib, config=config)
        sizes[name] = {"bytes": report.output_bytes, "x_fp32": report.output_bytes / report.input_bytes}
        print(
            f"{name}: {report.output_bytes / 2**20:.1f} MiB ({sizes[name]['x_fp32']:.2f}x), "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
        for line in report.prepared:
            if "table" in line:
                print(f"  {line}", flush=True)
        paths.append(path)
    result = fp8onnx.compare(model, paths, args.eval, generate=0, batch_size=args.batch, provider="cpu", progress=False)
    print(result.table(), flush=True)
    if args.json:
        rows = [
            {
                "model": r.name,
                "ratio_to_fp16": r.ratio_to_fp16,
                "ratio_se": r.noise.get("ratio_to_fp16"),
                "perplexity": r.perplexity,
                "perplexity_se": r.noise.get("perplexity"),
                "accuracy": r.accuracy,
            }
            for r in result.rows
        ]
        pathlib.Path(args.json).write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
