"""Outlier input channels kept in float (--keep-channels): a massive activation channel leaves the FP8
product for a small float one; the float function is unchanged."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.graph.plan import Decision
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.techniques.outlier_channels import OutlierChannels

from helpers import run_ort, run_reference, sqnr_db, sqnr_floor_db

D, N = 32, 16


def massive(path, rng, gemm=False, shared=False):
    """x -> MatMul(q), MatMul(k) (or Gemm, transB, alpha 0.5, bias). Channel 3 of x is a massive activation:
    about 40 on every row, against unit-scale channels, with weight rows of the same size as the others', so
    that its term dominates every output (Gemma 3's attention input). ``shared``: q and k read one weight."""
    wq, wk = ((rng.standard_normal((D, N)) / 6).astype(np.float32) for _ in range(2))
    if shared:
        wk = wq
    if gemm:
        nodes = [
            helper.make_node("Gemm", ["x", "wq", "b"], ["q"], name="mm_q", transB=1, alpha=0.5),
            helper.make_node("Gemm", ["x", "wk"], ["k"], name="mm_k", transB=1, alpha=0.5),
        ]
        inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), n) for w, n in ((wq, "wq"), (wk, "wk"))]
        inits.append(numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "b"))
    else:
        names = ("wq", "wq") if shared else ("wq", "wk")
        nodes = [
            helper.make_node("MatMul", ["x", names[0]], ["q"], name="mm_q"),
            helper.make_node("MatMul", ["x", names[1]], ["k"], name="mm_k"),
        ]
        inits = [numpy_helper.from_array(w, n) for w, n in zip((wq, wk), names)][: 1 if shared else 2]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", N]) for n in ("q", "k")]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", D])
    graph = helper.make_graph(nodes, "massive", [x_info], outs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = rng.standard_normal((512, D)).astype(np.float32)
    x[:, 3] = 40 + rng.standard_normal(512).astype(np.float32)
    return path, x


def test_kept_channel_lifts_w8a8_and_the_graph_says_how(tmp_path):
    rng = np.random.default_rng(0)
    path, x = massive(tmp_path / "m.onnx", rng)
    np.savez(tmp_path / "calib.npz", x=x[:256])
    held_out = {"x": x[256:]}
    refs = run_ort(path, held_out)
    sqnr, reports = {}, {}
    for keep in (0, 1):
        out = tmp_path / f"q{keep}.onnx"
        reports[keep] = fp8onnx.quantize(
            path, out, tmp_path / "calib.npz", keep_channels=keep, activations="static", per_channel=True
        )
        sqnr[keep] = min(sqnr_db(r, g) for r, g in zip(refs, run_ort(out, held_out)))
        for r, g in zip(refs, run_reference(out, held_out)):  # the ONNX reference agrees with onnxruntime
            assert sqnr_db(r, g) > sqnr[keep] - 1
    assert sqnr[1] > sqnr[0] + 8  # the dominant term's rounding (its input and its weight row) is gone
    assert sqnr[1] > sqnr_floor_db(Fp8Format.E4M3FN, 2)
    line = "kept the 1 largest input channels of 1 activations in float (2 MatMul/Gemm split"
    assert any(line in p for p in reports[1].prepared)
    q = onnx.load(tmp_path / "q1.onnx")
    ops = [n.op_type for n in q.graph.node]
    assert ops.count("Gather") == 1 and ops.count("MatMul") == 4 and ops.count("Add") == 2
    assert ops.count("QuantizeLinear") == 1  # x, once, for both FP8 products; the kept column is float
    assert [o.name for o in q.graph.output] == ["q", "k"]  # the graph's outputs keep their names
    side = [n for n in q.graph.node if n.name.endswith("/kept_matmul")]
    producers = {o: n.op_type for n in q.graph.node for o in n.output}
    assert len(side) == 2 and all(producers[n.input[0]] == "Gather" for n in side)  # float, no DequantizeLinear
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    assert inits["fp8onnx/x/kept_channels"].tolist() == [3]
    codes = [v for v in inits.values() if "float8" in str(v.dtype)]
    assert codes and all(np.all(c.astype(np.float32)[3] == 0) for c in codes)  # the kept rows are zero in FP8


def measured(tech: OutlierChannels, amax: np.ndarray) -> None:
    """``tech``'s statistic as a calibration pass leaves it: x's per-channel amax."""
    tech.amax.fetch = {"x": ["amax"]}
    tech.amax.merge({"amax": amax})


@pytest.mark.parametrize("gemm", [False, True], ids=["matmul", "gemm-transB-alpha-bias"])
def test_split_keeps_the_float_function(tmp_path, gemm):
    """requires: amax per channel of x; ensures: x W == x W' + x[:, idx] W[idx] up to float rounding (Gemm's
    alpha, transB and bias included), before any quantization."""
    rng = np.random.default_rng(1)
    path, x = massive(tmp_path / "m.onnx", rng, gemm=gemm)
    model = ir.load(str(path))
    decisions = [Decision(n, [(0, "activation"), (1, "weight")]) for n in model.graph]
    tech = OutlierChannels(model, decisions, 2)
    amax = np.abs(x).max(0)
    amax[7] = 1e3  # two channels to keep: 3 (the data's) and 7
    measured(tech, amax)
    line = tech.apply()
    assert tech.kept == {"x": [3, 7]} and "2 MatMul/Gemm split" in line
    # W' is computed where it is read, never held beside the weight (a model calibrated layer by layer)
    assert all(isinstance(n.inputs[1].const_value, ir.LazyTensor) for n in model.graph if n.name.startswith("mm_"))
    out = tmp_path / "split.onnx"
    ir.save(model, str(out))
    for r, g in zip(run_ort(path, {"x": x}), run_ort(out, {"x": x})):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-3)


