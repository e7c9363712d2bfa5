import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.passes import ShieldBiasPass

from helpers import op_types, run_ort


def gemm_model(path, beta=1.0):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm", transB=1, beta=beta)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])],
        [
            numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([-0.13, 0.5, 2.0], np.float32), "c"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_row_bias_keeps_numbers(tmp_path):
    path = gemm_model(tmp_path / "m.onnx", beta=0.5)
    model = ir.load(path)
    assert ShieldBiasPass(["gemm"])(model).modified
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert op_types(proto) == ["Gemm"]
    assert [(i.name, list(i.dims)) for i in proto.graph.initializer if "c" in i.name] == [("c/row", [1, 3])]
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(run_ort(proto, {"x": x})[0], run_ort(onnx.load(path), {"x": x})[0], rtol=1e-6)
    assert not ShieldBiasPass(["gemm"])(model).modified  # idempotent: the bias is 2-D now


def test_tiny_scales_keep_the_bias_at_ort_default_level(tmp_path):
    # Activations of 1e-4 with weights of 1e-4: ORT's BiasQuantization would store c as int32 with
    # scale ~1e-13 and clip -0.13 to about -3e-4. fp8onnx gives such a bias a [1, N] shape.
    path = gemm_model(tmp_path / "m.onnx")
    proto = onnx.load(path)
    proto.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(numpy_helper.to_array(proto.graph.initializer[0]) * 1e-4, "w")
    )
    onnx.save(proto, path)
    x = np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32) * 1e-4
    np.savez(tmp_path / "d.npz", x=x)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert any("reshaped 1 biases to [1, N]" in step for step in report.prepared)
    ref = run_ort(onnx.load(path), {"x": x})[0]
    np.testing.assert_allclose(run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})[0], ref, atol=1e-6)


def test_ordinary_scales_keep_the_gemm_whole(tmp_path):
    path = gemm_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert not any("reshaped" in step for step in report.prepared)
    assert [list(i.dims) for i in onnx.load(tmp_path / "q.onnx").graph.initializer if i.name == "c"] == [[3]]


def test_matmul_add_that_ort_fuses_keeps_its_bias(tmp_path):
    # Found by the property tests: ORT fuses MatMul + Add into a Gemm, then clips the bias.
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Add", ["m", "c"], ["y"], name="add"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])],
        [
            numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32) * 1e-4, "w"),
            numpy_helper.from_array(np.array([-0.13, 0.5, 2.0], np.float32), "c"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    x = rng.standard_normal((64, 4)).astype(np.float32) * 1e-4
    np.savez(tmp_path / "d.npz", x=x)
    report = fp8onnx.quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert any("reshaped 1 biases" in step for step in report.prepared)
    ref = run_ort(onnx.load(tmp_path / "m.onnx"), {"x": x})[0]
    np.testing.assert_allclose(run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})[0], ref, atol=1e-6)
