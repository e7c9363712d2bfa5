"""Every pass states its contract (onnx_ir's requires/ensures): the docstring says what it needs and
what it promises, and where the promise can be checked cheaply the pass checks it after each run.
Here: each check catches the condition it names."""

import inspect

import numpy as np
import onnx_ir as ir
import pytest
from test_fold_weight_transforms import model as transposed_weight_model

import fp8onnx.passes as passes
from fp8onnx.passes import FoldWeightTransformsPass, LowerGemmFloat8Pass, QuantizeEmbeddingsPass
from fp8onnx.passes.common import check_initializers


def _pass_classes():
    return [
        obj
        for _, module in inspect.getmembers(passes, inspect.ismodule)
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, ir.passes.PassBase) and obj.__module__.startswith("fp8onnx.passes")
    ]


def test_every_pass_states_requires_and_ensures():
    classes = set(_pass_classes())
    assert len(classes) >= 9  # every pass module of passes/
    for cls in classes:
        doc = cls.__doc__ or ""
        assert "requires:" in doc and "ensures:" in doc, f"{cls.__name__} states no contract"


def test_fold_ensures_no_transform_is_left_on_a_weight(tmp_path):
    model = ir.load(transposed_weight_model(tmp_path / "m.onnx"))
    with pytest.raises(ir.passes.PostconditionError, match="Transpose 't' on a weight is still there"):
        FoldWeightTransformsPass().ensures(model)
    result = FoldWeightTransformsPass()(model)  # runs requires, call, ensures
    assert result.modified and [n.op_type for n in result.model.graph] == ["MatMul"]


def test_opset_preconditions(tmp_path):
    model = ir.load(transposed_weight_model(tmp_path / "m.onnx"))
    model.opset_imports[""] = 11
    with pytest.raises(ir.passes.PreconditionError, match="opset >= 19"):
        LowerGemmFloat8Pass()(model)
    with pytest.raises(ir.passes.PreconditionError, match="opset >= 13"):
        QuantizeEmbeddingsPass()(model)


def test_a_node_reading_a_lost_initializer_is_caught(tmp_path):
    model = ir.load(transposed_weight_model(tmp_path / "m.onnx"))
    check_initializers(model)
    model.graph.initializers.pop("w")  # the Transpose still reads it
    with pytest.raises(ir.passes.PostconditionError, match="reads 'w', no longer an initializer"):
        check_initializers(model)
    assert np.asarray(model.graph.node(0).inputs[0].const_value.numpy()).shape == (8, 16)
