import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.graph.schemas import unknown_attributes
from fp8onnx.numerics.gemm_float8_ref import run_with_gemm_float8
from fp8onnx.passes import LowerGemmFloat8Pass

from helpers import SAMPLE, op_types, run_ort, sqnr_db


def model_3d(path, gemm_trans_b=1):
    rng = np.random.default_rng(0)
    w_gemm = rng.standard_normal((8, 32) if gemm_trans_b else (32, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm3d"),  # [b, s, 16] @ [16, 32]
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "flat"], ["r2"], name="flatten"),
        helper.make_node("Gemm", ["r2", "w2", "b2"], ["y"], name="gemm", transB=gemm_trans_b, alpha=0.5, beta=2.0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 5, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])],
        [
            numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) * 0.3, "w1"),
            numpy_helper.from_array(np.array([-1, 32], np.int64), "flat"),
            numpy_helper.from_array(w_gemm * 0.3, "w2"),
            numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b2"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


@pytest.mark.parametrize("gemm_trans_b", [0, 1])
def test_lowered_graph_matches_the_qdq_graph(tmp_path, gemm_trans_b, fmt="e4m3fn"):
    path = model_3d(tmp_path / "m.onnx", gemm_trans_b)
    x = np.random.default_rng(1).standard_normal((4, 5, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", format=fmt, provider="cpu")
    model = ir.load(tmp_path / "q.onnx")
    lower = LowerGemmFloat8Pass()
    result = lower(model)
    assert result.modified and result.lowered == ["mm3d", "gemm"] and result.skipped == {}
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    ops = op_types(proto)
    assert ops.count("GemmFloat8") == 2 and "MatMul" not in ops and "Gemm" not in ops
    assert ops.count("DequantizeLinear") == 0  # weights and activations go in as float8
    gf8 = [n for n in proto.graph.node if n.op_type == "GemmFloat8"]
    for n in gf8:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs.keys() == {"transA", "transB", "alpha", "dtype"}  # alpha: the Gemm's own
        assert len(n.input) == 5 and n.input[2] == ""  # no C, no scaleY (an output scale only for float8 output)
        assert (attrs["transA"], attrs["transB"], attrs["dtype"]) == (0, 1, TensorProto.FLOAT16)
    # every attribute is one onnxruntime's own schema of GemmFloat8 has (a rowMajor once made the CUDA EP refuse it)
    assert unknown_attributes(model) == []
    inits = {i.name: i for i in proto.graph.initializer}
    assert inits[gf8[0].input[1]].dims == [32, 16]  # the weight laid out [N, K]
    qdq = run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})[0]
    lowered = run_with_gemm_float8(proto, {"x": x})[0]
    assert lowered.dtype == np.float32 and lowered.shape == qdq.shape
    # same float8 products; the only difference is the float16 output of each GEMM
    assert sqnr_db(qdq, lowered) > 45
    again = lower(model)  # the same instance: idempotent, and it reports this run, not the last one
    assert not again.modified and again.lowered == [] and again.skipped == {}


