"""The CUDA fast form (com.microsoft.MatMulBlockQuantizedFp8Weight): written from fp8onnx's Q/DQ
(structure: the same float8 codes and scales, W8A8 or W8A16), emulated on the CPU EP with the CUDA
kernel's numerics (against a NumPy reference written from the schema text), and as accurate as the
Q/DQ form it replaces (SQNR in dB against the float model)."""

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.graph.runtime import make_session
from fp8onnx.numerics.gemm_float8_ref import matmul_block_quantized_fp8_weight as reference
from fp8onnx.passes import BLOCK_FP8_OP, EmulateBlockFp8MatMulPass

from helpers import SAMPLE, run_ort, run_reference, sqnr_db, summation_tolerance

E4M3 = ml_dtypes.float8_e4m3fn


def layer(path, k=96, n=40, gemm=False, bias=False, alpha=1.0, seed=0):
    """x[b, k] -> MatMul (or Gemm with transB, a bias and alpha) -> y, float32, opset 21."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * np.logspace(-2, 0, k)[:, None]).astype(np.float32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(w.T) if gemm else w, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
        inputs.append("b")
    node = (
        helper.make_node("Gemm", inputs, ["y"], name="fc", transB=1, alpha=alpha)
        if gemm
        else helper.make_node("MatMul", inputs, ["y"], name="fc")
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((128, k)).astype(np.float32)
    np.savez(path.with_suffix(".npz"), x=x[:64])
    return path, x[64:]


def _fast_nodes(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == BLOCK_FP8_OP and n.domain == "com.microsoft"]


def _inits(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _emulated(path, out):
    model = ir.load(path)
    EmulateBlockFp8MatMulPass()(model)
    ir.save(model, out)
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"weight_block_size": 32},
        {"weight_block_size": 40},  # 96 = 2 x 40 + 16: the last block shorter
        {"per_channel": True},
        {"per_channel": False},
    ],
    ids=["blocks32", "blocks40", "per-channel", "per-tensor"],
)
@pytest.mark.parametrize("gemm", [False, True], ids=["matmul", "gemm"])
def test_the_fast_form_keeps_the_qdq_forms_codes_and_scales(tmp_path, options, gemm):
    """The op's B is the Q/DQ form's float8 codes laid out [N, K]; b_scale its scales as [N, blocks]
    (one block over K for per-channel and per-tensor scales); static E4M3 activations become a_scale."""
    path, x = layer(tmp_path / "m.onnx", gemm=gemm, bias=gemm, alpha=0.5 if gemm else 1.0)
    common = {"preset": "none", "precision": "fp16", "provider": "cpu", "calib": path.with_suffix(".npz"), **options}
    fp8onnx.quantize(path, tmp_path / "qdq.onnx", gemm_op="qdq", **common)
    report = fp8onnx.quantize(path, tmp_path / "fast.onnx", gemm_op="block-fp8", **common)
    assert report.fast_form["w8a8"] == ["fc"] and not report.fast_form["kept_qdq"]
    assert "1 MatMul/Gemm written as com.microsoft.MatMulBlockQuantizedFp8Weight" in report.summary()
    qdq, fast = onnx.load(tmp_path / "qdq.onnx"), onnx.load(tmp_path / "fast.onnx")
    onnx.checker.check_model(fast, full_check=True)
    (node,) = _fast_nodes(fast)
    assert "DequantizeLinear" not in [n.op_type for n in fast.graph.node]
    block = {a.name: a.i for a in node.attribute}["block_size"]
    q_init, f_init = _inits(qdq), _inits(fast)
    dq_w = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in q_init)
    codes, scale = q_init[dq_w.input[0]], q_init[dq_w.input[1]].astype(np.float32)
    b, b_scale, a_scale = (f_init[name] for name in node.input[1:4])
    n_k = codes if gemm else codes.T  # the Q/DQ form keeps the model's layout
    # exact: float8 codes and scales are fp8onnx's own (NumPy), not a kernel's
    np.testing.assert_array_equal(b.view(np.uint8), np.ascontiguousarray(n_k).view(np.uint8))
    k = n_k.shape[1]
    assert block == options.get("weight_block_size", k) and b_scale.shape == (40, -(-k // block))
    if block < k:
        expected = scale if gemm else scale.T
    else:
        expected = np.broadcast_to(scale.reshape(-1, 1) if scale.size > 1 else scale, (40, 1))
    alpha = 0.5 if gemm else 1.0
    np.testing.assert_array_equal(b_scale, (expected * np.float32(alpha)).astype(np.float32))
    act_scale = next(q_init[n.input[1]] for n in qdq.graph.node if n.op_type == "QuantizeLinear")
    assert a_scale.shape == () and a_scale == act_scale.astype(np.float32)
    if gemm:  # the Gemm's bias is the op's, in the graph's float16
        assert len(node.input) == 5 and f_init[node.input[4]].dtype == np.float16
        np.testing.assert_array_equal(f_init[node.input[4]], _inits(onnx.load(path))["b"].astype(np.float16))
    # numbers: the emulated op against the Q/DQ form, both against the float model
    feed = {"x": x}
    ref = run_ort(path, feed)[0]
    got = run_ort(_emulated(tmp_path / "fast.onnx", tmp_path / "emulated.onnx"), feed)[0]
    want = run_ort(tmp_path / "qdq.onnx", feed)[0]
    assert sqnr_db(ref, got) > sqnr_db(ref, want) - 0.5
    assert sqnr_db(ref, got) > 20


def test_weight_only_and_dynamic_activations_are_w8a16(tmp_path):
    path, _ = layer(tmp_path / "m.onnx")
    for activations, calib in (("none", None), ("dynamic-per-token", None)):
        report = fp8onnx.quantize(
            path, tmp_path / f"{activations}.onnx", calib, activations=activations, preset="none", gemm_op="block-fp8"
        )
        assert report.fast_form["w8a16"] == ["fc"] and report.fast_form["w8a8"] == []
        (node,) = _fast_nodes(onnx.load(tmp_path / f"{activations}.onnx"))
        assert len(node.input) == 3  # no a_scale
        assert report.config["precision"] == "fp16"  # the op's A


def test_a_float32_graph_is_cast_in_and_out(tmp_path):
    """--precision model on a float32 model: the op takes float16, so A is cast in and Y back."""
    path, x = layer(tmp_path / "m.onnx")
    options = {"preset": "none", "gemm_op": "block-fp8", "precision": "model"}
    fp8onnx.quantize(path, tmp_path / "q.onnx", path.with_suffix(".npz"), **options)
    ops = [n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node]
    assert ops == ["Cast", BLOCK_FP8_OP, "Cast"], ops
    assert make_session(tmp_path / "q.onnx", "cpu").run(None, {"x": x})[0].dtype == np.float32  # emulated


@pytest.mark.parametrize("a_scale", [None, 0.02])
@pytest.mark.parametrize(("k", "block"), [(96, 32), (96, 40), (64, 64), (48, 128)])
def test_emulation_is_the_numpy_reference(tmp_path, a_scale, k, block):
    """The op's emulation (standard ops) on onnxruntime CPU and onnx.reference against the NumPy reference
    of the schema: equal but for the summation order of the float32 product (then rounded to float16)."""
    rng = np.random.default_rng(k + block)
    n = 24
    b = (rng.standard_normal((n, k)) * 8).astype(E4M3)
    b_scale = rng.uniform(0.01, 0.1, (n, -(-k // block))).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float16)
    a = (rng.standard_normal((2, 5, k)) * 3).astype(np.float16)
    a[0, 0, :4] = [100, -100, 1000, -2000]  # beyond 448 * a_scale: saturated
    inputs = [
        helper.make_tensor_value_info("a", TensorProto.FLOAT16, [2, 5, k]),
    ]
    inits = [
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(b_scale, "b_scale"),
        numpy_helper.from_array(bias, "bias"),
    ]
    names = ["a", "b", "b_scale", "", "bias"]
    if a_scale is not None:
        inits.append(numpy_helper.from_array(np.array(a_scale, np.float32), "a_scale"))
        names[3] = "a_scale"
    node = helper.make_node(BLOCK_FP8_OP, names, ["y"], domain="com.microsoft", block_size=block, name="op")
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 5, n])], inits
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    onnx.save(model, tmp_path / "op.onnx")
    emulated = _emulated(tmp_path / "op.onnx", tmp_path / "emulated.onnx")
    assert BLOCK_FP8_OP not in [n.op_type for n in onnx.load(emulated).graph.node]
    want = reference(a, b, b_scale, a_scale, bias, block_size=block).astype(np.float64)
    # |a| |w| bounds the float32 sums; the float16 roundings after them may then differ by one step
    w = np.abs(b.astype(np.float32) * np.repeat(b_scale, block, axis=1)[:, :k]).astype(np.float64)
    magnitude = np.abs(a.astype(np.float64)) @ w.T
    step = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    for run in (run_ort, run_reference):
        got = run(emulated, {"a": a})[0]
        assert got.dtype == np.float16
        excess = np.abs(got.astype(np.float64) - want) - summation_tolerance(k, magnitude) - 2 * step
        assert (excess <= 0).all(), np.abs(got.astype(np.float64) - want).max()
    # the CPU EP has no kernel for it: fp8onnx's sessions emulate it on their own
    with pytest.raises(Exception, match="Could not find an implementation for MatMulBlockQuantizedFp8Weight"):
        run_ort(tmp_path / "op.onnx", {"a": a})
    mine = make_session(tmp_path / "op.onnx", "cpu").run(None, {"a": a})[0].astype(np.float64)
    np.testing.assert_allclose(mine, run_ort(emulated, {"a": a})[0].astype(np.float64), rtol=2e-3, atol=1e-2)


def test_the_reference_follows_the_schema_text():
    """One hand-checked case: block scales, a saturated activation, the float16 roundings."""
    b = np.array([[1.0, 2.0, -4.0, 0.5]], E4M3)  # N=1, K=4, block 2: scales 0.5 and 2
    b_scale = np.array([[0.5, 2.0]], np.float32)
    a = np.array([[1.0, 1.0, 1.0, 1000.0]], np.float16)
    # W8A16: 1*0.5 + 1*1 - 4*2*1 + 0.5*2*1000 = 993.5 -> float16 993.5
    assert reference(a, b, b_scale, block_size=2).item() == 993.5
    # W8A8 with a_scale 1: 1000 saturates to 448: 1.5 - 8 + 448 = 441.5
    assert reference(a, b, b_scale, np.float32(1.0), block_size=2).item() == 441.5
    with pytest.raises(ValueError, match=r"b_scale must be \[N, ceil\(K / block_size\)\] = \[1, 1\]"):
        reference(a, b, b_scale, block_size=4)


def test_the_sample_decoder_in_the_fast_form(tmp_path):
    """A real TorchScript export (29 MatMuls): every weight MatMul in the fast form, compare says it
    emulates, and the accuracy stays at the Q/DQ form's."""
    out = tmp_path / "cuda.onnx"
    calib = SAMPLE / "calib.npz"
    report = fp8onnx.quantize(SAMPLE / "decoder.onnx", out, calib, target="onnxruntime-cuda", provider="cpu")
    written = report.fast_form["w8a8"] + report.fast_form["w8a16"]
    assert len(written) == len(report.quantized) and not report.fast_form["kept_qdq"]
    model = onnx.load(out)
    assert len(_fast_nodes(model)) == len(written)
    float_weights = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in _inits(model)]
    # only the default's kept channels (--keep-channels 4) stay float: a product of 4 rows beside each fast node
    assert {n.name.endswith("/kept_matmul") for n in float_weights} == {True} and len(float_weights) == len(written)
    result = fp8onnx.compare(SAMPLE / "decoder.onnx", [out], SAMPLE / "eval.npz", provider="cpu", generate=0)
    assert any("MatMulBlockQuantizedFp8Weight emulated on the CPU EP" in note for note in result.notes)
    (fast,) = (r for r in result.rows if r.name == "cuda.onnx")
    assert fast.ratio_to_fp16 > 0.995, fast.ratio_to_fp16


