"""The sample decoder's quantized outputs, pinned: refactors must not change what the tool writes.

What is pinned is what does not depend on the CPU's kernels, so the test holds on any x86-64
machine (Intel or AMD):
- dynamic activations: the whole file, byte for byte (weights and their scales are computed by numpy
  and ml_dtypes, which round the same everywhere);
- static activations: the whole file byte for byte *except* the activation scales, which come from
  onnxruntime's FP32 run of the calibration data. Its MatMul/ReduceMax kernels differ between CPUs
  (AVX2 vs AVX-512, FMA or not) in the last bits of an amax, so those scales are compared within
  ``SCALE_ULPS`` float32 ulps (a relative 8e-6): far below E4M3's step of 2^-3, so any real change to
  calibration or scaling still fails. Measured on the development machines (onnxruntime 1.32 CPU:
  the previous whole-file pin of the Intel Xeon reproduced on an AMD EPYC of 2026-12-02).

To regenerate after a deliberate change: run ``_canonical`` on the new output and print its parts."""

import hashlib

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import fp8onnx

from helpers import SAMPLE

DYNAMIC_SHA256 = "726280465c46c46e712c769182bbb714d8268e9d3902ece0f8fcd894c17e3523"
STATIC_SHA256_WITHOUT_ACTIVATION_SCALES = "8a8decb154170de9babd1855f777d192cececcf57135b94e67e9c2097c8ac00b"
SCALE_ULPS = 64
STATIC_ACTIVATION_SCALES = {
    "mul_24": 0.007334381341934204,
    "_unsafe_view": 0.00818417128175497,
    "mul_180": 0.006184179335832596,
    "mul_193": 0.04452655836939812,
    "mul_216": 0.009708265773952007,
    "_unsafe_view_1": 0.009965086355805397,
    "mul_372": 0.009933307766914368,
    "mul_385": 0.04934432730078697,
    "mul_408": 0.009834169410169125,
    "_unsafe_view_2": 0.011796376667916775,
    "mul_564": 0.01034141331911087,
    "mul_577": 0.055153343826532364,
    "mul_600": 0.011980706825852394,
    "_unsafe_view_3": 0.01253787986934185,
    "mul_756": 0.012741864658892155,
    "mul_769": 0.15021555125713348,
    "mul_792": 0.013737110421061516,
}


def _canonical(path) -> tuple[str, dict[str, float]]:
    """(sha256 of the model with every activation scale set to 0, {activation: its scale})."""
    model = onnx.load(path)
    inits = {i.name: i for i in model.graph.initializer}
    scales = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits:
            scale = inits[node.input[1]]
            scales[node.input[0]] = numpy_helper.to_array(scale).item()
            scale.CopyFrom(numpy_helper.from_array(np.zeros((), np.float32), scale.name))
    return hashlib.sha256(model.SerializeToString()).hexdigest(), scales


def test_dynamic_output_is_byte_identical(tmp_path):
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", out, activations="dynamic", preset="none", provider="cpu")
    assert hashlib.sha256(out.read_bytes()).hexdigest() == DYNAMIC_SHA256


def test_static_output_is_identical_up_to_the_last_bits_of_calibrated_scales(tmp_path):
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", out, SAMPLE / "calib.npz", preset="none", provider="cpu")
    digest, scales = _canonical(out)
    assert list(scales) == list(STATIC_ACTIVATION_SCALES)  # same activations, same order
    np.testing.assert_array_max_ulp(
        np.array(list(scales.values()), np.float32),
        np.array(list(STATIC_ACTIVATION_SCALES.values()), np.float32),
        maxulp=SCALE_ULPS,
    )
    assert digest == STATIC_SHA256_WITHOUT_ACTIVATION_SCALES


def test_the_pin_catches_a_real_change_of_scale(tmp_path):
    """The tolerance is not so loose that another scaling passes: pow2 moves every scale by more."""
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(SAMPLE / "decoder.onnx", out, SAMPLE / "calib.npz", scaling="pow2", preset="none", provider="cpu")
    _, scales = _canonical(out)
    with pytest.raises(AssertionError):
        np.testing.assert_array_max_ulp(
            np.array(list(scales.values()), np.float32),
            np.array(list(STATIC_ACTIVATION_SCALES.values()), np.float32),
            maxulp=SCALE_ULPS,
        )
