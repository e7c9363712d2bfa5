"""``python -m fp8onnx.cli``."""

from . import entry

entry()