def test_options_that_do_not_fit_the_fast_form_are_one_sentence():
    with pytest.raises(fp8onnx.Fp8OnnxError, match=r"block-fp8 stores float8e4m3fn weights; .* is e5m2"):
        fp8onnx.QuantizeConfig(format="e5m2", gemm_op="block-fp8")
    with pytest.raises(fp8onnx.Fp8OnnxError, match="--native-gemm is --gemm-op gemm-float8"):
        fp8onnx.QuantizeConfig(native_gemm=True, gemm_op="block-fp8")
    cuda = fp8onnx.QuantizeConfig(target="onnxruntime-cuda")
    assert (cuda.gemm_op, cuda.precision, cuda.weight_block_size) == ("block-fp8", "fp16", 128)
    assert fp8onnx.QuantizeConfig(target="onnxruntime-cuda", format="e5m2").gemm_op == "qdq"
    assert fp8onnx.QuantizeConfig(target="onnxruntime-cuda", op_types=("Conv",)).gemm_op == "qdq"
    plain = fp8onnx.QuantizeConfig()
    assert (plain.gemm_op, plain.precision, plain.weight_block_size) == ("qdq", "model", 0)
    assert "gemm_op" not in plain.to_json()  # outputs of the other forms stay as they were


def test_float_activations_make_chosen_nodes_w8a16_in_one_model(tmp_path):
    """--float-activations: the matched nodes keep float activations and FP8 weights (the fast form without
    a_scale), the others take static E4M3 activations (a_scale): one model mixes the two."""
    from helpers import mlp_data, mlp_model

    path, data = mlp_model(tmp_path / "m.onnx", opset=21), mlp_data(tmp_path / "d.npz")
    out = tmp_path / "mixed.onnx"
    report = fp8onnx.quantize(
        path, out, data, target="onnxruntime-cuda", preset="none", float_activations=("fc2",), provider="cpu"
    )
    assert report.fast_form["w8a8"] == ["fc1"] and report.fast_form["w8a16"] == ["fc2"]
    assert report.config["float_activations"] == ["fc2"]
    nodes = {n.name: n for n in _fast_nodes(onnx.load(out))}
    assert len(nodes["fc1"].input) >= 4 and nodes["fc1"].input[3]  # a_scale
    assert len(nodes["fc2"].input) < 4 or not nodes["fc2"].input[3]
    plain = tmp_path / "plain.onnx"
    fp8onnx.quantize(path, plain, data, target="onnxruntime-cuda", preset="none", provider="cpu")
    x = np.load(data)["x"][:16]
    ref = run_ort(path, {"x": x})[0]
    mixed, w8a8 = (make_session(str(p), "cpu").run(None, {"x": x})[0] for p in (out, plain))
    assert sqnr_db(ref, mixed) > sqnr_db(ref, w8a8)  # fc2's activation error is gone


