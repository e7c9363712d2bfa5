"""Calls a type checker must refuse (tests/test_typing.py counts mypy's errors here, one a line)."""

from __future__ import annotations

import fp8onnx

fp8onnx.quantize("model.onnx", "out.onnx", 3)  # calib: not data
fp8onnx.compare("model.onnx", ["out.onnx"], None)  # data is required
fp8onnx.calibrate("model.onnx", 2.5)  # calib: not data
fp8onnx.quantize_folder("export/", "out/", config="llm")  # config: a QuantizeConfig, not a preset name
fp8onnx.compare("model.onnx", ["out.onnx"], "eval.npz", measure="fast")  # measure: a CompareOptions
