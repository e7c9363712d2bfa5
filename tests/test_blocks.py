"""Block-wise weight scales (--weight-block-size): one scale per block of K elements and output
channel, stored as opset 21's blocked DequantizeLinear; checked for structure, against
onnx.reference and onnxruntime CPU at its default optimisation level, and by SQNR in dB against the
unquantized graph."""

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.numerics.formats import Fp8Format

from helpers import assert_same_sums, run_ort, run_reference, sqnr_db, value_of


def layer(path, k: int, n: int = 24, gemm: bool = False, seed: int = 0, spread: float = 6, correlated: bool = False):
    """x[b, k] -> MatMul (or Gemm with transB) -> y. The weight's rows range over 10^6 along K and the
    inputs the other way, so every row adds as much to the output: one scale per output channel sized
    for the largest row leaves the smallest below float8's subnormals, one per block of K does not."""
    rng = np.random.default_rng(seed)
    rows = np.logspace(-spread, 0, k, dtype=np.float32)[:, None]
    w = rng.standard_normal((k, n)).astype(np.float32) * rows
    node = (
        helper.make_node("Gemm", ["x", "w"], ["y"], name="fc", transB=1)
        if gemm
        else helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")
    )
    weight = numpy_helper.from_array(np.ascontiguousarray(w.T) if gemm else w, "w")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])],
        [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((256, k))
    if correlated:  # inputs on a few directions, as a layer's are: where GPTQ's error feedback pays
        x = x @ np.diag(np.linspace(0.1, 1, k)) + rng.standard_normal((256, 4)) @ rng.standard_normal((4, k)) * 3
    return path, (x / rows.T).astype(np.float32)


def _dq(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "DequantizeLinear")


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize(("k", "block"), [(64, 16), (64, 32), (48, 32)])  # 48: the last block is shorter
@pytest.mark.parametrize("gemm", [False, True])
def test_block_scales_structure_and_numbers(tmp_path, fmt, k, block, gemm):
    path, x = layer(tmp_path / "m.onnx", k, gemm=gemm)
    np.savez(tmp_path / "c.npz", x=x[:128])
    feed = {"x": x[128:]}
    ref = run_ort(path, feed)[0]
    sqnr = {}
    for name, options in (("channel", {"per_channel": True}), ("block", {"weight_block_size": block})):
        out = tmp_path / f"{name}.onnx"
        fp8onnx.quantize(path, out, activations="none", format=fmt, preset="none", **options)
        got = run_ort(out, feed)[0]
        assert np.allclose(got, run_reference(out, feed)[0], rtol=1e-5, atol=1e-5)
        sqnr[name] = sqnr_db(ref, got)
    model = onnx.load(out)
    dq = _dq(model)
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": 1 if gemm else 0, "block_size": block}
    scale = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == dq.input[1]))
    blocks = -(-k // block)
    assert scale.shape == ((24, blocks) if gemm else (blocks, 24))
    # E4M3 spans 10^5.4 with its subnormals: per channel, the smallest rows vanish; per block they
    # keep their precision. E5M2 spans 10^9.6: one scale per channel already covers these rows.
    if fmt == "e4m3fn":
        assert sqnr["block"] > sqnr["channel"] + 10, sqnr
    assert sqnr["block"] >= sqnr["channel"] - 0.5, sqnr
    assert sqnr["block"] > {"e4m3fn": 24, "e5m2": 20}[fmt], sqnr


def test_pow2_block_scales_are_powers_of_two_e8m0(tmp_path):
    path, _ = layer(tmp_path / "m.onnx", 64)
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(path, out, activations="none", scaling="pow2", weight_block_size=32, preset="none")
    model = onnx.load(out)
    scale = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == _dq(model).input[1]))
    mantissa, _ = np.frexp(scale)
    assert scale.shape == (2, 24) and np.all(mantissa == 0.5)


def test_stored_weights_are_the_blocks_grid_values(tmp_path):
    """The float8 codes times their block's scale are the weights onnxruntime computes with: quantizing
    the dequantized weight again with the same scales gives the same codes (they are on the grid)."""
    path, _ = layer(tmp_path / "m.onnx", 64)
    out = tmp_path / "q.onnx"
    fp8onnx.quantize(path, out, activations="none", weight_block_size=16, preset="none")
    model = onnx.load(out)
    dq = _dq(model)
    tensors = {t.name: t for t in model.graph.initializer}
    codes = np.frombuffer(tensors[dq.input[0]].raw_data, dtype=ml_dtypes.float8_e4m3fn).reshape(64, 24)
    scale = np.repeat(numpy_helper.to_array(tensors[dq.input[1]]), 16, axis=0)
    w = codes.astype(np.float32) * scale
    again = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(again.view(np.uint8), codes.view(np.uint8))
    fmax = Fp8Format.E4M3FN.fmax
    original = numpy_helper.to_array(onnx.load(path).graph.initializer[0])
    per_block = np.abs(original).reshape(4, 16, 24).max(axis=1)
    np.testing.assert_allclose(numpy_helper.to_array(tensors[dq.input[1]]), per_block / fmax, rtol=1e-6)
    assert np.max(np.abs(w - original) / np.repeat(per_block, 16, axis=0)) <= 2.0**-4  # half an E4M3 step


