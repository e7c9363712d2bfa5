"""fp8onnx: FP8 (float8) post-training quantization of ONNX models for ONNX Runtime.

The Python API mirrors the command line: :func:`quantize`, :func:`calibrate`, :func:`compare`,
:func:`convert_fp16`, :func:`inspect`. Bad input raises :class:`Fp8OnnxError` with one sentence.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

from .api import calibrate, convert_fp16, inspect
from .compare import compare
from .errors import Fp8OnnxError
from .formats import Fp8Format
from .quantize import QuantizeConfig, quantize
from .scaling import Scaling, amax_to_scale

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Fp8Format",
    "Fp8OnnxError",
    "QuantizeConfig",
    "Scaling",
    "__version__",
    "amax_to_scale",
    "calibrate",
    "compare",
    "convert_fp16",
    "inspect",
    "quantize",
]
