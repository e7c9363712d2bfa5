import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.passes import AMAX_SUFFIX, AddAmaxOutputsPass

from helpers import mlp_model, run_ort, run_reference


def test_adds_scalar_amax_outputs_that_match_numpy(tmp_path):
    model = ir.load(mlp_model(tmp_path / "m.onnx", opset=21))
    result = AddAmaxOutputsPass(["x", "h", "r"])(model)
    assert result.modified
    names = [o.name for o in model.graph.outputs]
    assert names[-3:] == ["x" + AMAX_SUFFIX, "h" + AMAX_SUFFIX, "r" + AMAX_SUFFIX]
    proto = ir.to_proto(model)
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    w1 = model.graph.initializers["w1"].const_value.numpy()
    h = x @ w1
    for outs in (run_ort(proto, {"x": x}), run_reference(proto, {"x": x})):
        amax = dict(zip(names, outs))
        assert amax["x" + AMAX_SUFFIX].shape == ()
        np.testing.assert_allclose(amax["x" + AMAX_SUFFIX], np.abs(x).max())
        np.testing.assert_allclose(amax["h" + AMAX_SUFFIX], np.abs(h).max(), rtol=1e-5)
        np.testing.assert_allclose(amax["r" + AMAX_SUFFIX], np.maximum(h, 0).max(), rtol=1e-5)


def test_idempotent(tmp_path):
    model = ir.load(mlp_model(tmp_path / "m.onnx", opset=21))
    AddAmaxOutputsPass(["h"])(model)
    count = len(model.graph)
    assert not AddAmaxOutputsPass(["h"])(model).modified
    assert len(model.graph) == count


def test_unknown_tensor_is_named(tmp_path):
    model = ir.load(mlp_model(tmp_path / "m.onnx", opset=21))
    with pytest.raises(ir.passes.PreconditionError, match="'nope' is not produced in the main graph"):
        AddAmaxOutputsPass(["nope"])(model)


def test_keep_only_outputs_drops_what_no_kept_output_needs():
    from fp8onnx.passes.common import keep_only_outputs

    w1 = np.eye(4, dtype=np.float32) * 2
    w2 = np.ones((4, 1000), np.float32)  # the "logits" projection nobody fetches during calibration
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("MatMul", ["h", "w2"], ["logits"], name="head"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 1000])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    AddAmaxOutputsPass(["h"])(model)
    keep_only_outputs(model, ["h" + AMAX_SUFFIX])
    assert [v.name for v in model.graph.outputs] == ["h" + AMAX_SUFFIX]
    assert "head" not in {n.name for n in model.graph}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    (amax,) = run_ort(ir.to_proto(model), {"x": x})
    assert amax == 14.0
