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
    from fp8onnx.graph.runtime import session_for_model
    from fp8onnx.models.build_llama import build

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
    assert np.array_equal(a, b)  # exact: one graph (its initializers bit-equal, checked above), one feed


def _resized_position_embeddings(path):
    """A ViT-like head: position embeddings resized (bicubic) with scales computed in the graph. The
    outer scales are 11 * (1/11): exactly 1 in float32, 0.9997 once the path runs in float16, which
    onnxruntime's cubic Resize refuses ("outermost 2 scale values being 1")."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Reciprocal", ["eleven"], ["r"]),
        helper.make_node("Mul", ["eleven", "r"], ["one"]),
        helper.make_node("Concat", ["one", "one", "two", "two"], ["scales"], axis=0),
        helper.make_node("Resize", ["pos", "", "scales"], ["big"], mode="cubic"),
        helper.make_node("Add", ["x", "big"], ["h"]),
        helper.make_node("Reshape", ["h", "shape"], ["f"]),
        helper.make_node("MatMul", ["f", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "vit_pos",
        [helper.make_tensor_value_info("x", T.FLOAT, ["b", 2, 8, 8])],
        [helper.make_tensor_value_info("y", T.FLOAT, ["b", 4])],
        [
            numpy_helper.from_array(np.array([11.0], np.float32), "eleven"),
            numpy_helper.from_array(np.array([2.0], np.float32), "two"),
            numpy_helper.from_array(rng.standard_normal((1, 2, 4, 4)).astype(np.float32), "pos"),
            numpy_helper.from_array(np.array([-1, 128], np.int64), "shape"),
            numpy_helper.from_array(rng.standard_normal((128, 4)).astype(np.float32), "w"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_fp16_keeps_resize_scale_paths_in_float32(tmp_path):
    path = _resized_position_embeddings(tmp_path / "m.onnx")
    proto = ir.to_proto(ConvertFloat16Pass()(ir.load(path)).model)
    x = np.random.default_rng(2).standard_normal((4, 2, 8, 8)).astype(np.float32)
    ref, out = run_ort(onnx.load(path), {"x": x}), run_ort(proto, {"x": x})  # ORT's default level folds the path
    assert sqnr_db(ref[0], out[0]) > 40
    types = {v.name: v.type.tensor_type.elem_type for v in proto.graph.value_info}
    resize = next(n for n in proto.graph.node if n.op_type == "Resize")
    scales_producer = next(n for n in proto.graph.node if resize.input[2] in n.output)
    assert scales_producer.op_type == "Concat"  # read directly, not through a float16 round trip
    assert all(types.get(i, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT for i in scales_producer.input)
    assert next(i for i in proto.graph.initializer if i.name == "pos").data_type == onnx.TensorProto.FLOAT16
