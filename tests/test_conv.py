"""Conv, opt-in with --op-types MatMul,Gemm,Conv: a small CNN built here."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.numerics.formats import Fp8Format

from helpers import assert_same_sums, op_types, run_ort, run_reference, sqnr_db, sqnr_floor_db, sum_magnitude, value_of

ALL = ("MatMul", "Gemm", "Conv")


def cnn(path, scale=1.0, bias=None):
    """x[b,3,8,8] -> Conv(4, 3x3, bias) -> Relu -> Conv(4, 1x1) -> GlobalAveragePool -> Flatten -> Gemm(2)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((4, 3, 3, 3)) * 0.3 * scale).astype(np.float32)
    w1[0] *= 30  # one loud output channel
    b1 = rng.standard_normal(4).astype(np.float32) if bias is None else np.asarray(bias, np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 2])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(b1, "b1"),
            numpy_helper.from_array((rng.standard_normal((4, 4, 1, 1)) * 0.5).astype(np.float32), "w2"),
            numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "w3"),
            numpy_helper.from_array(np.zeros(2, np.float32), "b3"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("per_channel", [False, True])
def test_cnn_with_conv(tmp_path, per_channel):
    path = cnn(tmp_path / "m.onnx")
    x = np.random.default_rng(1).standard_normal((8, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    report = fp8onnx.quantize(
        path,
        tmp_path / "q.onnx",
        tmp_path / "d.npz",
        op_types=ALL,
        per_channel=per_channel,
        preset="none",
        provider="cpu",
    )
    assert [n.name for n in report.quantized] == ["conv1", "conv2", "fc"]
    assert "quantized 3 of 3 Gemm/Conv nodes" in report.summary()
    if per_channel:
        assert [t.axis for t in report.quantized[0].tensors] == [None, 0]
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    assert "Relu" in op_types(q)
    for run in (run_ort, run_reference):  # run_ort is ORT's default level, where Relu rewrites happen
        assert sqnr_db(run(onnx.load(path), {"x": x})[0], run(q, {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, 6)


def test_conv_weights_are_per_channel_by_default_and_matmul_weights_per_tensor(tmp_path):
    path = cnn(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32))
    report = fp8onnx.quantize(
        path, tmp_path / "q.onnx", tmp_path / "d.npz", op_types=ALL, preset="none", provider="cpu"
    )
    axes = {t.name: t.axis for n in report.quantized for t in n.tensors if t.kind == "weight"}
    ops = {n.name: n.op_type for n in report.quantized}
    assert {ops[n] for n in ops} >= {"Conv", "Gemm"}
    for node in report.quantized:
        for t in node.tensors:
            if t.kind == "weight":
                assert (t.axis is not None) == (node.op_type == "Conv"), (node.name, t.name, t.axis)
    assert axes and report.config["per_channel"] == "conv" and "per-channel Conv weights" in report.summary()
    per_tensor = fp8onnx.quantize(
        path, tmp_path / "t.onnx", tmp_path / "d.npz", op_types=ALL, per_channel=False, preset="none", provider="cpu"
    )
    assert all(t.axis is None for n in per_tensor.quantized for t in n.tensors)


def test_conv_is_opt_in_with_a_reason(tmp_path):
    path = cnn(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((2, 3, 8, 8), np.float32))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", preset="none", provider="cpu")
    assert [n.name for n in report.quantized] == ["fc"]
    assert {n.name: n.reason for n in report.skipped}["conv1"] == (
        "Conv is not in --op-types (opt in with --op-types MatMul,Gemm,Conv)"
    )


def test_conv_bias_survives_ort_bias_quantization(tmp_path):
    # Tiny inputs and weights: ORT would store the bias as int32 with scale ~1e-13 and clip it.
    path = cnn(tmp_path / "m.onnx", scale=1e-4, bias=[-0.13, 0.5, 2.0, -1.0])
    x = np.random.default_rng(1).standard_normal((8, 3, 8, 8)).astype(np.float32) * 1e-4
    np.savez(tmp_path / "d.npz", x=x)
    report = fp8onnx.quantize(
        path, tmp_path / "q.onnx", tmp_path / "d.npz", op_types=ALL, per_channel=False, preset="none", provider="cpu"
    )
    ref = run_ort(onnx.load(path), {"x": x})[0]
    assert sqnr_db(ref, run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, 6)
    # the report shows the raised weight scale the model carries, not the one before raising
    w1 = next(t for n in report.quantized for t in n.tensors if t.name == "w1")
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "q.onnx").graph.initializer}
    assert w1.scale == pytest.approx(float(inits["fp8onnx/w1/scale"]))
    assert w1.scale > w1.amax / 448 * 1.5


def decoder_cnn(path, group=1):
    """x[b,4,4,4] -> ConvTranspose(4->6, 2x2, stride 2, bias, group) -> Relu -> Conv(6->2, 1x1): an upsampling head."""
    rng = np.random.default_rng(2)
    wt = (rng.standard_normal((4, 6 // group, 2, 2)) * 0.4).astype(np.float32)
    wt[:, 0] *= 20  # one loud output channel (axis 1)
    nodes = [
        helper.make_node("ConvTranspose", ["x", "wt", "bt"], ["u"], name="up", strides=[2, 2], group=group),
        helper.make_node("Relu", ["u"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2, 8, 8])],
        [
            numpy_helper.from_array(wt, "wt"),
            numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "bt"),
            numpy_helper.from_array((rng.standard_normal((2, 6, 1, 1)) * 0.5).astype(np.float32), "w2"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("per_channel, group", [(False, 1), (True, 1), (True, 2)])
def test_conv_transpose(tmp_path, per_channel, group):
    path = decoder_cnn(tmp_path / "m.onnx", group)
    x = np.random.default_rng(1).standard_normal((8, 4, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    report = fp8onnx.quantize(
        path,
        tmp_path / "q.onnx",
        tmp_path / "d.npz",
        op_types=("ConvTranspose", "Conv"),
        per_channel=per_channel,
        preset="none",
        provider="cpu",
    )
    assert [n.name for n in report.quantized] == ["up", "head"]
    assert "quantized 2 of 2 Conv/ConvTranspose nodes" in report.summary()
    if per_channel:  # weight [C, M/group, k, k]: its output channels are axis 1
        assert [t.axis for t in report.quantized[0].tensors] == [None, 1]
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    # onnx.reference's ConvTranspose mishandles group > 1 (it reshapes W as if group were 1)
    for run in (run_ort, run_reference) if group == 1 else (run_ort,):
        assert sqnr_db(run(onnx.load(path), {"x": x})[0], run(q, {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, 4)


def test_conv_transpose_is_opt_in_with_a_reason(tmp_path):
    path = decoder_cnn(tmp_path / "m.onnx")
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", preset="none", provider="cpu")
    assert {n.name: n.reason for n in report.skipped}["up"] == (
        "ConvTranspose is not in --op-types (opt in with --op-types MatMul,Gemm,ConvTranspose)"
    )
    assert report.summary().splitlines()[0].startswith("NOTHING QUANTIZED")


def test_the_cnn_preset_keeps_the_stem_in_float(tmp_path):
    """requires: a CNN whose first Conv reads the input; ensures: with --preset cnn (and under auto,
    the CNN family) that Conv stays in float with its reason, every later Conv and the Gemm are in
    float8, and the output is as close to FP32 as with every Conv quantized, within 1 dB (on this
    random CNN; on the digits CNN the stem in float is what keeps top-1 agreement at 1.000)."""
    from fp8onnx.graph.model_io import load_model
    from fp8onnx.graph.plan import stem_convolutions

    path = cnn(tmp_path / "m.onnx")
    x = np.random.default_rng(1).standard_normal((64, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x[:32])
    ref = run_ort(path, {"x": x[32:]})[0]
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")  # auto: CNN
    assert report.family["family"] == "CNN" and report.config["preset"] == "cnn"
    kept = {n.name: n.reason for n in report.nodes if not n.quantized}
    assert list(kept) == ["conv1"] and "stem convolution" in kept["conv1"]
    dq = op_types(onnx.load(tmp_path / "q.onnx")).count("DequantizeLinear")
    assert dq >= 2 * 2  # conv2 and fc: a weight DQ and an activation Q/DQ each
    every = fp8onnx.quantize(path, tmp_path / "e.onnx", tmp_path / "d.npz", preset="cnn", float_stem=False)
    assert [n.name for n in every.nodes if not n.quantized] == []
    stem_db = sqnr_db(ref, run_ort(tmp_path / "q.onnx", {"x": x[32:]})[0])
    every_db = sqnr_db(ref, run_ort(tmp_path / "e.onnx", {"x": x[32:]})[0])
    assert stem_db > every_db - 1 and stem_db > 25, (stem_db, every_db)
    # a Conv behind elementwise steps is a stem too; one behind another Conv is not
    assert [n.name for n in stem_convolutions(load_model(path))] == ["conv1"]


def spread_conv(path, group: int = 1):
    """x[b, 16, 6, 6] -> Conv(8 filters, 3x3, ``group``): the input channels' weights range over 10^5
    (and the inputs the other way), so one scale per output channel flushes the small ones."""
    rng = np.random.default_rng(5)
    channels = np.logspace(-5, 0, 16 // group, dtype=np.float32)
    w = (rng.standard_normal((8, 16 // group, 3, 3)) * channels[None, :, None, None]).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "bias"], ["y"], name="conv", group=group)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8, 4, 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "bias")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((16, 16, 6, 6)).astype(np.float32) / np.tile(channels, group)[None, :, None, None]
    return path, x.astype(np.float32)


def block_forms(tmp_path, path, x, op_type: str, block: int):
    """``path`` quantized with ``--weight-block-size block`` on ``op_type`` only, static activations from
    ``x``: (the blocked model, its weight's DequantizeLinear, its output on ORT CPU, the CUDA EP's
    per-axis form's output on ORT CPU), having checked that the two forms' weights are the same values
    bit for bit and their outputs the same up to the summation order; and weight-only (the
    activations' own spread would hide the weights' error) the SQNR in dB of blocks and of per-channel
    scales against the float model."""
    feed = {"x": x}
    np.savez(tmp_path / "c.npz", x=x)
    common = {"op_types": (op_type,), "preset": "none", "provider": "cpu", "calib": tmp_path / "c.npz"}
    results, weights = {}, {}
    for target in ("onnxruntime", "onnxruntime-cuda"):
        out = tmp_path / f"{target}.onnx"
        fp8onnx.quantize(path, out, weight_block_size=block, target=target, **common)
        results[target] = run_ort(out, feed)[0]
        (conv,) = [n for n in onnx.load(out).graph.node if n.op_type == op_type]
        weights[target] = value_of(out, conv.input[1], feed)
    # exact: element-wise DequantizeLinear, Reshape, QuantizeLinear in NumPy (onnx.reference)
    np.testing.assert_array_equal(weights["onnxruntime"].view(np.uint32), weights["onnxruntime-cuda"].view(np.uint32))
    # the outputs: one convolution of the same values by two graphs, equal up to the summation order
    sums = sum_magnitude(tmp_path / "onnxruntime.onnx", feed)
    assert_same_sums(results["onnxruntime"], results["onnxruntime-cuda"], *sums)
    model = onnx.load(tmp_path / "onnxruntime.onnx")
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[1].endswith("w/scale")]
    weight_only = {**common, "activations": "none", "calib": None}
    fp8onnx.quantize(path, tmp_path / "c.onnx", per_channel=True, **weight_only)
    fp8onnx.quantize(path, tmp_path / "b.onnx", weight_block_size=block, **weight_only)
    ref = run_ort(path, feed)[0]
    per_channel, blocks = (sqnr_db(ref, run_ort(tmp_path / f"{n}.onnx", feed)[0]) for n in ("c", "b"))
    return model, dq, results["onnxruntime"], results["onnxruntime-cuda"], blocks, per_channel


@pytest.mark.parametrize("group", [1, 2])
def test_conv_block_scales_run_along_input_channels_times_kernel(tmp_path, group):
    """--weight-block-size on Conv: the weight [M, C/group, kh, kw] stored as float8 [M, C/group x kh x kw]
    with a blocked DequantizeLinear (axis 1), reshaped back; onnx.reference and ORT CPU agree, blocks
    beat per-channel scales where input channels differ in range, and the CUDA EP's per-axis form
    gives the same weight values bit for bit (and the same outputs up to the summation order)."""
    path, x = spread_conv(tmp_path / "m.onnx", group)
    model, dq, got, _, blocks_db, per_channel_db = block_forms(tmp_path, path, x, "Conv", 18)
    codes = next(i for i in model.graph.initializer if i.name == dq.input[0])
    assert list(codes.dims) == [8, 16 // group * 9] and {a.name: a.i for a in dq.attribute}["block_size"] == 18
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["DequantizeLinear", "Reshape", "QuantizeLinear", "DequantizeLinear", "Conv"], ops
    np.testing.assert_allclose(run_reference(model, {"x": x})[0], got, rtol=1e-4, atol=1e-4)
    assert blocks_db > per_channel_db + 6  # weight-only, measured 32.7 vs 23.4 dB


def spread_conv_transpose(path, group: int = 1):
    """x[b, 16, 4, 4] -> ConvTranspose(16 -> 4 * group, 2x2, stride 2, ``group``): the input channels'
    weights range over 10^5 (and the inputs the other way), so one scale per output channel flushes the
    small ones."""
    rng = np.random.default_rng(7)
    channels = np.logspace(-5, 0, 16, dtype=np.float32)
    w = (rng.standard_normal((16, 4, 2, 2)) * channels[:, None, None, None]).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "w", "bias"], ["y"], name="up", strides=[2, 2], group=group)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4 * group, 8, 8])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(rng.standard_normal(4 * group).astype(np.float32), "bias"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((16, 16, 4, 4)).astype(np.float32) / channels[None, :, None, None]
    return path, x.astype(np.float32)


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_block_scales_run_along_input_channels(tmp_path, group):
    """--weight-block-size on ConvTranspose: the weight [C, M/group, kh, kw] stored as float8
    [C, M/group x kh x kw] with a blocked DequantizeLinear along axis 0 (blocks of input channels, the
    reduction, at each output channel and tap), reshaped back; onnx.reference (group 1: it mishandles
    groups) and ORT CPU agree, the CUDA EP's per-axis form gives the same weight values bit for bit, and
    blocks beat per-channel scales where input channels differ in range."""
    path, x = spread_conv_transpose(tmp_path / "m.onnx", group)
    model, dq, got, _, blocks_db, per_channel_db = block_forms(tmp_path, path, x, "ConvTranspose", 4)
    codes = next(i for i in model.graph.initializer if i.name == dq.input[0])
    scales = next(i for i in model.graph.initializer if i.name == dq.input[1])
    attrs = {a.name: a.i for a in dq.attribute}
    assert list(codes.dims) == [16, 16] and list(scales.dims) == [4, 16] and attrs == {"axis": 0, "block_size": 4}
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["DequantizeLinear", "Reshape", "QuantizeLinear", "DequantizeLinear", "ConvTranspose"], ops
    if group == 1:
        np.testing.assert_allclose(run_reference(model, {"x": x})[0], got, rtol=1e-4, atol=1e-4)
    assert blocks_db > per_channel_db + 6  # weight-only, measured 33.7 vs 20.5 dB (group 1)
