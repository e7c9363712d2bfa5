import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format, dequantize, quantize
from fp8onnx.numerics.scaling import SAFE_AMAX, Scaling, amax_to_scale, parse_scaling

FORMATS = [f for f in Fp8Format if not f.integer]  # the float8 formats (int8: test_int8.py)
amaxes = st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False)


def test_amax_scale_maps_amax_to_fmax():
    assert amax_to_scale(448.0, Fp8Format.E4M3FN) == 1.0
    assert amax_to_scale(57344.0 * 2, Fp8Format.E5M2) == 2.0


def test_pow2_follows_the_exponent_bias_formula():
    # fmax/amax = 448/3 = 149.3 -> floor(log2) = 7 -> scale 2**-7
    assert amax_to_scale(3.0, Fp8Format.E4M3FN, Scaling.POW2) == 2.0**-7
    assert amax_to_scale(3.0, Fp8Format.E4M3FN, Scaling.POW2, margin=2) == 2.0**-5


@pytest.mark.parametrize("bad", [0.0, -0.0, float("nan"), float("inf"), -5.0])
@pytest.mark.parametrize("method", [Scaling.AMAX, Scaling.POW2])
def test_bad_amax_gives_a_safe_scale(bad, method):
    scale = amax_to_scale(bad, Fp8Format.E4M3FN, method)
    assert scale == amax_to_scale(SAFE_AMAX, Fp8Format.E4M3FN, method)
    assert math.isfinite(scale) and scale > 0


def test_constant_scaling():
    assert amax_to_scale(123.0, Fp8Format.E5M2, Scaling.CONSTANT, constant=0.5) == 0.5
    for bad in (None, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(Fp8OnnxError, match="--scale"):
            amax_to_scale(1.0, Fp8Format.E5M2, Scaling.CONSTANT, constant=bad)


def test_parse_scaling():
    assert parse_scaling("POW2") is Scaling.POW2
    with pytest.raises(Fp8OnnxError, match="Unknown scaling method 'max'"):
        parse_scaling("max")


@settings(max_examples=300, deadline=None)
@given(a=amaxes, b=amaxes, fmt=st.sampled_from(FORMATS), method=st.sampled_from([Scaling.AMAX, Scaling.POW2]))
def test_scale_is_monotone_positive_finite(a, b, fmt, method):
    lo, hi = sorted((a, b))
    s_lo, s_hi = amax_to_scale(lo, fmt, method), amax_to_scale(hi, fmt, method)
    assert 0 < s_lo <= s_hi and math.isfinite(s_hi)


@settings(max_examples=300, deadline=None)
@given(a=amaxes, fmt=st.sampled_from(FORMATS), margin=st.integers(-3, 3))
def test_pow2_is_an_exact_power_of_two_and_never_clips_amax(a, fmt, margin):
    s = amax_to_scale(a, fmt, Scaling.POW2, margin=margin)
    mantissa, _ = math.frexp(s)
    assert mantissa == 0.5
    if margin >= 0 and 2.0**-100 < s < 2.0**100:
        assert a / s <= fmt.fmax


@settings(max_examples=200, deadline=None)
@given(a=st.floats(min_value=1e-6, max_value=1e6), fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**16))
def test_round_trip_error_bounded_by_format_epsilon(a, fmt, seed):
    x = np.random.default_rng(seed).uniform(-a, a, 256).astype(np.float32)
    scale = amax_to_scale(float(np.abs(x).max()), fmt)
    y = dequantize(quantize(x, scale, fmt), scale)
    eps = float(ml_dtypes.finfo(fmt.np_dtype).eps)
    tiny = float(ml_dtypes.finfo(fmt.np_dtype).smallest_subnormal) * scale
    # Round to nearest: relative error at most eps/2 for normal values, absolute tiny/2 below.
    assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) * eps / 2, tiny / 2) * (1 + 1e-6))
