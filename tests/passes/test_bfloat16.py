"""--precision bf16: the unquantized graph in bfloat16 for the CUDA fast form (structure: weights rounded
from float32, inputs/outputs kept, float32 exactly where the CUDA EP has no bfloat16 kernel), and its
CPU emulation (float32 arithmetic, each result rounded to bfloat16) against NumPy and onnx.reference;
SQNR in dB against the float32 graph."""

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.graph.cpu_ep import BFLOAT16_COMPUTE, cuda_only_ops, emulated
from fp8onnx.graph.placement import no_cuda_kernel_in, placement_summary, predict_placement
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.graph.runtime import make_session
from fp8onnx.passes import ConvertFloat16Pass, EmulateBfloat16Pass

from helpers import SAMPLE, mlp_model, run_reference, sqnr_db

BF16 = ml_dtypes.bfloat16


def _run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    """On the CPU EP, bfloat16 emulated (fp8onnx's sessions do it for models with the fast-form op)."""
    with emulated(model.SerializeToString(), None, "", "The model") as lowered:
        return make_session(lowered, "cpu").run(None, feed)


def test_weights_are_rounded_from_float32_and_the_interface_is_kept(tmp_path):
    path = mlp_model(tmp_path / "m.onnx", opset=21)
    source = onnx.load(path)
    result = ConvertFloat16Pass(ir.DataType.BFLOAT16)(ir.load(path))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto)
    assert [v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)] == [
        v.type.tensor_type.elem_type for v in (*source.graph.input, *source.graph.output)
    ]
    originals = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    for t in proto.graph.initializer:
        assert t.data_type == TensorProto.BFLOAT16, t.name
        expected = originals[t.name].astype(BF16)  # once, from float32: not through float16
        assert np.array_equal(numpy_helper.to_array(t).view(np.uint16), expected.view(np.uint16)), t.name
    text = str(proto)
    assert "FLOAT16" not in text.replace("BFLOAT16", "")
    assert cuda_only_ops(proto.SerializeToString()) == []  # not marked as converted for the CUDA EP
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    (ref,), (out,) = _run(source, {"x": x})[:1], _run(proto, {"x": x})[:1]
    assert out.dtype == np.float32
    assert 35 < sqnr_db(ref, out) < 60  # bfloat16's 8 bits: far from float32's, near bfloat16's own error


def _elementwise(tmp_path):
    """x -> Cast(bf16) -> Mul(w) -> Add(b) -> Tanh -> Reshape -> Cast(float): every step elementwise."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 6)).astype(np.float32).astype(BF16)
    b = rng.standard_normal((6,)).astype(np.float32).astype(BF16)
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("Mul", ["xb", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Tanh", ["a"], ["t"]),
        helper.make_node("Reshape", ["t", "shape"], ["r"]),
        helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(np.array([24], np.int64), "shape"),
    ]
    graph = helper.make_graph(
        nodes,
        "bf16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [24])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, tmp_path / "bf16.onnx")
    return model, w, b


def test_the_emulation_rounds_each_result_to_bfloat16(tmp_path):
    """On the CPU EP (which has no bfloat16 Mul, Add or Tanh) the emulated graph computes what the CUDA
    EP's bfloat16 kernels do: float32 arithmetic, each result stored as bfloat16."""
    model, w, b = _elementwise(tmp_path)
    x = np.random.default_rng(4).standard_normal((4, 6)).astype(np.float32)

    def r(v):
        return np.asarray(v, np.float32).astype(BF16).astype(np.float32)

    expected = r(np.tanh(r(r(r(x) * w.astype(np.float32)) + b.astype(np.float32)))).reshape(24)
    (out,) = _run(model, {"x": x})
    # tanh is the one op whose float32 result may differ in the last bit between libraries; rounded to
    # bfloat16 it moves by at most one bfloat16 step, at a rounding tie
    step = np.abs(expected) * 2.0**-7
    assert np.all(np.abs(out - expected) <= step), np.max(np.abs(out - expected) / step)
    # onnx.reference computes bfloat16 ops in ml_dtypes: the same numerics
    (ref,) = run_reference(model, {"x": x})
    assert np.all(np.abs(out - ref) <= step)
    emulated = ir.from_proto(model)
    EmulateBfloat16Pass()(emulated)
    proto = ir.to_proto(emulated)
    onnx.checker.check_model(proto)
    casts = [n for n in proto.graph.node if n.op_type == "Cast"]
    # Mul, Add, Tanh rounded (a Cast pair each); Reshape moves values (no rounding); the two Casts stay
    assert len(casts) == 2 + 1 + 3 * 2
    assert not EmulateBfloat16Pass()(emulated).modified