def test_the_w8a8_preset_on_a_llama_export(tmp_path):
    """--preset llm-w8a8 on fp8onnx's sample Llama: every weight MatMul in the fast form; the nodes the loss
    measurement chose W8A16 without a_scale, the rest W8A8 (static E4M3 a_scale), at least 67% of the MACs."""
    from fp8onnx.models.build_llama import build

    path = build(tmp_path / "tiny", layers=2, dim=64, heads=4, ffn=160, vocab=300)
    ids = np.random.default_rng(0).integers(0, 300, (8, 16)).astype(np.int64)
    np.savez(tmp_path / "c.npz", input_ids=ids)
    out = tmp_path / "w8a8.onnx"
    report = fp8onnx.quantize(path, out, tmp_path / "c.npz", preset="llm-w8a8", target="onnxruntime-cuda")
    form, chosen = report.fast_form, report.w8a16
    assert chosen["how"].startswith("by measured loss") and chosen["w8a8_share"] >= 0.67
    assert sorted(form["w8a16"]) == sorted(chosen["nodes"]) and not form["kept_qdq"], form
    layers = [f"/layers.{k}/{p}" for k in (0, 1) for p in ("q", "k", "v", "o", "gate", "up", "down")]
    assert sorted(n for n in form["w8a8"] + form["w8a16"] if n.startswith("/layers.")) == sorted(layers)
    assert set(layers) <= set(chosen["losses"])  # every activation measured (the tiny head's too: 300 outputs)


