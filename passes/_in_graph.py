"""The graph-building helpers of :class:`~fp8onnx.passes.InsertQDQPass`: a builder of named nodes and
constants, the scale arrays, and the in-graph computations of quantized values: dynamic scales (per
tensor, per row; rounded up to a power of two for MX-style scales), the per-row Div/Cast/Mul, and the
float ops that emulate a format without an ONNX type."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ..numerics.formats import Fp8Format
from ..numerics.scaling import SAFE_AMAX, amax_to_scale, mx_emax
from .common import initializer
from .known import dtype as dtype_of

__all__ = ["NODE_PREFIX", "emulated_rounding", "scale_array"]

NODE_PREFIX = "fp8onnx/"
_F32 = ir.DataType.FLOAT


def scale_array(scale, dtype: ir.DataType) -> np.ndarray:
    """The scale in the tensor's float type, kept finite and positive in that type."""
    lo, hi = _scale_range(dtype)
    return np.asarray(np.clip(np.asarray(scale, np.float64), lo, hi), dtype=dtype.numpy())


def _scale_range(dtype: ir.DataType) -> tuple[float, float]:
    np_dtype = dtype.numpy()
    info = np.finfo(np.float32) if np_dtype == np.dtype("bfloat16") else np.finfo(np_dtype)
    return float(info.smallest_normal), float(info.max)


class _Builder:
    """Adds nodes (on an onnx_ir Tape) and constants to one graph, with names under ``fp8onnx/``."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.tape = ir.tape.Tape()

    @property
    def nodes(self) -> list[ir.Node]:
        return list(self.tape.nodes)

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return initializer(self.graph, f"{NODE_PREFIX}{name}", array)

    def op(self, op_type: str, inputs, name: str, dtype: ir.DataType, shape=None, **attrs) -> ir.Value:
        out = self.tape.op(op_type, inputs, attrs or None, name=f"{NODE_PREFIX}{name}")
        out.name = f"{NODE_PREFIX}{name}"
        out.dtype = dtype
        out.shape = shape
        return out

    def cast(self, value: ir.Value, to: ir.DataType, name: str) -> ir.Value:
        return value if value.dtype == to else self.op("Cast", [value], name, to, value.shape, to=int(to))

    def take(self) -> list[ir.Node]:
        nodes, self.tape = self.nodes, ir.tape.Tape()
        return nodes


def emulated_rounding(b: _Builder, x: ir.Value, scale: ir.Value, fmt: Fp8Format, prefix: str) -> ir.Value:
    """Float ops computing ``dequantize(quantize(x, scale, fmt), scale)`` for a format without an ONNX type.

    v = clip(x / scale, +-fmax); e = max(floor(log2|v|), emin), corrected by one where log2 rounding
    missed an exact power of two; step = 2**(e - mantissa bits); round half to even on that step.
    """

    def op(op_type: str, inputs, name: str, dtype: ir.DataType = _F32, **attrs) -> ir.Value:
        return b.op(op_type, inputs, f"{prefix}/{name}", dtype, x.shape, **attrs)

    def const(name: str, value: float) -> ir.Value:
        return b.const(f"const/{name}", np.array(value, np.float32))

    def as_float(flag: ir.Value, name: str) -> ir.Value:
        return op("Cast", [flag], name, to=int(_F32))

    xf, sf = b.cast(x, _F32, f"{prefix}/x_f32"), b.cast(scale, _F32, f"{prefix}/scale_f32")
    two = const("two", 2.0)
    v = op("Div", [xf, sf], "scaled")
    v = op("Clip", [v, const(f"{fmt.value}/-fmax", -fmt.fmax), const(f"{fmt.value}/fmax", fmt.fmax)], "saturated")
    a = op("Abs", [v], "abs")
    e0 = op("Floor", [op("Mul", [op("Log", [a], "ln"), const("inv_ln2", 1 / math.log(2))], "log2")], "e0")
    p = op("Pow", [two, e0], "p")
    too_big = as_float(op("Greater", [p, a], "p_gt_a", ir.DataType.BOOL), "dec")
    too_small = as_float(op("LessOrEqual", [op("Mul", [p, two], "2p"), a], "2p_le_a", ir.DataType.BOOL), "inc")
    e = op("Sub", [op("Add", [e0, too_small], "e1"), too_big], "e2")
    e = op("Max", [e, const(f"{fmt.value}/emin", fmt.min_normal_exponent)], "e")
    step = op("Pow", [two, op("Sub", [e, const(f"{fmt.value}/mbits", fmt.mantissa_bits)], "e_step")], "step")
    q = op("Mul", [op("Round", [op("Div", [v, step], "units")], "rounded"), step], "grid")
    y = op("Mul", [q, sf], "emulated_f32")
    return b.cast(y, dtype_of(x), f"{prefix}/emulated")


def _power_of_two_above(b: _Builder, s: ir.Value, prefix: str) -> ir.Value:
    """The smallest power of two >= ``s`` (float32, positive), exactly: ``2^ceil(log2 s)`` from Log, then
    one step down or up where Log's rounding put the exponent one off (at exact powers of two)."""
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    shape = s.shape
    log2 = b.op("Mul", [b.op("Log", [s], f"{prefix}/ln", _F32, shape), b.const("const/inv_ln2", f32(1 / np.log(2)))],
                f"{prefix}/log2", _F32, shape)  # fmt: skip
    p = b.op("Pow", [b.const("const/two", f32(2.0)), b.op("Ceil", [log2], f"{prefix}/exponent", _F32, shape)],
             f"{prefix}/pow2_guess", _F32, shape)  # fmt: skip
    below = b.op("Less", [p, s], f"{prefix}/pow2_below", ir.DataType.BOOL, shape)
    p = b.op("Where", [below, b.op("Add", [p, p], f"{prefix}/pow2_double", _F32, shape), p],
             f"{prefix}/pow2_up", _F32, shape)  # fmt: skip
    half = b.op("Mul", [p, b.const("const/half", f32(0.5))], f"{prefix}/pow2_half", _F32, shape)
    enough = b.op("GreaterOrEqual", [half, s], f"{prefix}/pow2_half_enough", ir.DataType.BOOL, shape)
    return b.op("Where", [enough, half, p], f"{prefix}/pow2", _F32, shape)


