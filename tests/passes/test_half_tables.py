"""Float tables that stay in float stored in 16 bits: the same interface, the values rounded once, half the bytes."""

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.passes import HalfTablesPass

from helpers import assert_same_sums, run_ort, run_reference, sqnr_db

VOCAB, DIM = 1000, 16


def tied_head(path, scale: float = 1.0, fc: bool = False):
    """ids -> Gather(W, axis=1) -> Transpose [-> MatMul(fc) -> Relu] -> MatMul(., W): a tied table read by a
    Gather and a MatMul, as TieEmbeddingsPass leaves a torch export."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((DIM, VOCAB)) * scale).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["W", "ids"], ["cols"], name="embed", axis=1),
        helper.make_node("Transpose", ["cols"], ["e"], name="t", perm=[1, 2, 0]),
        helper.make_node("MatMul", ["e", "W"], ["logits"], name="lm_head"),
    ]
    weights = [numpy_helper.from_array(w, "W")]
    if fc:
        nodes[2:2] = [
            helper.make_node("MatMul", ["e", "fc_w"], ["h"], name="fc"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
        ]
        nodes[-1].input[0] = "r"
        weights.append(numpy_helper.from_array(rng.standard_normal((DIM, DIM)).astype(np.float32), "fc_w"))
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", VOCAB])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path, w


def rounded_copy(path, out, w):
    """The same graph with W replaced by its given (already rounded) float32 values."""
    model = onnx.load(path)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w.astype(np.float32), "W"))
    onnx.save(model, out)
    return out


@pytest.mark.parametrize(
    ("scale", "dtype", "np_dtype"), [(1.0, "float16", np.float16), (1e5, "bfloat16", ml_dtypes.bfloat16)]
)
def test_the_table_is_stored_in_16_bits_and_read_as_its_rounded_values(tmp_path, scale, dtype, np_dtype):
    path, w = tied_head(tmp_path / "m.onnx", scale)
    model = ir.load(path)
    result = HalfTablesPass(["W"])(model)
    assert result.modified and result.stored == {"W": dtype}
    ir.save(model, tmp_path / "h.onnx")
    h = onnx.load(tmp_path / "h.onnx")
    onnx.checker.check_model(h, full_check=True)
    stored = [i for i in h.graph.initializer]
    assert (
        len(stored) == 1
        and stored[0].data_type == getattr(TensorProto, dtype.upper())
        and list(stored[0].dims) == [DIM, VOCAB]
    )
    assert h.graph.node[0].op_type == "Cast" and h.graph.node[0].output == ["W"]
    assert (tmp_path / "h.onnx").stat().st_size < 0.55 * path.stat().st_size
    feed = {"ids": np.random.default_rng(1).integers(0, VOCAB, (2, 5)).astype(np.int64)}
    rounded = rounded_copy(path, tmp_path / "r.onnx", w.astype(np_dtype).astype(np.float32))
    want = run_reference(rounded, feed)[0]
    # exact: onnx.reference multiplies the same float32 arrays (the Cast's output is the rounded table) in the
    # same NumPy call: the same sums, only the graph around them differs
    assert np.array_equal(run_reference(h, feed)[0], want)
    for level in ("default", "disable"):  # the Cast folded at session creation, or run each time
        assert_same_sums(run_ort(h, feed, level=level)[0], run_ort(rounded, feed)[0], DIM, scale * scale * 4)
    floor = 60 if dtype == "float16" else 40
    assert sqnr_db(run_ort(path, feed)[0], run_ort(h, feed)[0]) > floor
    assert not HalfTablesPass(["W"])(ir.load(tmp_path / "h.onnx")).modified  # idempotent: W is a Cast's output now


def test_what_is_not_a_float32_initializer_stays_as_it_is(tmp_path):
    path, _ = tied_head(tmp_path / "m.onnx")
    model = ir.load(path)
    result = HalfTablesPass(["ids", "nothing"])(model)
    assert not result.modified and set(result.skipped) == {"ids", "nothing"}
    assert "not an initializer" in result.skipped["nothing"]


@pytest.mark.parametrize("wide", [False, True])
def test_a_float_lm_head_is_stored_in_16_bits_unless_wide_tables(tmp_path, wide):
    path, _ = tied_head(tmp_path / "lm.onnx", fc=True)
    calib = tmp_path / "calib.npz"
    np.savez(calib, ids=np.random.default_rng(2).integers(0, VOCAB, (8, 2, 8)).astype(np.int64))
    config = fp8onnx.QuantizeConfig.for_preset("llm-weight-only", wide_tables=wide)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", calib=calib, config=config)
    q = onnx.load(tmp_path / "q.onnx")
    types = {i.data_type for i in q.graph.initializer if len(i.dims) == 2 and VOCAB in i.dims}
    said = [p for p in report.prepared if "stored as float16" in p]
    if wide:
        assert types == {TensorProto.FLOAT} and not said and report.config["wide_tables"]
    else:
        assert types == {TensorProto.FLOAT16} and len(said) == 1, report.prepared
        assert "wide_tables" not in report.config
    feed = {"ids": np.random.default_rng(3).integers(0, VOCAB, (2, 8)).astype(np.int64)}
    assert sqnr_db(run_ort(path, feed)[0], run_ort(q, feed)[0]) > 25
