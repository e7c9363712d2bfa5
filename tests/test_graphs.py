"""Real-world graph shapes: each is built here, quantized, checked for structure and for numbers."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format

from helpers import mlp_data, mlp_model, op_types, run_ort, run_reference, sqnr_db, sqnr_floor_db

FLOOR = sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=4)
RNG = np.random.default_rng(0)


def w(*shape, dtype=np.float32):
    return (RNG.standard_normal(shape) * 0.3).astype(dtype)


def save(tmp_path, nodes, inputs, outputs, inits, opset=21, functions=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], functions=list(functions))
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def quantize_and_check(tmp_path, path, feed, *, floor=FLOOR, feeds_layout=False, **options):
    # feed layout (one extra leading axis) where an input is a scalar
    np.savez(tmp_path / "calib.npz", **({k: v[None] for k, v in feed.items()} if feeds_layout else feed))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "calib.npz", provider="cpu", **options)
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    for run in (run_ort, run_reference):  # each runtime against its own run of the unquantized graph
        for r, o in zip(run(onnx.load(path), feed), run(q, feed)):
            assert sqnr_db(r, o) > floor
    return report, q


@pytest.mark.parametrize("opset", [11, 12, 13, 14, 15, 16, 17, 21, 22])
def test_opsets(tmp_path, opset):
    path, data = mlp_model(tmp_path / "m.onnx", opset=opset), mlp_data(tmp_path / "d.npz")
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")
    assert len(report.quantized) == 2
    upgraded = f"upgraded opset {opset} -> 21"
    assert (upgraded in report.summary()) == (opset < 21)
    assert onnx.load(tmp_path / "q.onnx").opset_import[0].version == max(opset, 21)


def test_float16_model(tmp_path):
    path = mlp_model(tmp_path / "m.onnx", dtype=np.float16)
    x = RNG.standard_normal((8, 16)).astype(np.float16)
    _report, q = quantize_and_check(tmp_path, path, {"x": x}, floor=FLOOR - 3)
    scales = [i for i in q.graph.initializer if i.name.endswith("/scale")]
    assert scales and {s.data_type for s in scales} == {TensorProto.FLOAT16}


def test_mixed_float16_and_float32(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fp32_matmul"),
        helper.make_node("Cast", ["h"], ["h16"], to=TensorProto.FLOAT16, name="to16"),
        helper.make_node("MatMul", ["h16", "w2"], ["y16"], name="fp16_matmul"),
        helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT, name="to32"),
    ]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["b", 16])],
        [vi("y", ["b", 8])],
        [numpy_helper.from_array(w(16, 32), "w1"), numpy_helper.from_array(w(32, 8, dtype=np.float16), "w2")],
    )
    report, q = quantize_and_check(
        tmp_path, path, {"x": RNG.standard_normal((8, 16)).astype(np.float32)}, floor=FLOOR - 3
    )
    assert len(report.quantized) == 2
    scale_types = {i.name: i.data_type for i in q.graph.initializer if i.name.endswith("/scale")}
    assert (
        scale_types["fp8onnx/w1/scale"] == TensorProto.FLOAT and scale_types["fp8onnx/w2/scale"] == TensorProto.FLOAT16
    )


def test_bfloat16_where_ort_runs_it(tmp_path):
    import ml_dtypes

    path = save(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [vi("x", ["b", 16], TensorProto.BFLOAT16)],
        [vi("y", ["b", 8], TensorProto.BFLOAT16)],
        [
            helper.make_tensor(
                "w",
                TensorProto.BFLOAT16,
                [16, 8],
                w(16, 8).astype(ml_dtypes.bfloat16).view(np.uint16).tobytes(),
                raw=True,
            )
        ],
    )
    x = RNG.standard_normal((4, 16)).astype(ml_dtypes.bfloat16)
    try:
        run_ort(onnx.load(path), {"x": x})
    except Exception:
        # Then fp8onnx cannot check its output there either: one sentence, and nothing written.
        with pytest.raises(Fp8OnnxError, match="does not load in onnxruntime"):
            fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", provider="cpu")
        assert not (tmp_path / "q.onnx").exists()
        return
    quantize_and_check(tmp_path, path, {"x": x}, floor=FLOOR - 6)


@pytest.mark.parametrize(
    "trans_a, trans_b, alpha, beta", [(0, 0, 1.0, 1.0), (1, 0, 0.5, 2.0), (0, 1, 2.0, 0.0), (1, 1, 1.0, 1.0)]
)
def test_gemm_attributes(tmp_path, trans_a, trans_b, alpha, beta):
    a_shape = [16, "b"] if trans_a else ["b", 16]
    w_arr = w(8, 16) if trans_b else w(16, 8)
    nodes = [
        helper.make_node(
            "Gemm", ["a", "w", "c"], ["y"], name="gemm", transA=trans_a, transB=trans_b, alpha=alpha, beta=beta
        )
    ]
    path = save(
        tmp_path,
        nodes,
        [vi("a", a_shape)],
        [vi("y", ["b", 8])],
        [numpy_helper.from_array(w_arr, "w"), numpy_helper.from_array(w(8), "c")],
    )
    a = RNG.standard_normal((16, 6) if trans_a else (6, 16)).astype(np.float32)
    report, q = quantize_and_check(tmp_path, path, {"a": a}, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2))
    gemm = next(n for n in q.graph.node if n.op_type == "Gemm")
    assert list(gemm.input) == ["fp8onnx/a/dequantized", "fp8onnx/w/dequantized", "c"]
    report, q = quantize_and_check(tmp_path, path, {"a": a}, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2), per_channel=True)
    assert report.quantized[0].tensors[1].axis == (0 if trans_b else 1)


def test_batched_and_broadcast_matmul(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w2d"], ["h"], name="broadcast"),  # [b, s, 16] @ [16, 8]
        helper.make_node("MatMul", ["h", "w3d"], ["y"], name="batched"),  # [2, s, 8] @ [2, 8, 4]
    ]
    path = save(
        tmp_path,
        nodes,
        [vi("x", [2, "s", 16])],
        [vi("y", [2, "s", 4])],
        [numpy_helper.from_array(w(16, 8), "w2d"), numpy_helper.from_array(w(2, 8, 4), "w3d")],
    )
    report, _q = quantize_and_check(tmp_path, path, {"x": RNG.standard_normal((2, 5, 16)).astype(np.float32)})
    assert len(report.quantized) == 2
    quantize_and_check(tmp_path, path, {"x": RNG.standard_normal((2, 5, 16)).astype(np.float32)}, per_channel=True)


@pytest.mark.parametrize("chain", [["Identity"], ["Transpose"], ["Cast"], ["Cast", "Transpose", "Identity"]])
def test_weight_reached_through_transforms(tmp_path, chain):
    nodes, src = [], "w"
    arr = w(8, 16)  # transposed once below when the chain holds a Transpose
    if "Transpose" not in chain:
        arr = w(16, 8)
    if "Cast" in chain:
        arr = arr.astype(np.float16)
    for i, op in enumerate(chain):
        attrs = {"to": TensorProto.FLOAT} if op == "Cast" else {"perm": [1, 0]} if op == "Transpose" else {}
        nodes.append(helper.make_node(op, [src], [f"t{i}"], name=f"{op}{i}", **attrs))
        src = f"t{i}"
    nodes.append(helper.make_node("MatMul", ["x", src], ["y"], name="mm"))
    path = save(tmp_path, nodes, [vi("x", ["b", 16])], [vi("y", ["b", 8])], [numpy_helper.from_array(arr, "w")])
    report, q = quantize_and_check(
        tmp_path, path, {"x": RNG.standard_normal((6, 16)).astype(np.float32)}, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2)
    )
    assert [t.kind for t in report.quantized[0].tensors] == ["activation", "weight"]
    assert not set(chain) & set(op_types(q))  # folded away
    assert any("folded" in step for step in report.prepared)


def test_shared_weight_is_stored_once(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="a"),
        helper.make_node("MatMul", ["x2", "w"], ["y"], name="b"),
    ]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["b", 16]), vi("x2", ["b", 16])],
        [vi("h", ["b", 16]), vi("y", ["b", 16])],
        [numpy_helper.from_array(w(16, 16), "w")],
    )
    feed = {"x": RNG.standard_normal((4, 16)).astype(np.float32), "x2": RNG.standard_normal((4, 16)).astype(np.float32)}
    _report, q = quantize_and_check(tmp_path, path, feed, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2))
    assert [i.name for i in q.graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN] == ["fp8onnx/w/fp8"]
    assert sum(1 for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "fp8onnx/w/fp8") == 1


def test_weight_as_constant_node(tmp_path):
    nodes = [
        helper.make_node("Constant", [], ["w"], name="c", value=numpy_helper.from_array(w(16, 8))),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
    ]
    path = save(tmp_path, nodes, [vi("x", ["b", 16])], [vi("y", ["b", 8])], [])
    report, _q = quantize_and_check(
        tmp_path, path, {"x": RNG.standard_normal((4, 16)).astype(np.float32)}, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2)
    )
    assert [t.kind for t in report.quantized[0].tensors] == ["activation", "weight"]
    assert "lifted Constant nodes to initializers" in report.prepared


def test_matmul_inside_a_function_is_quantized(tmp_path):
    fn = helper.make_function(
        "local",
        "Dense",
        ["a", "b"],
        ["c"],
        [helper.make_node("MatMul", ["a", "b"], ["c"], name="fmm")],
        [helper.make_opsetid("", 21)],
    )
    nodes = [helper.make_node("Dense", ["x", "w"], ["y"], domain="local", name="call")]
    graph = helper.make_graph(
        nodes, "g", [vi("x", ["b", 16])], [vi("y", ["b", 8])], [numpy_helper.from_array(w(16, 8), "w")]
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("local", 1)], functions=[fn]
    )
    onnx.save(model, tmp_path / "m.onnx")
    report, _q = quantize_and_check(
        tmp_path,
        tmp_path / "m.onnx",
        {"x": RNG.standard_normal((4, 16)).astype(np.float32)},
        floor=sqnr_floor_db(Fp8Format.E4M3FN, 2),
    )
    assert len(report.quantized) == 1 and "inlined model-local functions" in report.prepared


def test_matmul_inside_if_branches_is_quantized(tmp_path):
    then_graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["t"], name="then_mm")], "then", [], [vi("t", ["b", 8])]
    )
    else_graph = helper.make_graph(
        [
            helper.make_node("Neg", ["x"], ["n"], name="neg"),
            helper.make_node("MatMul", ["n", "w"], ["e"], name="else_mm"),
        ],
        "else",
        [],
        [vi("e", ["b", 8])],
    )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_graph, else_branch=else_graph),
        helper.make_node("MatMul", ["x", "w"], ["z"], name="main_mm"),
    ]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["b", 16]), vi("cond", [], TensorProto.BOOL)],
        [vi("y", ["b", 8]), vi("z", ["b", 8])],
        [numpy_helper.from_array(w(16, 8), "w")],
    )
    for cond in (True, False):
        feed = {"x": RNG.standard_normal((4, 16)).astype(np.float32), "cond": np.array(cond)}
        report, q = quantize_and_check(
            tmp_path, path, feed, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2), feeds_layout=True
        )
    assert sorted(n.name for n in report.quantized) == ["else_mm", "main_mm", "then_mm"]
    scales = {t.name: t.scale for n in report.quantized for t in n.tensors}
    assert isinstance(scales["x"], float)  # a main-graph tensor read inside the branch: calibrated
    assert scales["n"] is None  # computed inside the branch: calibration cannot see it, dynamic scale
    if_node = next(n for n in q.graph.node if n.op_type == "If")
    else_ops = [
        n.op_type
        for n in onnx.helper.get_attribute_value(
            if_node.attribute[0] if if_node.attribute[0].name == "else_branch" else if_node.attribute[1]
        ).node
    ]
    assert {"ReduceMax", "QuantizeLinear", "DequantizeLinear"} <= set(else_ops)


def test_matmul_inside_loop_body_is_quantized(tmp_path):
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
            helper.make_node("MatMul", ["h_in", "w"], ["h_mm"], name="loop_mm"),
            helper.make_node("Tanh", ["h_mm"], ["h_out"], name="tanh"),
        ],
        "body",
        [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL), vi("h_in", ["b", 16])],
        [vi("cond_out", [], TensorProto.BOOL), vi("h_out", ["b", 16])],
    )
    nodes = [helper.make_node("Loop", ["trips", "", "x"], ["h"], name="loop", body=body)]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["b", 16])],
        [vi("h", ["b", 16])],
        [numpy_helper.from_array(w(16, 16), "w"), numpy_helper.from_array(np.array(3, np.int64), "trips")],
    )
    report, _q = quantize_and_check(
        tmp_path, path, {"x": RNG.standard_normal((4, 16)).astype(np.float32)}, floor=sqnr_floor_db(Fp8Format.E4M3FN, 6)
    )
    assert [n.name for n in report.quantized] == ["loop_mm"]
    assert next(t.scale for t in report.quantized[0].tensors) is None  # the loop-carried state: dynamic


def test_existing_int8_qdq_is_left_alone(tmp_path):
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq"),
        helper.make_node("MatMul", ["xd", "w"], ["h"], name="int8_mm"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="float_mm"),
    ]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["b", 16])],
        [vi("y", ["b", 8])],
        [
            numpy_helper.from_array(np.array(0.02, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "zp"),
            numpy_helper.from_array(w(16, 16), "w"),
            numpy_helper.from_array(w(16, 8), "w2"),
        ],
    )
    report, _q = quantize_and_check(
        tmp_path, path, {"x": RNG.standard_normal((4, 16)).astype(np.float32)}, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2)
    )
    assert [n.name for n in report.quantized] == ["float_mm"]
    assert {n.name: n.reason for n in report.skipped}["int8_mm"] == (
        "already quantized: input 'xd' comes from DequantizeLinear or fp8onnx"
    )


def test_nothing_to_quantize_writes_the_input_graph(tmp_path):
    path = save(
        tmp_path,
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [vi("x", ["b", 16])],
        [vi("y", ["b", 16])],
        [],
        opset=17,
    )
    np.savez(tmp_path / "d.npz", x=np.ones((2, 16), np.float32))
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "d.npz", provider="cpu")
    assert "nothing to quantize: the output is the input graph, unchanged" in report.summary()
    before, after = onnx.load(path), onnx.load(tmp_path / "q.onnx")
    assert after.opset_import[0].version == 17
    assert before.graph.SerializeToString() == after.graph.SerializeToString()


def test_dynamic_batch_and_sequence_axes(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["batch", "seq", 16])],
        [vi("y", ["batch", "seq", 8])],
        [numpy_helper.from_array(w(16, 8), "w")],
    )
    np.savez(tmp_path / "calib.npz", x=RNG.standard_normal((4, 7, 16)).astype(np.float32))
    fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "calib.npz", provider="cpu")
    q = onnx.load(tmp_path / "q.onnx")
    for shape in [(1, 3, 16), (5, 11, 16)]:
        x = RNG.standard_normal(shape).astype(np.float32)
        assert sqnr_db(run_ort(onnx.load(path), {"x": x})[0], run_ort(q, {"x": x})[0]) > sqnr_floor_db(
            Fp8Format.E4M3FN, 2
        )


def test_matmul_inside_scan_body_is_quantized(tmp_path):
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["row", "w"], ["out"], name="scan_mm"),
            helper.make_node("Add", ["acc_in", "out"], ["acc_out"], name="acc"),
        ],
        "body",
        [vi("acc_in", [8]), vi("row", [16])],
        [vi("acc_out", [8]), vi("out", [8])],
    )
    nodes = [helper.make_node("Scan", ["zero", "x"], ["total", "rows"], name="scan", body=body, num_scan_inputs=1)]
    path = save(
        tmp_path,
        nodes,
        [vi("x", ["n", 16])],
        [vi("total", [8]), vi("rows", ["n", 8])],
        [numpy_helper.from_array(w(16, 8), "w"), numpy_helper.from_array(np.zeros(8, np.float32), "zero")],
    )
    feed = {"x": RNG.standard_normal((1, 5, 16)).astype(np.float32)[0]}
    report, _q = quantize_and_check(tmp_path, path, feed, floor=sqnr_floor_db(Fp8Format.E4M3FN, 2))
    assert [n.name for n in report.quantized] == ["scan_mm"]
    assert report.quantized[0].tensors[0].scale is None  # each scanned row: dynamic scale


@pytest.mark.parametrize("activations", ["none", "static"])
def test_an_outer_product_is_left_alone(tmp_path, activations):
    """A dynamo export's rotary angles: Cos(MatMul(inv_freq [1, D/2, 1] constant, positions [1, 1, S])): K = 1,
    the constant looks like a weight. Left in float, with the reason; the block's real MatMul is quantized."""
    rng = np.random.default_rng(0)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).reshape(1, 4, 1).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["inv_freq", "pos"], ["angles"], name="rotary"),
        helper.make_node("Cos", ["angles"], ["cos"], name="cos"),
        helper.make_node("MatMul", ["cos", "w"], ["y"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "rotary",
        [helper.make_tensor_value_info("pos", TensorProto.FLOAT, [1, 1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [
            numpy_helper.from_array(inv_freq, "inv_freq"),
            numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w"),
        ],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    feed = {"pos": np.arange(1000, 1016, dtype=np.float32).reshape(1, 1, 16)}  # far positions: FP8 would wreck them
    calib = tmp_path / "c.npz"
    np.savez(calib, pos=np.stack([feed["pos"]] * 2))
    kw = {"calib": calib} if activations == "static" else {}
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", activations=activations, provider="cpu", **kw)
    assert [n.name for n in report.quantized] == ["proj"]
    skipped = {n.name: n.reason for n in report.nodes if not n.quantized}
    assert skipped["rotary"].startswith("an outer product (K = 1")
    ref, out = run_ort(path, feed)[0], run_ort(tmp_path / "q.onnx", feed)[0]
    assert sqnr_db(ref, out) > sqnr_floor_db(Fp8Format.E4M3FN, quantized_tensors=1 if activations == "none" else 2)