def _power_of_two_at_most(b: _Builder, a: ir.Value, prefix: str) -> ir.Value:
    """The largest power of two <= ``a`` (float32, positive), exactly: the smallest one >= ``a``, halved
    where it is above ``a``."""
    shape = a.shape
    p = _power_of_two_above(b, a, prefix)
    above = b.op("Greater", [p, a], f"{prefix}/pow2_above_amax", ir.DataType.BOOL, shape)
    half = b.op("Mul", [p, b.const("const/half", np.array(0.5, np.float32))], f"{prefix}/pow2_floor_half", _F32, shape)
    return b.op("Where", [above, half, p], f"{prefix}/pow2_floor", _F32, shape)


def _dynamic_scale(
    b: _Builder, x: ir.Value, fmt: Fp8Format, prefix: str, per_token: bool = False, pow2: bool | str = False
) -> ir.Value:
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    xt = dtype_of(x)
    abs_x = b.op("Abs", [x], f"{prefix}/abs", xt, x.shape)
    if per_token:  # [..., K] -> [..., 1]: one scale per row
        last = b.const("const/axes_last", np.array([-1], np.int64))
        amax = b.op("ReduceMax", [abs_x, last], f"{prefix}/amax", xt, None, keepdims=1)
    else:
        amax = b.op("ReduceMax", [abs_x], f"{prefix}/amax", xt, ir.Shape([]), keepdims=0)
    shape = amax.shape
    amax32 = b.cast(amax, _F32, f"{prefix}/amax_f32")
    if pow2 == "mx":  # OCP MX: 2^(floor(log2 amax) - emax); values above fmax * scale saturate in the cast
        base, factor, what = _power_of_two_at_most(b, amax32, prefix), 2.0 ** -mx_emax(fmt), "mx_inv_2_emax"
    else:
        base, factor, what = amax32, 1 / fmt.fmax, "inv_fmax"
    factor = b.const(f"const/{fmt.value}/{what}", f32(factor))
    s = b.op("Mul", [base, factor], f"{prefix}/raw_scale", _F32, shape)
    is_number = b.op("Equal", [s, s], f"{prefix}/not_nan", ir.DataType.BOOL, shape)
    s = b.op(
        "Where",
        [is_number, s, b.const(f"const/{fmt.value}/safe_scale", f32(amax_to_scale(SAFE_AMAX, fmt)))],
        f"{prefix}/finite_scale",
        _F32,
        shape,
    )
    if pow2 and pow2 != "mx":  # the smallest power of two at least amax / fmax: E8M0-representable, no element clipped
        s = _power_of_two_above(b, s, prefix)
    lo, hi = _scale_range(xt)
    same = xt == _F32
    s = b.op(
        "Clip",
        [s, b.const(f"const/scale_min/{xt.name}", f32(lo)), b.const(f"const/scale_max/{xt.name}", f32(hi))],
        f"{prefix}/scale" if same else f"{prefix}/scale_f32",
        _F32,
        shape,
    )
    return s if same else b.cast(s, xt, f"{prefix}/scale")


def _rows_rounded(b: _Builder, x: ir.Value, scale: ir.Value, fmt: Fp8Format, prefix: str, out: str) -> ir.Value:
    """``x / scale`` cast to ``fmt`` (saturating), back to ``x``'s type, times ``scale``: exactly
    QuantizeLinear/DequantizeLinear's values for a per-row ``scale`` (which is not a per-axis Q/DQ),
    in ops every EP runs. Nodes ``<prefix>_scaled``, ``_fp8``, ``_float`` and ``out``. For int8 (a Cast
    to int8 truncates and does not saturate): Round (half to even) and Clip to [-128, 127] instead."""
    xt = dtype_of(x)
    scaled = b.op("Div", [x, scale], f"{prefix}_scaled", xt, x.shape)
    if fmt.integer:
        rounded = b.op("Round", [scaled], f"{prefix}_round", xt, x.shape)
        lo, hi = (b.const(f"const/int8_{v}/{xt.name}", np.array(v, xt.numpy())) for v in (-128, 127))
        q = b.op("Clip", [rounded, lo, hi], f"{prefix}_int8", xt, x.shape)
        return b.op("Mul", [q, scale], out, xt, x.shape)
    q = b.op("Cast", [scaled], f"{prefix}_fp8", fmt.ir_type, x.shape, to=int(fmt.onnx_type), saturate=1)
    return b.op("Mul", [b.cast(q, xt, f"{prefix}_float"), scale], out, xt, x.shape)
