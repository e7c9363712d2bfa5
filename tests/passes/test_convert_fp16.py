import numpy as np
import onnx
import onnx_ir as ir

from fp8onnx.passes import ConvertFloat16Pass

from helpers import mlp_model, run_ort, sqnr_db


def test_fp16_keeps_io_types_and_numbers(tmp_path):
    path = mlp_model(tmp_path / "m.onnx", opset=21)
    result = ConvertFloat16Pass()(ir.load(path))
    assert result.modified
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto)
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert all(i.data_type == onnx.TensorProto.FLOAT16 for i in proto.graph.initializer)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    ref, out = run_ort(onnx.load(path), {"x": x}), run_ort(proto, {"x": x})
    assert out[0].dtype == np.float32
    assert sqnr_db(ref[0], out[0]) > 50


def test_fp16_idempotent(tmp_path):
    model = ConvertFloat16Pass()(ir.load(mlp_model(tmp_path / "m.onnx", opset=21))).model
    assert not ConvertFloat16Pass()(model).modified