def test_a_shared_weight_is_left_whole(tmp_path):
    path, x = massive(tmp_path / "m.onnx", np.random.default_rng(2), shared=True)
    model = ir.load(str(path))
    decisions = [Decision(n, [(0, "activation"), (1, "weight")]) for n in model.graph]
    tech = OutlierChannels(model, decisions, 1)
    measured(tech, np.abs(x).max(0))
    tech.apply()
    assert tech.kept == {} and [n.op_type for n in model.graph] == ["MatMul", "MatMul"]
    assert not [name for name in model.graph.initializers if name.startswith("fp8onnx/")]  # nothing left behind


def test_keep_channels_refuses_what_it_cannot_do(tmp_path):
    path, _ = massive(tmp_path / "m.onnx", np.random.default_rng(3))
    with pytest.raises(Fp8OnnxError, match="--keep-channels must be a non-negative integer"):
        fp8onnx.QuantizeConfig(keep_channels=-1)
    with pytest.raises(Fp8OnnxError, match="--keep-channels and --smooth both move activation outliers"):
        fp8onnx.QuantizeConfig(keep_channels=2, smooth=0.5)
    with pytest.raises(Fp8OnnxError, match="--keep-channels needs --calib DATA"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic", keep_channels=1)
    args = ["quantize", str(path), "--keep-channels", "1", "--smooth", "0.5", "-o", str(tmp_path / "q.onnx")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "choose one" in result.output


def test_a_reader_inside_a_subgraph_gets_the_gather_where_the_activation_is_defined(tmp_path):
    """An Optimum merged decoder reads the encoder's output (a main-graph input) from MatMuls inside If
    branches: the Gather and its indices go to the main graph, each side product to its branch, and the
    function is unchanged in onnxruntime on both branches."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((D, N)) / 6).astype(np.float32)
    branches = []
    for name, scale in (("then", 1.0), ("else", -1.0)):
        body = helper.make_graph(
            [helper.make_node("MatMul", ["x", f"w_{name}"], [f"y_{name}"], name=f"mm_{name}")],
            name,
            [],
            [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["n", N])],
            [numpy_helper.from_array(scale * w, f"w_{name}")],
        )
        branches.append(helper.make_attribute(f"{name}_branch", body))
    node = helper.make_node("If", ["cond"], ["y"], name="if")
    node.attribute.extend(branches)
    inputs = [
        helper.make_tensor_value_info("cond", TensorProto.BOOL, [1]),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", D]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", N])]
    path = tmp_path / "m.onnx"
    graph = helper.make_graph([node], "branched", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    model = ir.load(str(path))
    matmuls = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type == "MatMul"]
    tech = OutlierChannels(model, [Decision(n, [(0, "activation"), (1, "weight")]) for n in matmuls], 1)
    x = rng.standard_normal((64, D)).astype(np.float32)
    x[:, 3] = 40 + rng.standard_normal(64).astype(np.float32)
    measured(tech, np.abs(x).max(0))
    assert "2 MatMul/Gemm split" in tech.apply() and tech.kept == {"x": [3]}
    assert [n.op_type for n in model.graph] == ["Gather", "If"]
    assert "fp8onnx/x/kept_channels" in model.graph.initializers
    assert all(name.endswith("kept_rows") for n in matmuls for name in n.graph.initializers if "kept" in name)
    out = tmp_path / "split.onnx"
    ir.save(model, str(out))
    for cond in (True, False):
        feed = {"x": x, "cond": np.array([cond])}
        np.testing.assert_allclose(run_ort(out, feed)[0], run_ort(path, feed)[0], rtol=1e-4, atol=1e-3)
