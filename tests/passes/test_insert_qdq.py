import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import pytest

from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.numerics.scaling import amax_to_scale
from fp8onnx.passes import InsertQDQPass, TensorQuant, UpgradeOpsetPass

from helpers import mlp_model, op_types, run_ort, run_reference, sqnr_db, sqnr_floor_db


def _setup(tmp_path, fmt, **kw):
    path = mlp_model(tmp_path / "m.onnx", **kw)
    model = ir.load(path)
    UpgradeOpsetPass()(model)
    ir.passes.common.ShapeInferencePass()(model)
    x = np.random.default_rng(3).standard_normal((32, 16)).astype(kw.get("dtype", np.float32))
    ref = run_ort(onnx.load(path), {"x": x})
    w1, w2 = (model.graph.initializers[n].const_value.numpy() for n in ("w1", "w2"))
    h = x @ w1
    amax = {"x": np.abs(x).max(), "w1": np.abs(w1).max(), "w2": np.abs(w2).max(), "r": np.maximum(h, 0).max()}
    amax = {k: float(v) for k, v in amax.items()}
    quant = {k: TensorQuant(fmt, amax_to_scale(float(v), fmt)) for k, v in amax.items()}
    node_inputs = [("fc1", 0), ("fc1", 1), ("fc2", 0), ("fc2", 1)]
    return path, model, x, ref, quant, node_inputs


DEPLOYABLE = [f for f in Fp8Format if f.deployable and not f.integer]  # int8: tests/test_int8.py


@pytest.mark.parametrize("fmt", DEPLOYABLE, ids=lambda f: f.value)
def test_structure_and_numbers(tmp_path, fmt):
    _path, model, x, ref, quant, node_inputs = _setup(tmp_path, fmt)
    assert InsertQDQPass(node_inputs, quant)(model).modified
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    ops = op_types(proto)
    # weights: float8 initializer + DQ only; activations x and r: one Q and one DQ each
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 4
    inits = {i.name: i for i in proto.graph.initializer}
    assert "w1" not in inits and "w2" not in inits  # float weights are gone
    assert inits["fp8onnx/w1/fp8"].data_type == fmt.onnx_type
    assert inits["fp8onnx/w2/fp8"].data_type == fmt.onnx_type
    for node in proto.graph.node:
        if node.op_type == "QuantizeLinear":
            assert len(node.input) == 2  # no zero point: immune to ORT's ReluQuantRewrite
            assert onnx.helper.get_attribute_value(node.attribute[0]) == fmt.onnx_type
    fc2 = next(n for n in proto.graph.node if n.name == "fc2")
    assert list(fc2.input) == ["fp8onnx/r/dequantized", "fp8onnx/w2/dequantized", "b2"]
    for run in (run_ort, run_reference):
        out = run(proto, {"x": x})
        assert sqnr_db(ref[0], out[0]) > sqnr_floor_db(fmt, quantized_tensors=4)


def test_relu_survives_ort_default_optimisations(tmp_path):
    # With a zero point, ORT's ReluQuantRewrite would delete the Relu and negative values would leak.
    _path, model, x, _ref, quant, node_inputs = _setup(tmp_path, Fp8Format.E4M3FN)
    InsertQDQPass(node_inputs, quant)(model)
    proto = ir.to_proto(model)
    default, basic = run_ort(proto, {"x": x})[0], run_ort(proto, {"x": x}, level="basic")[0]
    # two optimisation levels may run the MatMuls with other kernels (last bits, SPEC §11); a deleted
    # Relu lets negative values through: an error of the outputs' own size
    np.testing.assert_allclose(default, basic, rtol=1e-5, atol=1e-5 * np.abs(basic).max())


def test_idempotent(tmp_path):
    _path, model, _x, _ref, quant, node_inputs = _setup(tmp_path, Fp8Format.E4M3FN)
    InsertQDQPass(node_inputs, quant)(model)
    before = ir.to_proto(model).SerializeToString()
    assert not InsertQDQPass(node_inputs, quant)(model).modified
    assert ir.to_proto(model).SerializeToString() == before


def test_shared_activation_gets_one_pair(tmp_path):
    # gram = y^T y: both inputs derive from y; quantizing 'y' for two consumers yields one Q/DQ pair
    _path, model, x, ref, quant, _ = _setup(tmp_path, Fp8Format.E4M3FN)
    y = np.abs(ref[0]).max()
    quant["y"] = quant["yt"] = TensorQuant(Fp8Format.E4M3FN, amax_to_scale(float(y), Fp8Format.E4M3FN))
    InsertQDQPass([("gram", 0), ("gram", 1), ("yt", 0)], quant)(model)
    proto = ir.to_proto(model)
    qs = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert sorted(n.input[0] for n in qs) == ["y", "yt"]
    out = run_ort(proto, {"x": x})
    assert sqnr_db(ref[1], out[1]) > sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=6)


def test_weight_with_other_readers_is_kept(tmp_path):
    _path, model, x, ref, quant, _node_inputs = _setup(tmp_path, Fp8Format.E4M3FN, gemm=False)
    # w2 is read through a Transpose, which is not a quantization target: only fc1's weight is quantized
    InsertQDQPass([("fc1", 0), ("fc1", 1)], quant)(model)
    proto = ir.to_proto(model)
    names = {i.name for i in proto.graph.initializer}
    assert "w2" in names and "w1" not in names
    assert sqnr_db(ref[0], run_ort(proto, {"x": x})[0]) > sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=2)


