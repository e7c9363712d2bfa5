import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.numerics.histogram import LogHistogram
from fp8onnx.numerics.scaling import Scaling, clipping_amax, mse_amax


def test_bins_are_exact_and_percentiles_close():
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    h = LogHistogram()
    h.update(x[:100_000])
    h.update(x[100_000:])  # merged batch by batch
    assert h.total == x.size
    for p in (50, 99, 99.99, 100):
        exact = np.percentile(np.abs(x), p)
        assert exact <= h.percentile(p) <= exact * (1 + 1 / 64) * 1.001
    lo, hi = LogHistogram.edges(np.flatnonzero(h.counts))
    assert lo.min() <= np.abs(x[x != 0]).min() and hi.max() >= np.abs(x).max()


def test_zeros_nan_inf_and_json_round_trip():
    h = LogHistogram()
    h.update(np.array([0, 0, 0, 1.0, np.nan, np.inf, -2.0], np.float32))
    assert h.zeros == 3 and h.total == 5
    assert h.percentile(50) == 0.0 and h.percentile(100) > 2.0
    back = LogHistogram.from_json(h.to_json())
    assert back.zeros == 3 and np.array_equal(back.counts, h.counts)
    assert LogHistogram().percentile(99) == 0.0


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=200))
def test_every_finite_float32_lands_in_a_bin_that_contains_it(values):
    x = np.array(values, np.float32)
    h = LogHistogram()
    h.update(x)
    assert h.total == x.size
    idx = np.flatnonzero(h.counts)
    lo, hi = LogHistogram.edges(idx)
    for v in np.abs(x[x != 0]):
        assert np.any((lo <= v) & (v < hi * (1 + 1e-12)))


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3FN, Fp8Format.E5M2, Fp8Format.E3M4], ids=lambda f: f.value)
def test_mse_threshold_is_near_optimal_on_the_real_values(fmt):
    from fp8onnx.numerics.formats import dequantize, quantize

    x = np.random.default_rng(1).laplace(size=50_000).astype(np.float32) ** 3  # heavy tail
    amax = float(np.abs(x).max())
    h = LogHistogram()
    h.update(x)

    def err(threshold):
        s = np.float32(threshold / fmt.fmax)
        return float(np.sum((dequantize(quantize(x, s, fmt), s) - x) ** 2))

    chosen = mse_amax(h, fmt, amax)
    grid = amax * 2.0 ** (-np.arange(0, 8 * 16 + 1) / 16)
    best = min(err(t) for t in grid)
    assert chosen <= amax
    assert err(chosen) <= err(amax) * 1.001
    assert err(chosen) <= best * 1.10  # bin centres stand in for the values


def test_clipping_amax_methods():
    h = LogHistogram()
    h.update(np.linspace(0, 10, 10001, dtype=np.float32))
    assert clipping_amax(10.0, h, Fp8Format.E4M3FN, Scaling.AMAX) == 10.0
    assert 9.0 < clipping_amax(10.0, h, Fp8Format.E4M3FN, Scaling.PERCENTILE, percentile=95) < 9.7
    assert clipping_amax(10.0, h, Fp8Format.E4M3FN, Scaling.PERCENTILE, percentile=100) <= 10.0
    assert clipping_amax(0.0, h, Fp8Format.E4M3FN, Scaling.MSE) == 0.0  # guarded later by amax_to_scale