def test_float_last_layers_keeps_the_last_layers_activations_in_float(tmp_path, caplog):
    """requires: Llama names (layers.K); ensures: --float-last-layers 1 makes every MatMul of the last layer
    W8A16 and leaves the others W8A8; on a graph without such names, none is kept, with a warning."""
    from fp8onnx.models.build_llama import build

    path = build(tmp_path / "tiny", layers=3, dim=64, heads=4, ffn=160, vocab=300)
    ids = np.random.default_rng(0).integers(0, 300, (8, 16)).astype(np.int64)
    np.savez(tmp_path / "c.npz", input_ids=ids)
    common = dict(preset="none", target="onnxruntime-cuda", provider="cpu")
    report = fp8onnx.quantize(path, tmp_path / "w.onnx", tmp_path / "c.npz", float_last_layers=1, **common)
    last = sorted(f"/layers.2/{p}" for p in ("q", "k", "v", "o", "gate", "up", "down"))
    assert sorted(report.fast_form["w8a16"]) == last, report.fast_form
    layer = {name: name.split("/")[1] for name in report.fast_form["w8a8"]}  # lm_head too (preset none)
    assert sorted(layer.values()).count("layers.0") == 7 and "layers.2" not in layer.values()
    assert report.config["float_last_layers"] == 1
    two = fp8onnx.quantize(path, tmp_path / "w2.onnx", tmp_path / "c.npz", float_last_layers=2, **common)
    assert len(two.fast_form["w8a16"]) == 14 and len(two.fast_form["w8a8"]) == 8  # layers.0 and lm_head
    from helpers import mlp_data, mlp_model

    plain, data = mlp_model(tmp_path / "m.onnx", opset=21), mlp_data(tmp_path / "d.npz")  # fc1, fc2: no index
    caplog.set_level("WARNING", logger="fp8onnx")
    fp8onnx.quantize(plain, tmp_path / "m8.onnx", data, float_last_layers=1, **common)
    assert "no MatMul/Gemm is named like 'layers.N/'" in caplog.text
