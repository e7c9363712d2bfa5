"""--debug shows the error behind fp8onnx's sentence (raised ``from`` it), which stays one line without it;
the package tells type checkers it is typed (py.typed)."""

import importlib.resources

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.cli import main


def test_debug_shows_the_cause_and_the_plain_run_one_sentence(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    plain = CliRunner().invoke(main, ["inspect", str(bad)])
    assert plain.exit_code == 2 and "Traceback" not in plain.output
    assert plain.output.strip().splitlines()[-1].startswith("fp8onnx: error: Model file")
    debug = CliRunner().invoke(main, ["--debug", "inspect", str(bad)])
    assert debug.exit_code == 2
    assert "DecodeError" in debug.output and "The above exception was the direct cause" in debug.output
    assert debug.output.strip().splitlines()[-1] == plain.output.strip().splitlines()[-1]


def test_debug_shows_onnxruntimes_own_error(tmp_path):
    """A model onnxruntime refuses (an op it has no kernel for): --debug shows onnxruntime's exception."""
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
    nodes.append(helper.make_node("Foo", ["h"], ["y"], domain="com.example", name="foo"))
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], [weight])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    model = tmp_path / "foo.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets), model)
    args = ["quantize", str(model), "-o", str(tmp_path / "q.onnx"), "--activations", "none"]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 2 and "Traceback" not in plain.output and "does not load in onnxruntime" in plain.output
    debug = CliRunner().invoke(main, ["--debug", *args])
    assert debug.exit_code == 2 and "onnxruntime_pybind11_state.Fail" in debug.output
    assert not (tmp_path / "q.onnx").exists()


def test_the_package_is_marked_typed():
    assert (importlib.resources.files("fp8onnx") / "py.typed").is_file()
