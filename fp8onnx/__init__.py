"""fp8onnx: FP8 (float8) post-training quantization of ONNX models for ONNX Runtime.

The package root is the library's one face, and the command line calls it for every command:
:func:`quantize`, :func:`quantize_folder` (an export folder in, a runnable folder out),
:func:`calibrate`, :func:`compare`, :func:`study`, :func:`convert_fp16`, :func:`inspect`,
:func:`sensitivity` and :func:`quantize_to_target` (``quantize --accuracy-target``).
The recipe is a :class:`QuantizeConfig`, the runtime knobs a :class:`RunOptions`.
Bad input raises :class:`Fp8OnnxError` with one sentence.
"""

from __future__ import annotations

import importlib.util
import logging

if importlib.util.find_spec("onnxruntime") is None:  # the package names no runtime: an extra chooses one
    raise ModuleNotFoundError(
        "fp8onnx needs onnxruntime, which is not installed: pip install 'fp8onnx[cpu]' for the CPU build, or "
        "'fp8onnx[gpu]' for the CUDA one (not both).",
        name="onnxruntime",
    )

from fp8onnx.base import deferred  # noqa: F401  (first: sympy, through onnx_ir, imported on first use)

# isort: split

from fp8onnx.accuracy.compare import CompareOptions, compare
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.version import __version__
from fp8onnx.data.datasource import Data, DataSource
from fp8onnx.experiments.study import study
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.numerics.scaling import Scaling, amax_to_scale
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.workflows.api import calibrate, convert_fp16, inspect
from fp8onnx.workflows.exports import quantize_folder
from fp8onnx.workflows.fallback import Scoring, TargetNotMet, TargetSearch, quantize_to_target, sensitivity
from fp8onnx.workflows.quantizer import quantize

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CompareOptions",
    "Data",
    "DataSource",
    "Fp8Format",
    "Fp8OnnxError",
    "QuantizeConfig",
    "RunOptions",
    "Scaling",
    "Scoring",
    "TargetNotMet",
    "TargetSearch",
    "__version__",
    "amax_to_scale",
    "calibrate",
    "compare",
    "convert_fp16",
    "inspect",
    "quantize",
    "quantize_folder",
    "quantize_to_target",
    "sensitivity",
    "study",
]