def test_gptq_rounds_on_the_block_grid(tmp_path):
    path, x = layer(tmp_path / "m.onnx", 64, spread=1, correlated=True)
    np.savez(tmp_path / "c.npz", x=x[:128])
    feed = {"x": x[128:]}
    ref = run_ort(path, feed)[0]
    sqnr = {}
    for rounding in ("nearest", "gptq"):
        out = tmp_path / f"{rounding}.onnx"
        fp8onnx.quantize(
            path,
            out,
            tmp_path / "c.npz" if rounding == "gptq" else None,
            activations="none",
            weight_block_size=16,
            weight_rounding=rounding,
            preset="none",
        )
        sqnr[rounding] = sqnr_db(ref, run_ort(out, feed)[0])
        assert _dq(onnx.load(out)).attribute  # still the blocked form
    assert sqnr["gptq"] > sqnr["nearest"] + 6, sqnr  # measured: +12 to +14 dB over three seeds


def test_block_size_needs_a_scale_per_block(tmp_path):
    path, _ = layer(tmp_path / "m.onnx", 64)
    with pytest.raises(fp8onnx.Fp8OnnxError, match="--weight-block-size contradicts --scaling constant"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", scaling="constant", scale=1.0, weight_block_size=32, preset="none")
    with pytest.raises(fp8onnx.Fp8OnnxError, match="--weight-block-size must be a non-negative integer"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", weight_block_size=-1, activations="none", preset="none")


def test_blocks_with_bias_correction_and_sequential_calibration(tmp_path):
    """Bias correction measures what the block-scaled weights lose; sequential calibration propagates
    through them: both run and stay close to the float model."""
    from helpers import mlp_data, mlp_model

    path, data = mlp_model(tmp_path / "m.onnx", hidden=64), mlp_data(tmp_path / "c.npz")
    feed = {"x": np.load(data)["x"]}
    ref = run_ort(path, feed)[0]
    reports = {}
    for name, options in (
        ("bc", {"bias_correction": True}),
        ("seq", {"sequential": True, "weight_rounding": "gptq", "activations": "none"}),
    ):
        out = tmp_path / f"{name}.onnx"
        reports[name] = fp8onnx.quantize(path, out, data, weight_block_size=16, preset="none", **options)
        assert reports[name].modified and sqnr_db(ref, run_ort(out, feed)[0]) > 25
        blocked = [n for n in onnx.load(out).graph.node if n.op_type == "DequantizeLinear" and n.attribute]
        assert any(a.name == "block_size" for n in blocked for a in n.attribute)
    assert any("bias correction of 1 layers" in line for line in reports["bc"].prepared)


@pytest.mark.parametrize(("k", "block"), [(64, 32), (48, 32), (96, 16)])  # 48: the last block is padded
@pytest.mark.parametrize("gemm", [False, True])
def test_per_axis_form_for_the_cuda_ep_has_the_blocked_forms_weights_bit_for_bit(tmp_path, k, block, gemm):
    """--target onnxruntime-cuda --gemm-op qdq: no DequantizeLinear with block_size (the CUDA EP has no blocked float8
    DQ); a per-axis one over rows of one block, reshaped back: the same weight values bit for bit. The
    outputs are the same product computed by two graphs: onnxruntime may run them with other kernels
    (a Gemm's B constant or computed, prepacked or not), so they agree up to the summation order."""
    path, x = layer(tmp_path / "m.onnx", k, gemm=gemm)
    feed = {"x": x[:32]}
    outs, weights = {}, {}
    for target in ("onnxruntime", "onnxruntime-cuda"):
        out = tmp_path / f"{target}.onnx"
        options = {"activations": "none", "preset": "none", "weight_block_size": block, "gemm_op": "qdq"}
        fp8onnx.quantize(path, out, target=target, **options)
        model = onnx.load(out)
        dq = _dq(model)
        blocked = {a.name: a.i for a in dq.attribute}.get("block_size", 0)
        assert blocked == (block if target == "onnxruntime" else 0)
        (fc,) = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
        weights[target] = value_of(model, fc.input[1], feed)
        outs[target] = (run_ort(out, feed)[0], run_reference(out, feed)[0])
    # exact: element-wise DequantizeLinear and Reshape in NumPy (onnx.reference), the same on every CPU
    np.testing.assert_array_equal(weights["onnxruntime"].view(np.uint32), weights["onnxruntime-cuda"].view(np.uint32))
    w = weights["onnxruntime"].T if gemm else weights["onnxruntime"]
    magnitude = np.abs(feed["x"]).astype(np.float64) @ np.abs(w).astype(np.float64)
    for a, b in zip(outs["onnxruntime"], outs["onnxruntime-cuda"]):
        assert_same_sums(a, b, k, magnitude)
    info = fp8onnx.inspect(tmp_path / "onnxruntime-cuda.onnx")
    (weight,) = [t for t in info["float8_tensors"] if t["kind"] == "weight"]
    assert weight["granularity"].startswith(f"block {block} along axis {1 if gemm else 0} (per-axis form")
    assert any(f"block-wise scales (per-axis form, block {block})" in p for p in info["tensorrt_problems"])


def test_the_cuda_target_takes_its_formats_only(tmp_path):
    with pytest.raises(fp8onnx.Fp8OnnxError, match="onnxruntime-cuda takes e4m3fn and e5m2"):
        fp8onnx.QuantizeConfig(format="e4m3fnuz", target="onnxruntime-cuda")
