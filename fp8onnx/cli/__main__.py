"""``python -m fp8onnx.cli``."""

from fp8onnx.cli import entry

entry()
