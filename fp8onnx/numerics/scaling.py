"""From a tensor's absolute maximum to the ONNX QuantizeLinear scale (FP8-AMAX and friends).

ONNX *divides* by its scale: ``q = x / scale``. Training libraries (TransformerEngine, torchao)
usually keep the inverse, ``fmax / amax``, and multiply. :func:`amax_to_scale` is the only place
in fp8onnx that turns an amax into a scale, so that convention lives here and nowhere else.

Methods:
  ``amax``       scale = amax / fmax: the tensor's largest value lands on the format's largest.
  ``pow2``       the FP8 LLM paper's exponent bias b = floor(log2(fmax / amax)) - margin, scale = 2**-b:
                 the scale is an exact power of two, so scaling only shifts the exponent.
  ``percentile`` amax replaced by the p-th percentile of |x| (clips rare outliers), then as ``amax``.
  ``mse``        amax replaced by the clipping threshold that minimises the squared quantization
                 error of the calibration histogram under the chosen format, then as ``amax``.
  ``constant``   one user-given scale for every tensor (the paper's FP8-CSCALE baseline).
  ``mx``         OCP Microscaling's rule: scale = 2**(floor(log2(amax)) - emax), emax the exponent of
                 the format's largest value (E4M3: 8), so amax / scale lands in [2**emax, 2**(emax+1)):
                 a power of two like ``pow2`` but rounded down, values above fmax saturate.

``percentile`` and ``mse`` need a histogram; they apply to activations. Weights, whose every value
is known, keep their max (``amax``, or ``pow2`` / ``mx`` when chosen).

An amax of 0 (a tensor that never left zero), NaN or Inf never yields a zero, NaN or Inf scale.
"""

from __future__ import annotations

import enum
import logging
import math

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format, quantize
from fp8onnx.numerics.histogram import LogHistogram

__all__ = [
    "DEFAULT_PERCENTILE",
    "SAFE_AMAX",
    "Scaling",
    "amax_to_scale",
    "amax_to_scales",
    "check_percentile",
    "clipping_amax",
    "expand_blocks",
    "mse_amax",
    "mx_emax",
    "parse_scaling",
]

logger = logging.getLogger(__name__)

# Used in place of an amax of zero, NaN or Inf: any positive finite value gives a valid scale
# for a tensor that is all zeros, and a NaN/Inf amax means calibration saw no usable range.
SAFE_AMAX = 1.0
DEFAULT_PERCENTILE = 99.99
# float32 range limits for a scale: keep scale and 1/scale finite and normal.
_MIN_SCALE, _MAX_SCALE = 2.0**-100, 2.0**100


class Scaling(enum.Enum):
    AMAX = "amax"
    POW2 = "pow2"
    PERCENTILE = "percentile"
    MSE = "mse"
    CONSTANT = "constant"
    MX = "mx"

    @property
    def needs_histogram(self) -> bool:
        return self in (Scaling.PERCENTILE, Scaling.MSE)


def parse_scaling(name: str | Scaling) -> Scaling:
    if isinstance(name, Scaling):
        return name
    try:
        return Scaling(str(name).lower())
    except ValueError:
        choices = ", ".join(s.value for s in Scaling)
        raise Fp8OnnxError(f"Unknown scaling method {name!r}; choose one of {choices}.") from None


def _usable(amax: float) -> bool:
    return math.isfinite(amax) and amax > 0.0


def mx_emax(fmt: Fp8Format) -> int:
    """The exponent of ``fmt``'s largest value (E4M3FN 8, E5M2 15, E4M3FNUZ 7, E3M4 3; int8 6, as
    MXINT8's 1.6 fixed point): OCP MX's emax_elem."""
    return math.floor(math.log2(fmt.fmax))


