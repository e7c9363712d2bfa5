"""Options declared once for every command that takes them: the ones that say which runtime a written model
is for (``quantize``'s "Deployment target" group in --help), --metric, --weight-block-size; and how a
command's parameters become the library's: the recipe options are
:class:`~fp8onnx.settings.config.QuantizeConfig`'s fields (:func:`recipe_options`), the runtime ones
:class:`~fp8onnx.graph.run_settings.RunOptions` (:func:`run_options`)."""

from __future__ import annotations

import dataclasses

import click

from fp8onnx.accuracy.metrics import METRICS
from fp8onnx.cli.common import _DEFAULT, _PARAM, _run_options
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.settings.choices import FALLBACK_UNITS, GEMM_OPS, PRECISIONS
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.targets import TARGETS

__all__ = [
    "NOT_OPTIONS",
    "count_option",
    "deployment_options",
    "fallback_option",
    "metric_option",
    "recipe_options",
    "refine_option",
    "run_options",
    "weight_block_size_option",
]

# QuantizeConfig fields no command line sets: the library's own (the search's float nodes, the preset's
# bookkeeping); --preset is read apart, since a preset yields to the options given explicitly.
NOT_OPTIONS = frozenset({"keep_float", "preset", "explicit", "precision_derived"})
_RUN = ("batch_size", "provider", "weight_memory", "batch_memory", "workers", "ray_address")

_DEPLOYMENT = [
    click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default=None,
        help="fp16: the unquantized part of the graph runs in float16 (inputs and outputs kept as they were). "
        "bf16: in bfloat16, for the CUDA fast form only (--gemm-op block-fp8): what the CUDA EP has no bfloat16 "
        "kernel for stays float32; emulated on the CPU EP. "
        "[default: fp16 with --gemm-op block-fp8 (the op takes float16 activations), else model]",
    ),
    click.option(
        "--target",
        type=click.Choice(TARGETS),
        default="onnxruntime",
        show_default=True,
        help="tensorrt: only what TensorRT's FP8 takes (E4M3FN, constant scales), checked on the result; "
        "onnxruntime-cuda: what onnxruntime's CUDA EP runs fast (--gemm-op block-fp8 by default; with --gemm-op qdq, "
        "e4m3fn/e5m2 Q/DQ with block scales as per-axis DequantizeLinear, chosen too when the run's provider is CUDA).",
    ),
    click.option(
        "--gemm-op",
        type=click.Choice(GEMM_OPS),
        default="auto",
        show_default=True,
        help="How each quantized MatMul/Gemm is written. qdq: standard float8 Q/DQ (every runtime); block-fp8: "
        "com.microsoft.MatMulBlockQuantizedFp8Weight (onnxruntime >= 1.29's CUDA fast path: float8 weights read as "
        "they are, scales per --weight-block-size, 128 by default, or per channel; W8A8 with static activations, "
        "else W8A16; emulated on the CPU EP); gemm-float8: com.microsoft.GemmFloat8 (= --native-gemm); auto: "
        "block-fp8 for --target onnxruntime-cuda, else qdq.",
    ),
    click.option(
        "--native-gemm",
        is_flag=True,
        help="Lower quantized MatMul/Gemm to com.microsoft.GemmFloat8 (CUDA EP, compute capability >= 8.9); "
        "the same as --gemm-op gemm-float8. Measured on an H200 with onnxruntime-gpu 1.31.1: 99.6% of FP16's "
        "accuracy on the sample decoder, but slower than FP16 in wall time (the op sets cuBLASLt up in every run; "
        "docs/gpu.md).",
    ),
]


def deployment_options(command):
    """--precision, --target, --gemm-op and --native-gemm, in that order in --help."""
    for option in reversed(_DEPLOYMENT):
        command = option(command)
    return command


metric_option = click.option(
    "--metric",
    type=click.Choice(METRICS),
    default="auto",
    show_default=True,
    help="The headline compared with FP16: auto is task accuracy with labels (a decoder LLM's are its next tokens, "
    "none needed), else top-1 agreement for class scores (named like logits, computed by a Softmax, or a linear "
    "head's [batch, classes]), else mean cosine; rel-l2 scores 1 - relative L2 error (regression).",
)

refine_option = click.option(
    "--refine",
    type=click.IntRange(min=0),
    default=None,
    help="Score the N lowest-SQNR nodes one by one on the --eval data (N+1 models quantized and evaluated) and "
    "order them by the measured gain of keeping each in float. [default: 5 for sensitivity --eval; 0 for "
    "quantize --accuracy-target, which then follows the SQNR order]",
)

fallback_option = click.option(
    "--fallback",
    type=click.Choice(FALLBACK_UNITS),
    default="nodes",
    show_default=True,
    help="What --accuracy-target leaves in float, most sensitive first: whole nodes, or only their activations "
    "(W8A16: the FP8 weight stays; ranked by the SQNR with only the activation in FP8). [llm-w8a8: activations]",
)


def count_option(name: str, help: str):
    """A ``--NAME N`` option: a non-negative count, 0 (off) by default."""
    return click.option(name, type=click.IntRange(min=0), default=0, show_default=True, metavar="N", help=help)


weight_block_size_option = count_option(
    "--weight-block-size",
    "Block-wise weight scales: one scale per N consecutive elements along each MatMul/Gemm weight's reduction "
    "axis (K) and output channel, stored with opset 21's blocked DequantizeLinear (32, 64, 128 usual; 0: off). "
    "Conv weights: blocks of their filters flattened (input channels x kernel); ConvTranspose weights: blocks of "
    "input channels at each output channel and kernel tap. "
    "Each block adds one float scale: 4/N bytes per element in float32.",
)


def recipe_options(params: dict) -> QuantizeConfig:
    """Takes out of a command's ``params`` the ones that are QuantizeConfig fields (the config declares
    them; each command has the options it offers) and ``preset``: the config they give. A preset's
    settings yield to the options the command line gave explicitly."""
    ctx = click.get_current_context()
    options, given = {}, {}
    for field in dataclasses.fields(QuantizeConfig):
        name = _PARAM.get(field.name, field.name)
        if field.name in NOT_OPTIONS or name not in params:
            continue
        options[field.name] = params.pop(name)
        if ctx.get_parameter_source(name) != _DEFAULT:
            given[field.name] = options[field.name]
    preset = params.pop("preset", None)
    return QuantizeConfig.for_preset(preset, **given) if preset else QuantizeConfig(**options)


def run_options(params: dict) -> RunOptions:
    """Takes the runtime options out of a command's ``params``: :class:`RunOptions` (those the command
    does not offer at their defaults)."""
    got = {name: params.pop(name) for name in _RUN if name in params}
    return _run_options(
        got.get("batch_size"),
        got.get("provider", "auto"),
        got.get("weight_memory"),
        got.get("batch_memory"),
        got.get("workers", 1),
        got.get("ray_address"),
    )
