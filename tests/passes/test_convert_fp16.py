import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.external_data

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


def test_weights_in_external_data_are_converted_lazily_and_identically(tmp_path):
    """A model whose weights stay in their side file converts to exactly what the in-memory one does."""
    from fp8onnx.models.build_llama import build
    from fp8onnx.runtime import session_for_model

    path = build(tmp_path / "tiny", layers=1, dim=64, heads=4, ffn=160, vocab=300)
    lazy = ConvertFloat16Pass()(ir.load(path)).model
    loaded = ir.load(path)
    ir.external_data.load_to_model(loaded)
    eager = ConvertFloat16Pass()(loaded).model
    assert any(isinstance(v.const_value, ir.LazyTensor) for v in lazy.graph.initializers.values())
    for name, value in eager.graph.initializers.items():
        other = lazy.graph.initializers[name]
        assert other.dtype == value.dtype, name
        assert np.array_equal(other.const_value.numpy(), value.const_value.numpy()), name
    feed = {"input_ids": np.arange(32, dtype=np.int64).reshape(2, 16)}
    (a,), (b,) = (session_for_model(m, "cpu").run(None, feed) for m in (lazy, eager))
    assert np.array_equal(a, b)