def test_what_cannot_be_lowered_keeps_qdq_with_a_reason(tmp_path):
    path = model_3d(tmp_path / "m.onnx")
    x = np.random.default_rng(1).standard_normal((4, 5, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", per_channel=True, provider="cpu")
    model = ir.load(tmp_path / "q.onnx")
    result = LowerGemmFloat8Pass()(model)
    assert not result.modified
    assert result.skipped == {
        "mm3d": "per-channel weight scales (GemmFloat8 takes one scale per input)",
        "gemm": "per-channel weight scales (GemmFloat8 takes one scale per input)",
    }
    for fmt, reason in [
        ("e4m3fnuz", "format without a CUDA float8 GEMM (only e4m3fn and e5m2)"),
        ("e5m2", "E5M2 x E5M2 (cuBLASLt's float8 GEMM needs at least one E4M3 input)"),
    ]:
        fp8onnx.quantize(path, tmp_path / "q2.onnx", tmp_path / "d.npz", format=fmt, provider="cpu")
        assert set(LowerGemmFloat8Pass()(ir.load(tmp_path / "q2.onnx")).skipped.values()) == {reason}
    fp8onnx.quantize(
        path, tmp_path / "q3.onnx", tmp_path / "d.npz", weight_format="e4m3fn", activation_format="e5m2", provider="cpu"
    )
    result = LowerGemmFloat8Pass()(ir.load(tmp_path / "q3.onnx"))
    assert set(result.skipped.values()) == {"mixed E4M3/E5M2 inputs (onnxruntime issue 20869)"}


def test_every_matmul_shape_of_the_sample_decoder(tmp_path):
    fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "q.onnx", SAMPLE / "calib.npz", preset="none", provider="cpu")
    model = ir.load(tmp_path / "q.onnx")
    result = LowerGemmFloat8Pass()(model)
    assert len(result.lowered) == 29 and result.skipped == {}
    ids = np.load(SAMPLE / "eval.npz")["input_ids"][:4]
    fp32 = run_ort(onnx.load(SAMPLE / "decoder.onnx"), {"input_ids": ids})[0]
    qdq = run_ort(onnx.load(tmp_path / "q.onnx"), {"input_ids": ids})[0]
    lowered = run_with_gemm_float8(ir.to_proto(model), {"input_ids": ids})[0]
    # Within the FP8 error: float16 GEMM outputs re-quantized downstream cost no more than 1 dB
    # against FP32 than the Q/DQ graph's own error.
    assert sqnr_db(fp32, lowered) > sqnr_db(fp32, qdq) - 1.0
    assert (fp32.argmax(-1) == lowered.argmax(-1)).mean() > (fp32.argmax(-1) == qdq.argmax(-1)).mean() - 0.01


# The decoder's causal mask (-1e9) is -inf in float16: onnx.reference warns while softmax handles it.
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_native_gemm_end_to_end(tmp_path):
    from click.testing import CliRunner

    from fp8onnx.cli import main

    r = CliRunner().invoke(
        main,
        [
            "quantize",
            str(SAMPLE / "decoder.onnx"),
            "--calib",
            str(SAMPLE / "calib.npz"),
            "--precision",
            "fp16",
            "--native-gemm",
            "-o",
            str(tmp_path / "n.onnx"),
            "--provider",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "29 nodes lowered to com.microsoft.GemmFloat8" in r.output
    assert "not loaded in onnxruntime here: GemmFloat8 needs the CUDA EP" in r.output
    proto = onnx.load(tmp_path / "n.onnx")
    assert op_types(proto).count("GemmFloat8") == 29
    assert {o.domain: o.version for o in proto.opset_import}["com.microsoft"] == 1
    ids = np.load(SAMPLE / "eval.npz")["input_ids"][:4]
    fp32 = run_ort(onnx.load(SAMPLE / "decoder.onnx"), {"input_ids": ids})[0]
    out = run_with_gemm_float8(proto, {"input_ids": ids})[0]
    assert out.dtype == np.float32 and (fp32.argmax(-1) == out.argmax(-1)).mean() > 0.9


def test_a_cuda_only_node_with_an_attribute_onnxruntime_does_not_know_is_refused(tmp_path):
    """requires: a GemmFloat8 graph, which loads on the CUDA EP only; ensures: its attributes are checked
    against onnxruntime's own schema, and rowMajor (once fp8onnx's, and why the CUDA EP refused every
    lowered model with "Unrecognized attribute") is one sentence naming the node; quantize runs that
    check before it writes a lowered model it cannot load here."""
    from fp8onnx.base.errors import Fp8OnnxError
    from fp8onnx.graph.schemas import check_attributes

    def model(**attrs):
        a = helper.make_tensor_value_info("a", TensorProto.FLOAT8E4M3FN, [2, 16])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 8])
        w8 = helper.make_tensor("w8", TensorProto.FLOAT8E4M3FN, [8, 16], [1.0] * 128)
        s = numpy_helper.from_array(np.array(1.0, np.float32), "s")
        node = helper.make_node(
            "GemmFloat8", ["a", "w8", "", "s", "s", "s"], ["y"], "gf8", domain="com.microsoft", transB=1, **attrs
        )
        graph = helper.make_graph([node], "g", [a], [y], [w8, s])
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        return ir.from_proto(helper.make_model(graph, opset_imports=opsets))

    named = r"^The model would not load .* node 'gf8' \(com.microsoft.GemmFloat8\) sets rowMajor"
    with pytest.raises(Fp8OnnxError, match=named):
        check_attributes(model(rowMajor=0), "The model")
    check_attributes(model(dtype=TensorProto.FLOAT16), "The model")
    both = unknown_attributes(model(smCount=4, rowMajor=1))
    assert both[0].startswith("node 'gf8' (com.microsoft.GemmFloat8) sets rowMajor, smCount")