def test_float16_model_keeps_float16_scales(tmp_path):
    _path, model, x, ref, quant, node_inputs = _setup(tmp_path, Fp8Format.E4M3FN, dtype=np.float16)
    InsertQDQPass(node_inputs, quant)(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    scales = [i for i in proto.graph.initializer if i.name.endswith("/scale")]
    assert scales and all(s.data_type == onnx.TensorProto.FLOAT16 for s in scales)
    out = run_ort(proto, {"x": x})
    assert out[0].dtype == np.float16
    # float16 arithmetic adds its own rounding on top of the four quantizations
    assert sqnr_db(ref[0], out[0]) > sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=4, slack_db=3)


@pytest.mark.parametrize("fmt", DEPLOYABLE, ids=lambda f: f.value)
def test_dynamic_activation_scales(tmp_path, fmt):
    path, model, x, ref, quant, node_inputs = _setup(tmp_path, fmt)
    for name in ("x", "r"):
        quant[name] = TensorQuant(fmt, None)
    InsertQDQPass(node_inputs, quant)(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    ops = op_types(proto)
    assert ops.count("ReduceMax") == 2 and ops.count("QuantizeLinear") == 2
    q_scales = [n.input[1] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert all(s.endswith("/dynamic/scale") for s in q_scales)  # computed, not an initializer
    for run in (run_ort, run_reference):
        assert sqnr_db(ref[0], run(proto, {"x": x})[0]) > sqnr_floor_db(fmt, quantized_tensors=4)
    # an all-zero batch gives a finite positive scale, so zeros come out (not NaN)
    zeros = run_ort(proto, {"x": np.zeros_like(x)})[0]
    np.testing.assert_allclose(zeros, run_ort(onnx.load(path), {"x": np.zeros_like(x)})[0], atol=1e-6)


def test_per_channel_weights(tmp_path):
    fmt = Fp8Format.E4M3FN
    _path, model, x, _ref, quant, node_inputs = _setup(tmp_path, fmt)
    w1 = model.graph.initializers["w1"].const_value.numpy().copy()
    w2 = model.graph.initializers["w2"].const_value.numpy()
    w1[:, 0] *= 50  # one loud output channel: per-tensor scaling would crush the others
    model.graph.initializers["w1"].const_value = ir.tensor(w1, name="w1")
    quant["w1"] = TensorQuant(fmt, np.abs(w1).max(axis=0) / fmt.fmax, axis=1)  # MatMul [K, N]: axis 1
    quant["w2"] = TensorQuant(fmt, np.abs(w2).max(axis=1) / fmt.fmax, axis=0)  # Gemm transB [N, K]: axis 0
    quant["r"] = TensorQuant(fmt, None)
    InsertQDQPass(node_inputs, quant)(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    dq = {n.input[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    assert onnx.helper.get_attribute_value(dq["fp8onnx/w1/fp8"].attribute[0]) == 1
    scale = next(i for i in proto.graph.initializer if i.name == "fp8onnx/w1/scale")
    assert list(scale.dims) == [32]
    h = x @ w1
    exact = np.maximum(h, 0) @ w2.T + model.graph.initializers["b2"].const_value.numpy()
    for run in (run_ort, run_reference):
        assert sqnr_db(exact, run(proto, {"x": x})[0]) > sqnr_floor_db(fmt, quantized_tensors=4)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")
def test_emulated_e3m4_has_no_qdq_and_matches_numpy(tmp_path):
    from fp8onnx.numerics.formats import dequantize, quantize

    fmt = Fp8Format.E3M4
    _path, model, x, _ref, quant, node_inputs = _setup(tmp_path, fmt)
    w1, w2 = (model.graph.initializers[n].const_value.numpy() for n in ("w1", "w2"))
    b2 = model.graph.initializers["b2"].const_value.numpy()
    InsertQDQPass(node_inputs, quant)(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert "QuantizeLinear" not in op_types(proto) and "DequantizeLinear" not in op_types(proto)
    assert {i.data_type for i in proto.graph.initializer if "emulated" in i.name} == {onnx.TensorProto.FLOAT}

    def qd(a, name):
        s = np.float32(quant[name].scale)
        return dequantize(quantize(a, s, fmt), s)

    expected = np.maximum(qd(x, "x") @ qd(w1, "w1"), 0)
    expected = qd(expected, "r") @ qd(w2, "w2").T + b2
    for run in (run_ort, run_reference):
        np.testing.assert_allclose(run(proto, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)
    assert not InsertQDQPass(node_inputs, quant)(model).modified


def test_requires_opset_21_and_known_targets(tmp_path):
    """At opset 17 the pass used to build a QuantizeLinear with output_dtype (an opset-21 attribute),
    an invalid graph, and still report modified=True; now its precondition refuses."""
    fmt = Fp8Format.E4M3FN
    model = ir.load(mlp_model(tmp_path / "m.onnx", opset=17))
    ir.passes.common.ShapeInferencePass()(model)
    quant = {k: TensorQuant(fmt, 0.01) for k in ("x", "w1")}
    with pytest.raises(ir.passes.PreconditionError, match="opset 17 < 21"):
        InsertQDQPass([("fc1", 0), ("fc1", 1)], quant)(model)
    UpgradeOpsetPass()(model)
    with pytest.raises(ir.passes.PreconditionError, match="node 'nowhere' is not in the model"):
        InsertQDQPass([("nowhere", 0)], quant)(model)
    with pytest.raises(ir.passes.PreconditionError, match="no TensorQuant for tensor 'r'"):
        InsertQDQPass([("fc2", 0)], quant)(model)
    assert InsertQDQPass([("fc1", 0), ("fc1", 1)], quant)(model).modified  # ensures held: both now from DQ
