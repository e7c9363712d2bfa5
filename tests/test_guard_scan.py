"""The guard's scan for external-data files: the same locations as parsing the model with onnx,
for the main graph and If bodies, without reading the weights; unreadable files yield none."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.graph.guard import external_locations, model_reads
from fp8onnx.passes.common import proto_graphs


def _reference(path) -> list[str]:
    proto = onnx.load(str(path), load_external_data=False)
    found = {}
    for graph in proto_graphs(proto.graph):
        for t in graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                found.setdefault(next(e.value for e in t.external_data if e.key == "location"))
    return list(found)


def _external(tensor: TensorProto, location: str) -> TensorProto:
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _model_with_if(tmp_path, main_location: str | None, body_location: str | None):
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    v = numpy_helper.from_array(np.full((4, 4), 2, np.float32), "v")
    if body_location:
        v = _external(v, body_location)
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "v"], ["t"])], "then", [], [helper.make_tensor_value_info("t", 1, None)], [v]
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, None)]
    )
    if main_location:
        w = _external(w, main_location)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"]),
            helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other),
        ],
        "g",
        [helper.make_tensor_value_info("x", 1, [4, 4])],
        [helper.make_tensor_value_info("out", 1, None)],
        [w, numpy_helper.from_array(np.zeros((), np.float32), "zero")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), path)
    return path


@pytest.mark.parametrize(
    "main, body",
    [(None, None), ("w.bin", None), (None, "v.bin"), ("w.bin", "v.bin"), ("same.bin", "same.bin")],
)
def test_the_scan_finds_what_onnx_finds(tmp_path, main, body):
    path = _model_with_if(tmp_path, main, body)
    assert sorted(external_locations(path)) == sorted(_reference(path))
    assert sorted(str(p) for _, p in model_reads("m", path)[1:]) == sorted(str(tmp_path / x) for x in _reference(path))


def test_external_data_saved_by_onnx_is_found(tmp_path):
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", 1, [1, 64])],
        [helper.make_tensor_value_info("y", 1, [1, 64])],
        [w],
    )
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx", save_as_external_data=True, location="weights.data")
    assert external_locations(tmp_path / "m.onnx") == ["weights.data"]


@pytest.mark.parametrize("content", [b"", b"\xff\xff\xff\xff", b"not a model at all", b"\x3a\xff\x01"])
def test_what_is_not_a_model_has_no_side_files(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    assert model_reads("the input model", path) == [("the input model", path)]
