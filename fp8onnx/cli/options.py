"""The options that say which runtime a written model is for (``quantize``'s "Deployment target" group in
--help), declared once."""

from __future__ import annotations

import click

from fp8onnx.accuracy.metrics import METRICS
from fp8onnx.config import GEMM_OPS, PRECISIONS
from fp8onnx.targets import TARGETS

__all__ = ["deployment_options", "metric_option", "weight_block_size_option"]

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
        "the same as --gemm-op gemm-float8.",
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

weight_block_size_option = click.option(
    "--weight-block-size",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="Block-wise weight scales: one scale per N consecutive elements along each MatMul/Gemm weight's reduction "
    "axis (K) and output channel, stored with opset 21's blocked DequantizeLinear (32, 64, 128 usual; 0: off). "
    "Conv weights: blocks of their filters flattened (input channels x kernel); ConvTranspose weights: blocks of "
    "input channels at each output channel and kernel tap. "
    "Each block adds one float scale: 4/N bytes per element in float32.",
)
