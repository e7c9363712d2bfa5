import math

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format, dequantize, parse_format, quantize, round_to_grid

from helpers import run_ort, run_reference

FORMATS = [f for f in Fp8Format if f.deployable]


def qdq_model(fmt: Fp8Format, scale: float):
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=fmt.onnx_type),
        helper.make_node("DequantizeLinear", ["q", "s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [numpy_helper.from_array(np.array(scale, np.float32), "s")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def probe_values(fmt: Fp8Format) -> np.ndarray:
    grid = np.arange(256, dtype=np.uint8).view(fmt.np_dtype).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    grid.sort()
    uniq = np.unique(grid)
    mids = (uniq[:-1] + uniq[1:]) / 2  # exact ties: round-to-nearest-even decides
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(2000).astype(np.float32) * fmt.fmax / 4
    edges = np.array([fmt.fmax * 1.5, -fmt.fmax * 3, 1e30, -1e30, np.inf, -np.inf, 0.0, -0.0, 1e-30], np.float32)
    if fmt.integer:  # onnx.reference casts int8 before it saturates: +Inf and 1e30 come out as -128 there
        edges = edges[np.abs(edges) < 1e30]
    return np.concatenate([uniq, mids, np.nextafter(mids, np.inf), noise, edges]).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("scale", [1.0, 0.037, 2.0**-9])
def test_quantize_matches_onnx_reference_and_ort(fmt, scale):
    x = probe_values(fmt) * np.float32(scale)
    ours = dequantize(quantize(x, scale, fmt), scale)
    ref = run_reference(qdq_model(fmt, scale), {"x": x})[0]
    np.testing.assert_array_equal(ours, ref)
    ort_out = run_ort(qdq_model(fmt, scale), {"x": x})[0]
    np.testing.assert_array_equal(ours, ort_out)


@pytest.mark.parametrize("fmt", list(Fp8Format), ids=lambda f: f.value)
def test_saturation_and_nan(fmt):
    q = quantize(np.array([np.inf, -np.inf, 1e9, np.nan], np.float32), 1.0, fmt).astype(np.float32)
    low = -128 if fmt.integer else -fmt.fmax  # int8 saturates to its own range, as QuantizeLinear
    assert q[0] == fmt.fmax and q[1] == low and q[2] == fmt.fmax
    assert fmt.integer or math.isnan(q[3])  # an integer has no NaN


def test_format_facts():
    assert Fp8Format.E4M3FN.fmax == 448.0
    assert Fp8Format.E5M2.fmax == 57344.0
    assert Fp8Format.E4M3FNUZ.fmax == 240.0
    assert Fp8Format.E5M2FNUZ.fmax == 57344.0
    assert Fp8Format.E4M3FN.np_dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert Fp8Format.E4M3FN.cuda_ok and not Fp8Format.E4M3FNUZ.cuda_ok
    assert Fp8Format.E3M4.fmax == 15.5 and not Fp8Format.E3M4.deployable
    assert (Fp8Format.E3M4.mantissa_bits, Fp8Format.E3M4.min_normal_exponent) == (4, -2)
    assert Fp8Format.INT8.fmax == 127.0 and Fp8Format.INT8.np_dtype == np.dtype(np.int8) and Fp8Format.INT8.integer


def test_parse_format():
    assert parse_format("E5M2") is Fp8Format.E5M2
    with pytest.raises(Fp8OnnxError, match="Unknown float8 format 'e3m5'"):
        parse_format("e3m5")


def emulated_model(scale: float, dtype=np.float32):
    import onnx_ir as ir

    from fp8onnx.passes.insert_qdq import _Builder, emulated_rounding

    graph = ir.Graph([], [], nodes=[], opset_imports={"": 21}, name="emu")
    elem = ir.DataType.from_numpy(np.dtype(dtype))
    x = ir.Value(name="x", type=ir.TensorType(elem), shape=ir.Shape(["n"]))
    graph.inputs.append(x)
    b = _Builder(graph)
    y = emulated_rounding(b, x, b.const("s", np.array(scale, dtype)), Fp8Format.E3M4, "x")
    graph.extend(b.take())
    graph.outputs.append(y)
    return ir.to_proto(ir.Model(graph, ir_version=10))


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # log(0) = -inf is part of the method
@pytest.mark.parametrize("scale", [1.0, 0.037, 2.0**-9, 3.0])
def test_e3m4_emulation_is_bit_exact_with_ml_dtypes(scale):
    x = probe_values(Fp8Format.E3M4) * np.float32(scale)
    expected = dequantize(quantize(x, scale, Fp8Format.E3M4), scale)
    model = emulated_model(scale)
    for got in (run_ort(model, {"x": x})[0], run_reference(model, {"x": x})[0]):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e30 -> inf in float16, on purpose
def test_e3m4_emulation_in_float16():
    x = (probe_values(Fp8Format.E3M4) * 0.5).astype(np.float16)
    expected = dequantize(quantize(x, 0.5, Fp8Format.E3M4), 0.5, np.float16)
    got = run_ort(emulated_model(0.5, np.float16), {"x": x})[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fmt", [f for f in Fp8Format if not f.integer])  # int8: test_int8
def test_round_to_grid_is_the_cast_bit_for_bit(fmt):
    """round_to_grid (float32 bit arithmetic) against ml_dtypes' cast there and back: every grid value,
    every midpoint (ties to even) and its neighbours, the subnormal range, random values, signed zeros."""
    rng = np.random.default_rng(0)
    grid = np.arange(256, dtype=np.uint8).view(fmt.np_dtype).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid) & (np.abs(grid) <= fmt.fmax)])
    mids = (grid[:-1] + grid[1:]) / 2
    values = np.concatenate(
        [
            grid,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
            rng.uniform(-fmt.fmax, fmt.fmax, 20000),
            rng.standard_normal(20000) * 2.0**fmt.min_normal_exponent,
            [0.0, -0.0],
        ]
    ).astype(np.float32)
    values = np.clip(values, -fmt.fmax, fmt.fmax)
    expected = values.astype(fmt.np_dtype).astype(np.float32)
    np.testing.assert_array_equal(round_to_grid(values, fmt).view(np.uint32), expected.view(np.uint32))