def test_main_graph_bfloat16_inputs_and_outputs_are_kept(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "io", [x], [y])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    EmulateBfloat16Pass()(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    assert [v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)] == [
        TensorProto.BFLOAT16
    ] * 2
    assert [n.op_type for n in proto.graph.node] == ["Cast", "Mul", "Cast"]


def test_nodes_without_a_bfloat16_cuda_kernel_stay_float32():
    """What stays float32 is exactly what the CUDA kernel table lacks; the rest is bfloat16 and the whole
    converted graph is predicted on CUDA."""
    plain, _, _ = prepare_model(SAMPLE / "decoder.onnx", "model")
    ir.passes.common.NameFixPass()(plain)
    lacking = set(no_cuda_kernel_in(plain, ir.DataType.BFLOAT16))
    assert lacking  # opset 21: ReduceMean and Reciprocal have no bfloat16 CUDA kernel in the table
    model, _, done = prepare_model(SAMPLE / "decoder.onnx", "bf16")
    assert "converted the unquantized graph to bfloat16 (inputs and outputs kept)" in done
    wide = {n.name for n in model.graph if n.op_type != "Cast" and any(o.dtype == ir.DataType.FLOAT for o in n.outputs)}
    assert wide == lacking
    assert not any(v.dtype == ir.DataType.FLOAT16 for n in model.graph for v in n.outputs)
    assert placement_summary(predict_placement(model, "cuda"))["not_on_the_provider"] == {}


def test_the_sample_decoder_in_bf16_fast_form(tmp_path):
    """A real TorchScript export, quantized for the CUDA EP in bfloat16: every weight MatMul in the fast
    form with bfloat16 A, every node predicted on CUDA, and compare (emulated, and saying so) keeps
    >= 99.5% of FP16's next-token accuracy."""
    out = tmp_path / "bf16.onnx"
    report = fp8onnx.quantize(
        SAMPLE / "decoder.onnx", out, SAMPLE / "calib.npz", target="onnxruntime-cuda", precision="bf16", provider="cpu"
    )
    assert len(report.fast_form["w8a16"]) == len(report.quantized) and not report.fast_form["kept_qdq"]
    assert "BF16 graph" in report.summary() and "the op and bfloat16 (float32 arithmetic" in report.summary()
    model = ir.load(out)
    fast = [n for n in model.graph if n.op_type == "MatMulBlockQuantizedFp8Weight"]
    assert fast and all(n.inputs[0].dtype == ir.DataType.BFLOAT16 for n in fast)
    assert cuda_only_ops(out) == ["MatMulBlockQuantizedFp8Weight", BFLOAT16_COMPUTE]
    assert placement_summary(predict_placement(model, "cuda"))["not_on_the_provider"] == {}
    result = fp8onnx.compare(SAMPLE / "decoder.onnx", [out], SAMPLE / "eval.npz", provider="cpu", generate=0)
    assert any("bfloat16 compute emulated on the CPU EP" in note for note in result.notes), result.notes
    (row,) = (r for r in result.rows if r.name == "bf16.onnx")
    assert row.ratio_to_fp16 > 0.995, row.ratio_to_fp16


def test_bf16_is_for_the_fast_form_only():
    with pytest.raises(fp8onnx.Fp8OnnxError, match="--precision bf16 is for the CUDA fast form"):
        fp8onnx.QuantizeConfig(precision="bf16")
    assert fp8onnx.QuantizeConfig(target="onnxruntime-cuda", precision="bf16").precision == "bf16"


def test_types_unknown_to_the_exporter_are_inferred_before_choosing(tmp_path):
    """An export without value_info (SmolLM2's rotary Cos/Sin, opset 21: no bfloat16 Cos before opset 22,
    in ONNX or in the CUDA table): the node stays float32, so the graph is valid and all on CUDA."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["m"], name="square"),  # Cos reads a value of no stated type
        helper.make_node("Cos", ["m"], ["c"], name="cos"),
        helper.make_node("MatMul", ["c", "w"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "cos.onnx")
    model, _, _ = prepare_model(tmp_path / "cos.onnx", "bf16")
    types = {n.name: n.outputs[0].dtype for n in model.graph}
    assert types["cos"] == ir.DataType.FLOAT and types["mm"] == ir.DataType.BFLOAT16
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    assert placement_summary(predict_placement(model, "cuda"))["not_on_the_provider"] == {}
