"""The presets (the measured best settings per model family) and the bundles of settings an option
stands for (``--format mxfp8``), as :class:`~fp8onnx.settings.config.QuantizeConfig` fields."""

from __future__ import annotations

from typing import TypedDict

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.numerics.scaling import Scaling

__all__ = ["MXFP8", "PRESETS", "bundled", "overruled"]


class Preset(TypedDict):
    settings: dict[str, object]  # QuantizeConfig fields
    why: str  # the measurement behind it


# The input channels of largest calibration amax of each activation kept out of the FP8 product by the LLM presets
# (techniques.outlier_channels): on Gemma 3 270M (LAMBADA, novels; calibration on pydoc) target perplexity -7.3%
# (weight-only) and -9.7% (W8A8) against the same recipe without; 1 channel did a fraction of 4's good (torch)
KEPT_CHANNELS = 4

# The measured best per model family (docs/history/benchmarks-typed.md, "Techniques"): what each turns on and why.
PRESETS: dict[str, Preset] = {
    "llm": {
        "settings": {
            "activations": "dynamic-per-token",
            "weight_rounding": "gptq",
            "float_vocab": True,
            "embeddings": "fp8",
        },
        "why": "SmolLM2-135M: per-token activations with per-channel weights, GPTQ rounding, lm_head in float (the "
        "tied embedding shares it) and fp8 embeddings otherwise: next-token accuracy 99.39% of FP16's (one standard "
        "error: 0.2%), perplexity +1.36% and top-1 agreement 0.924 on 32,768 held-out tokens (plain amax with lm_head "
        "in float: 99.04%, +3.0%); smoothing made it worse",
    },
    "llm-weight-only": {
        "settings": {
            "activations": "none",
            "weight_rounding": "gptq",
            "float_vocab": True,
            "embeddings": "fp8",
            "keep_channels": KEPT_CHANNELS,
        },
        "why": "SmolLM2-135M (both exports, 68 held-out windows): float8 weights (per channel, GPTQ), lm_head in "
        "float and fp8 embeddings, activations in float: next-token accuracy 99.95% of FP16's, perplexity 25.99 "
        "(FP32 25.98), at 1.11x FP32's time on the CPU EP; the one recipe measured that meets the FP8 LLM paper's "
        "99.5% on it: every recipe with FP8 activations (--preset llm: 99.02-99.05%) lost ~1%, spread over all "
        "211 MatMuls (each alone 26-29 dB SQNR, none an outlier); the 4 largest input channels of each activation "
        "in float (--keep-channels 4): Gemma 3 270M's LAMBADA target perplexity (300 items) from FP16's +7.26% to "
        "-0.56% (paired -7.29% ±1.02%), and the logits of every text scored closer to FP32's on SmolLM2 and Gemma",
    },
    "llm-w8a8": {
        "settings": {
            "activations": "static",
            # per output channel, not blocks of 32 along K: on LAMBADA (novels; calibration on pydoc) blocks of
            # 32 cost +10% target perplexity with or without GPTQ, per channel with GPTQ nothing (docs/benchmarks.md)
            "per_channel": True,
            "weight_rounding": "gptq",
            "float_vocab": True,
            "embeddings": "fp8",
            # at least 2/3 of the quantized MACs W8A8; which nodes stay W8A16 comes from each one's measured share
            # of the output's KL to FP32 on calibration samples (names: the fallback, workflows.loss_choice)
            "w8a8_share": 0.67,
            "fallback": "activations",
            "keep_channels": KEPT_CHANNELS,
        },
        "why": "FP8 on both GEMM inputs in the form FP8 GEMMs take (one static E4M3 scale per activation; E4M3 "
        "weights per output channel, GPTQ-rounded; --target onnxruntime-cuda writes a_scale), lm_head in float, "
        "at least 67% of the quantized MACs W8A8 and the rest W8A16, chosen by each node's measured share of the "
        "output's KL to FP32 (whatever the exporter named them); --accuracy-target takes back activations only: "
        "SmolLM2-135M calibrated on pydoc text (106 of 210 W8A16, 67.7% of the MACs W8A8), LAMBADA (novels, first "
        "300 items): 96.9% of FP16's accuracy (one standard error 3.4%), target perplexity +0.4% (1.6%), where "
        "weights in blocks of 32 along K lost 11.5% and +13.0% (blocks cost +10% with or without GPTQ, per channel "
        "with GPTQ nothing); PTB, C4 and code (24 windows of 512 each): 99.51%, 100.00% and 99.89% of FP16's "
        "next-token accuracy, perplexity +1.7%, +1.5% and +0.9% (blocks: +0.6%, +2.3%, +1.1%); Gemma 3 270M, "
        "LAMBADA: 96.0% and +12.8% (blocks 96.8% and +8.1%: per channel 2.3 standard errors worse there); the 4 "
        "largest input channels of each activation in float (--keep-channels 4): Gemma's LAMBADA target perplexity "
        "from +9.48% to -1.15% of FP16's (paired -9.71% ±1.36%), PTB +4.07% to +2.45%",
    },
    "encoder": {
        "settings": {"activations": "dynamic-per-token", "weight_rounding": "gptq", "embeddings": "fp8"},
        "why": "all-MiniLM-L6-v2: per-token activations, GPTQ rounding and fp8 embeddings: cosine to FP32 0.9984 and "
        "nearest-neighbour agreement 0.957 in a file 0.26x FP32's (plain amax: 0.9975, 0.953, 0.65x); smoothing "
        "did not help it; the most accurate mode with FP8 activations measured",
    },
    "cnn": {
        "settings": {
            "op_types": ("MatMul", "Gemm", "Conv", "ConvTranspose"),
            "float_stem": True,
            "bias_correction": True,
            "scaling": "percentile",
        },
        "why": "the digits CNN (two held-out halves of 360 images): Conv/ConvTranspose quantized with per-channel "
        "weights, the stem convolution in float, bias correction and percentile activation scales: top-1 "
        "agreement with FP32 1.000 on both halves, task accuracy at FP16's, in a file 0.31x FP32's (every Conv "
        "quantized with amax: 0.994 and 0.997; the stem alone in float: 0.997 and 1.000)",
    },
}


