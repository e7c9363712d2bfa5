import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.passes import SplitGemmBiasPass

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


def test_split_keeps_numbers_and_output_name(tmp_path):
    path = gemm_model(tmp_path / "m.onnx", beta=0.5)
    model = ir.load(path)
    assert SplitGemmBiasPass(["gemm"])(model).modified
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert op_types(proto) == ["Gemm", "Add"] and len(proto.graph.node[0].input) == 2
    assert proto.graph.output[0].name == "y"
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(run_ort(proto, {"x": x})[0], run_ort(onnx.load(path), {"x": x})[0], rtol=1e-6)
    assert not SplitGemmBiasPass(["gemm"])(model).modified  # idempotent: no bias left


def test_tiny_scales_keep_the_bias_at_ort_default_level(tmp_path):
    # Activations of 1e-4 with weights of 1e-4: ORT's BiasQuantization would store c as int32 with
    # scale ~1e-13 and clip -0.13 to about -3e-4. fp8onnx moves the bias out of such a Gemm.
    path = gemm_model(tmp_path / "m.onnx")
    proto = onnx.load(path)
    proto.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(numpy_helper.to_array(proto.graph.initializer[0]) * 1e-4, "w")
    )
    onnx.save(proto, path)
    x = np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32) * 1e-4
    np.savez(tmp_path / "d.npz", x=x)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert any("moved the bias of 1 Gemm" in step for step in report.prepared)
    ref = run_ort(onnx.load(path), {"x": x})[0]
    np.testing.assert_allclose(run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})[0], ref, atol=1e-6)


def test_ordinary_scales_keep_the_gemm_whole(tmp_path):
    path = gemm_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert not any("moved the bias" in step for step in report.prepared)
    assert "Add" not in op_types(onnx.load(tmp_path / "q.onnx"))
