"""The sample decoder's quantized outputs, pinned byte for byte: refactors must not change what the
tool writes. Measured on the development machine (onnxruntime 1.32 CPU); static scales come from
onnxruntime's calibration run, so another CPU (other BLAS kernels) may legitimately differ in the
last bits of an amax: regenerate with `fp8onnx quantize models/decoder/decoder.onnx [...] -o x.onnx`
and `sha256sum x.onnx` there, after checking the difference is only that."""

import hashlib

import pytest

import fp8onnx

from helpers import SAMPLE

PINNED = {
    "static": "c5a13406166b64874b6da5dbe8840e517e210ac7356957c7e8c38c320593d0a6",
    "dynamic": "726280465c46c46e712c769182bbb714d8268e9d3902ece0f8fcd894c17e3523",
}


@pytest.mark.parametrize("mode", list(PINNED))
def test_sample_decoder_output_is_byte_identical(tmp_path, mode):
    out = tmp_path / "q.onnx"
    if mode == "static":
        fp8onnx.quantize(SAMPLE / "decoder.onnx", out, SAMPLE / "calib.npz", provider="cpu")
    else:
        fp8onnx.quantize(SAMPLE / "decoder.onnx", out, activations="dynamic", provider="cpu")
    assert hashlib.sha256(out.read_bytes()).hexdigest() == PINNED[mode]