def overruled(field: str, value, explicit: dict) -> bool:
    """Whether a preset's ``field = value`` yields to an explicit option it cannot go with: a
    calibrated scaling to dynamic activations, the preset's dynamic or weight-only activations to an
    explicit activation scaling, its dynamic activations and data-driven weight techniques to constant
    scaling, its kept channels to smoothing (the user's choice wins, the preset's contradicting part is
    dropped rather than refused)."""
    given = {k: getattr(v, "value", v) for k, v in explicit.items()}  # enum members as their names
    dynamic = given.get("activations") in ("dynamic", "dynamic-per-token", "dynamic-per-group")
    constant = given.get("scaling") == "constant"
    if field == "scaling" and dynamic:
        return True
    if field == "w8a8_share" and given.get("activations") not in (None, "static"):
        return True  # no static activations to choose W8A16 among
    # the preset's per-channel weights yield to weight blocks the user chose and to one constant scale
    if field == "per_channel" and (given.get("weight_block_size") or constant):
        return True
    # a scaling the user chose that reads calibration histograms (percentile, MSE) means calibrated
    # activations: the preset's dynamic or weight-only activations yield to static ones (its weights' stay)
    if field == "activations" and given.get("scaling") in ("percentile", "mse") and "activations" not in given:
        return str(getattr(value, "value", value)) != "static"
    # one constant scale: the preset's per-batch (dynamic) activation scales yield (static, at that scale)
    if field == "activations" and constant and "activations" not in given:
        return str(getattr(value, "value", value)).startswith("dynamic")
    # the preset's kept channels yield to the user's smoothing (both move the outliers) and to one constant scale
    if field == "keep_channels" and (given.get("smooth") is not None or constant):
        return True
    techniques = ("bias_correction", "smooth")
    return constant and (field in techniques or (field == "weight_rounding" and value == "gptq"))


# --format mxfp8: the OCP Microscaling MXFP8 recipe as settings: E4M3 elements, one power-of-two (E8M0)
# scale per 32 consecutive elements of the reduction axis, for the weights (blocked DequantizeLinear) and
# the activations (in-graph scales per row and 32 channels).
MXFP8 = {
    "format": Fp8Format.E4M3FN,
    "weight_block_size": 32,
    "activations": "dynamic-per-group",
    "group_size": 32,
    "scaling": Scaling.POW2,
}


def bundled(explicit: dict) -> dict:
    """``explicit`` with ``format="mxfp8"`` as :data:`MXFP8`'s settings (weight-only MXFP8 allowed, and
    ``--scaling mx``: the OCP rule for the shared scale instead of rounding it up)."""
    if str(getattr(explicit.get("format"), "value", explicit.get("format"))).lower() != "mxfp8":
        return explicit
    out = dict(explicit)
    for field, value in MXFP8.items():
        given = getattr(out.get(field), "value", out.get(field))
        wanted = getattr(value, "value", value)
        if (
            field != "format"
            and given is not None
            and given != wanted
            and not (field == "activations" and given == "none")
            and not (field == "scaling" and given == "mx")  # OCP MX's own rounding of the shared scale
        ):
            option = "--" + field.replace("_", "-")
            raise Fp8OnnxError(
                f"--format mxfp8 sets {option} {wanted}; it contradicts {option} {given} (use --format e4m3fn "
                f"with {option} {given} instead)."
            )
        if given is None or field == "format":
            out[field] = value
    return out
