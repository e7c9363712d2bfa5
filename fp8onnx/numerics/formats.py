"""The float8 formats fp8onnx can emit, and the numerics of rounding to them.

Each :class:`Fp8Format` carries its largest finite value, its ONNX and NumPy (ml_dtypes) types.
:func:`quantize` / :func:`dequantize` mirror ONNX QuantizeLinear / DequantizeLinear with
``saturate=1`` exactly: divide by the scale, clamp to +-fmax (so +-Inf saturates and NaN stays NaN),
round to nearest even on the format's grid.

E3M4 (max 15.5, one more mantissa bit than E4M3) has no ONNX type. It exists here only as an
*emulated* format for accuracy studies: the graph rounds to its grid with float ops and no runtime
can deploy the result (``deployable`` is False).

INT8 is here for the comparison the PTQ paper makes (FP8 against INT8): symmetric int8 (zero point
0, scale = amax / 127: ``fmax`` 127), rounded half to even and saturated to [-128, 127] like
QuantizeLinear, with the same scales and calibration as the float8 formats. Standard int8 Q/DQ runs
on every EP.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError

__all__ = ["EMULATED_NOTE", "Fp8Format", "dequantize", "parse_format", "quantize", "round_to_grid"]

EMULATED_NOTE = "E3M4 is emulated with float ops: a simulation for accuracy studies that no runtime can deploy"


class Fp8Format(enum.Enum):
    """A float8 format: value is the CLI name."""

    E4M3FN = "e4m3fn"
    E5M2 = "e5m2"
    E4M3FNUZ = "e4m3fnuz"
    E5M2FNUZ = "e5m2fnuz"
    E3M4 = "e3m4"
    INT8 = "int8"  # symmetric int8, the PTQ paper's baseline (not a float8 format)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(_NP[self])

    @property
    def fmax(self) -> float:
        """Largest finite value of the format (int8: 127, symmetric)."""
        return 127.0 if self is Fp8Format.INT8 else float(ml_dtypes.finfo(_NP[self]).max)

    @property
    def integer(self) -> bool:
        """True for int8: rounded to integers, no float8 grid."""
        return self is Fp8Format.INT8

    @property
    def deployable(self) -> bool:
        """False for formats that ONNX has no type for: they are emulated with float ops."""
        return self in _ONNX

    @property
    def onnx_type(self) -> int:
        return _ONNX[self]

    @property
    def ir_type(self) -> ir.DataType:
        return ir.DataType(_ONNX[self])

    @property
    def mantissa_bits(self) -> int:
        return int(-ml_dtypes.finfo(_NP[self]).machep)

    @property
    def min_normal_exponent(self) -> int:
        return int(ml_dtypes.finfo(_NP[self]).minexp)

    @property
    def cuda_ok(self) -> bool:
        """ORT's CUDA EP has float8 Q/DQ kernels for the non-FNUZ formats only (and int8 ones)."""
        return self in (Fp8Format.E4M3FN, Fp8Format.E5M2, Fp8Format.INT8)


_NP = {
    Fp8Format.E4M3FN: ml_dtypes.float8_e4m3fn,
    Fp8Format.E5M2: ml_dtypes.float8_e5m2,
    Fp8Format.E4M3FNUZ: ml_dtypes.float8_e4m3fnuz,
    Fp8Format.E5M2FNUZ: ml_dtypes.float8_e5m2fnuz,
    Fp8Format.E3M4: ml_dtypes.float8_e3m4,
    Fp8Format.INT8: np.int8,
}
_ONNX = {
    Fp8Format.E4M3FN: onnx.TensorProto.FLOAT8E4M3FN,
    Fp8Format.E5M2: onnx.TensorProto.FLOAT8E5M2,
    Fp8Format.E4M3FNUZ: onnx.TensorProto.FLOAT8E4M3FNUZ,
    Fp8Format.E5M2FNUZ: onnx.TensorProto.FLOAT8E5M2FNUZ,
    Fp8Format.INT8: onnx.TensorProto.INT8,
}


def format_of(dtype: ir.DataType | None) -> Fp8Format | None:
    """The deployable float8 format of an ONNX/IR data type, or None when it is not float8."""
    return None if dtype is None else _BY_IR_TYPE.get(dtype)


_BY_IR_TYPE = {ir.DataType(t): f for f, t in _ONNX.items()}


def parse_format(name: str | Fp8Format) -> Fp8Format:
    if isinstance(name, Fp8Format):
        return name
    try:
        return Fp8Format(str(name).lower())
    except ValueError:
        choices = ", ".join(f.value for f in Fp8Format)
        raise Fp8OnnxError(f"Unknown float8 format {name!r}; choose one of {choices}.") from None


def quantize(x: np.ndarray, scale: float | np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """``QuantizeLinear(x, scale)`` with ``saturate=1``: returns an array of ``fmt.np_dtype``."""
    y = np.asarray(x, dtype=np.float32) / np.asarray(scale, dtype=np.float32)
    # Clamp before the cast: ml_dtypes maps overflow to NaN for the FN/FNUZ types, ONNX saturates.
    if fmt.integer:  # half to even, saturating to int8's range as QuantizeLinear does (a weight, at most
        return np.rint(np.clip(y, -128.0, 127.0)).astype(fmt.np_dtype)  # amax / scale = 127, never hits -128)
    y = np.clip(y, -fmt.fmax, fmt.fmax)
    return y.astype(fmt.np_dtype)


def round_to_grid(y: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """``y`` (float32, finite, within +-``fmt.fmax``) rounded to the nearest value of ``fmt`` (ties to
    even), in float32: ``y.astype(fmt.np_dtype).astype(np.float32)`` bit for bit, about 7x faster (the
    float32 bits are rounded to the format's mantissa; below its smallest normal, to its fixed step)."""
    if fmt.integer:
        return np.rint(y)
    m, emin = fmt.mantissa_bits, fmt.min_normal_exponent
    drop = 23 - m
    bits = y.view(np.uint32)
    keep = np.uint32((0xFFFFFFFF >> drop) << drop)
    normal = ((bits + np.uint32((1 << (drop - 1)) - 1) + ((bits >> drop) & np.uint32(1))) & keep).view(np.float32)
    step = np.float32(2.0 ** (emin - m))
    out = np.where(np.abs(y) < np.float32(2.0**emin), np.rint(y / step) * step, normal)
    return out + np.float32(0) if fmt in (Fp8Format.E4M3FNUZ, Fp8Format.E5M2FNUZ) else out  # no -0 there


def dequantize(q: np.ndarray, scale: float | np.ndarray, dtype=np.float32) -> np.ndarray:
    """``DequantizeLinear(q, scale)``."""
    return (q.astype(np.float32) * np.asarray(scale, dtype=np.float32)).astype(dtype)
