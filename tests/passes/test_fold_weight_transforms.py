import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.passes import FoldWeightTransformsPass

from helpers import assert_same_sums, op_types, run_ort, sum_magnitude


def model(path, also_read_elsewhere=False):
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float16)
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
        helper.make_node("Cast", ["wt"], ["wc"], name="c", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "wc"], ["y"], name="mm"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])]
    if also_read_elsewhere:
        nodes.append(helper.make_node("Identity", ["w"], ["w_out"], name="keep"))
        outputs.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT16, [8, 16]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        outputs,
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_folds_chains_into_one_initializer(tmp_path):
    path = model(tmp_path / "m.onnx")
    m = ir.load(path)
    assert FoldWeightTransformsPass()(m).modified
    proto = ir.to_proto(m)
    onnx.checker.check_model(proto, full_check=True)
    assert op_types(proto) == ["MatMul"]
    assert [(i.name, i.data_type, list(i.dims)) for i in proto.graph.initializer] == [
        ("wc", TensorProto.FLOAT, [16, 8])
    ]
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    # the folded weight is the chain's values; the MatMul may take another kernel (a constant B is
    # prepacked, a computed one is not): equal up to the summation order (SPEC §11)
    folded, chain = run_ort(proto, {"x": x})[0], run_ort(onnx.load(path), {"x": x})[0]
    assert_same_sums(folded, chain, *sum_magnitude(proto, {"x": x}))
    assert not FoldWeightTransformsPass()(m).modified


def test_other_readers_keep_the_original(tmp_path):
    m = ir.load(model(tmp_path / "m.onnx", also_read_elsewhere=True))
    FoldWeightTransformsPass()(m)
    proto = ir.to_proto(m)
    assert sorted(i.name for i in proto.graph.initializer) == ["w", "wc"]
    assert op_types(proto) == ["MatMul", "Identity"]
