"""Calls of fp8onnx's public API as a user writes them: checked by mypy (tests/test_typing.py), never run.
Every call here must type-check against the hints the wheel ships (py.typed)."""

from __future__ import annotations

import pathlib

import numpy as np

import fp8onnx
from fp8onnx import QuantizeConfig, RunOptions

model = pathlib.Path("model.onnx")
feeds = [{"input_ids": np.zeros((1, 8), np.int64)}]

report = fp8onnx.quantize(model, "model.fp8.onnx", "calib.npz", preset="llm")
report = fp8onnx.quantize(model, "model.fp8.onnx", feeds, config=QuantizeConfig(activations="none"))
summary: str = report.summary()
stats = fp8onnx.calibrate(model, "calib/", "stats.json", run=RunOptions(batch_size=8))
report = fp8onnx.quantize(model, "model.fp8.onnx", stats=stats, run=RunOptions(provider="cpu"))
result = fp8onnx.compare(model, ["model.fp8.onnx"], "eval.npz", generate=0, metric="auto")
print(result.table())
found = fp8onnx.quantize_to_target(
    model, "out.onnx", "calib.npz", "eval.npz", accuracy_target=99.5, fallback="activations", target="onnxruntime-cuda"
)
kept: list[str] = found.kept_in_float
ranking = fp8onnx.sensitivity(model, "calib.npz", eval_data="eval.npz", refine=3)
ranking = fp8onnx.sensitivity(model, "calib.npz", eval_data="eval.npz", scoring=fp8onnx.Scoring(refine=3))
found = fp8onnx.quantize_to_target(model, "out.onnx", "calib.npz", "eval.npz", goal=fp8onnx.TargetSearch(99.0))
result = fp8onnx.compare(model, ["model.fp8.onnx"], "eval.npz", measure=fp8onnx.CompareOptions(generate=0))
info: dict = fp8onnx.inspect("model.fp8.onnx", target="onnxruntime-cuda")
folder = fp8onnx.quantize_folder("export/", "export_fp8/", "prompts.txt", config=QuantizeConfig.for_preset("llm"))
scale: float = fp8onnx.amax_to_scale(3.5, fp8onnx.Fp8Format.E4M3FN)