def amax_to_scale(
    amax: float,
    fmt: Fp8Format,
    method: Scaling = Scaling.AMAX,
    *,
    margin: int = 0,
    constant: float | None = None,
) -> float:
    """Return the QuantizeLinear scale (divisor) for a tensor whose absolute maximum is ``amax``.

    The result is always a finite, strictly positive float32-representable number.
    """
    if method is Scaling.CONSTANT:
        if constant is None or not math.isfinite(constant) or constant <= 0:
            raise Fp8OnnxError(f"Constant scaling needs a positive finite --scale, got {constant!r}.")
        return float(constant)
    amax = float(amax)
    if not _usable(amax):
        amax = SAFE_AMAX
    if method in (Scaling.AMAX, Scaling.PERCENTILE, Scaling.MSE):
        scale = amax / fmt.fmax
    elif method is Scaling.POW2:
        bias = math.floor(math.log2(fmt.fmax / amax)) - int(margin)
        scale = 2.0 ** (-bias)
    elif method is Scaling.MX:
        scale = 2.0 ** (math.floor(math.log2(amax)) - mx_emax(fmt))
    else:  # pragma: no cover - the enum is closed
        raise Fp8OnnxError(f"Unknown scaling method {method!r}.")
    return float(min(max(scale, _MIN_SCALE), _MAX_SCALE))


def amax_to_scales(amax: np.ndarray, fmt: Fp8Format, method: Scaling = Scaling.AMAX, *, margin: int = 0) -> np.ndarray:
    """:func:`amax_to_scale`'s formula on every element of ``amax`` at once (block scales: thousands per
    weight), float64; amax, pow2 and mx (clipping and constant scaling have no per-block form here)."""
    amax = np.asarray(amax, np.float64)
    amax = np.where(np.isfinite(amax) & (amax > 0), amax, SAFE_AMAX)
    if method in (Scaling.AMAX, Scaling.PERCENTILE, Scaling.MSE):
        scale = amax / fmt.fmax
    elif method is Scaling.POW2:
        scale = 2.0 ** -(np.floor(np.log2(fmt.fmax / amax)) - int(margin))
    elif method is Scaling.MX:
        scale = 2.0 ** (np.floor(np.log2(amax)) - mx_emax(fmt))
    else:
        raise Fp8OnnxError(f"Scaling {method.value!r} has no per-block form.")
    return np.clip(scale, _MIN_SCALE, _MAX_SCALE)


def expand_blocks(scale: np.ndarray, shape, axis: int, block: int) -> np.ndarray:
    """Block scales (``shape`` with ``axis`` divided into blocks of ``block``, the last one shorter)
    repeated to one scale per element of a tensor of ``shape``: DequantizeLinear's ``block_size``."""
    return np.repeat(np.asarray(scale), block, axis=axis).take(np.arange(shape[axis]), axis=axis)


def check_percentile(percentile: float) -> None:
    """The one rule for --percentile: which percentile of |x| maps to fmax, in (0, 100]."""
    if not 0 < percentile <= 100:
        raise Fp8OnnxError(f"--percentile must be in (0, 100], got {percentile!r}.")


def clipping_amax(
    amax: float,
    hist: LogHistogram | None,
    fmt: Fp8Format,
    method: Scaling,
    *,
    percentile: float = DEFAULT_PERCENTILE,
) -> float:
    """The absolute value that should map to ``fmt.fmax``: amax itself, or a clipped one."""
    if not method.needs_histogram:
        return amax
    if hist is None:
        raise Fp8OnnxError(f"{method.value} scaling needs histograms; calibrate again with this version of fp8onnx.")
    if method is Scaling.PERCENTILE:
        check_percentile(percentile)
        return min(hist.percentile(percentile), amax) if _usable(amax) else amax
    return mse_amax(hist, fmt, amax)


def mse_amax(hist: LogHistogram, fmt: Fp8Format, amax: float, octaves: int = 8, steps_per_octave: int = 16) -> float:
    """Threshold in [amax * 2**-octaves, amax] minimising sum(count * (x - dq(q(x)))**2) over the bins."""
    if not _usable(amax):
        return amax
    centres, counts = hist.nonzero()
    if counts.sum() == 0:
        return amax
    candidates = amax * 2.0 ** (-np.arange(octaves * steps_per_octave + 1) / steps_per_octave)
    scales = candidates / fmt.fmax
    x = centres.astype(np.float32)[:, None]
    # The same rounding as the graph: divide, saturate, round to the format's grid, multiply back.
    err = (quantize(x, scales[None, :].astype(np.float32), fmt).astype(np.float32) * scales[None, :] - x) ** 2
    best = int(np.argmin(counts @ err))
    return float(candidates[best])
