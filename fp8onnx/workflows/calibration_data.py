"""The calibration data of one quantization: which steps of the recipe read it, the bundled text sample where
none is given and the recipe needs some, and the one data source every step reads (converted once)."""

from __future__ import annotations

import dataclasses
import logging

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import FeedData, input_specs
from fp8onnx.data.text_sample import default_text_sample
from fp8onnx.passes.common import reduction_size
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.techniques.gptq import MIN_ROWS_PER_CHANNEL

__all__ = ["calibration_data", "data_reads", "data_source", "tokens_wanted"]

logger = logging.getLogger(__name__)


def data_reads(config: QuantizeConfig, stats=None) -> list[str]:
    """The steps of the recipe that read the calibration data, in the order they run."""
    reads = {
        "smoothing": config.smooth is not None,
        "kept channels": config.keep_channels > 0,
        "activation statistics": config.activations == "static" and config.scaling != "constant" and stats is None,
        "GPTQ rounding": config.weight_rounding == "gptq",
        "bias correction": config.bias_correction,
    }
    return [step for step, reads_data in reads.items() if reads_data]


def data_source(calib, ir_model, config: QuantizeConfig, stats):
    """``calib`` as the one data source every step reads (``as_data``: a path, text, images, audio or
    feeds), converted here once; feeds given as an iterator are kept in memory when the recipe reads
    the data more than once (:func:`data_reads`, and ``--w8a8-share``'s choice, which reads what it has
    and needs none)."""
    if calib is None:
        return None
    source = as_data(calib, input_specs(ir_model), ir_model)
    reads = len(data_reads(config, stats)) + (config.w8a8_share is not None)
    return source.readable_again() if reads > 1 and isinstance(source, FeedData) else source


def calibration_data(model, ir_model, config: QuantizeConfig, calib, optional: bool, auto=None):
    """(data, config): ``calib``, or without it the bundled text sample for a token model with a
    tokenizer beside it; a default (``optional``) is dropped where the recipe needs no data. With no
    data at all under ``--preset auto`` (``auto``: the fields the user set), the family preset's
    data-driven extras (GPTQ, bias correction, smoothing) that the user did not ask for are dropped
    where the activations need none (weight-only, dynamic): the model is still quantized, and the log
    says what data would add. A preset named explicitly keeps all of its recipe, and so needs data."""
    reads = data_reads(config)
    needed = bool(reads)
    if calib is not None:
        return (calib if needed or not optional else None), config
    tokens = any("input_ids" in v.name for v in ir_model.graph.inputs if v.const_value is None)
    if not needed:
        return None, config

    sample = default_text_sample(model, tokens_wanted(ir_model, config)) if tokens else None
    if sample is not None:
        logger.warning("no --calib: calibrating on %s", sample)
        return sample, config
    extras = {"weight_rounding", "bias_correction", "smooth", "keep_channels"}  # the settings that read the data
    if auto is not None and "activation statistics" not in reads and not extras & set(auto):
        logger.warning(
            "no calibration data: %s of preset %s skipped (pass --calib DATA to have it)",
            ", ".join(reads),
            config.preset,
        )
        return None, dataclasses.replace(
            config, weight_rounding="nearest", bias_correction=False, smooth=None, keep_channels=0
        )
    if tokens:  # per-token activations need no data; the recipe's other readers still do
        hint = (
            "or use --activations dynamic-per-token (no data needed)"
            if reads == ["activation statistics"]
            else f"which {', '.join(reads)} read"
        )
        raise Fp8OnnxError(
            f"Model {str(model)!r} takes token ids and has no tokenizer.json beside it to calibrate on a bundled "
            f"text sample: pass --calib DATA (text with --tokenizer, or an .npz), {hint}."
        )
    return None, config


def tokens_wanted(ir_model, config: QuantizeConfig) -> int:
    """The rows GPTQ wants for the widest weight input it rounds (MIN_ROWS_PER_CHANNEL a channel: the
    bundled text sample grows to give them); 0 where the recipe rounds to nearest."""
    if config.weight_rounding != "gptq":
        return 0
    widths = [
        reduction_size(node) or 0
        for node in ir_model.graph
        if node.op_type in ("MatMul", "Gemm") and len(node.inputs) > 1 and node.inputs[1] is not None
        if node.inputs[1].const_value is not None
    ]
    return MIN_ROWS_PER_CHANNEL * max(widths, default=0)
