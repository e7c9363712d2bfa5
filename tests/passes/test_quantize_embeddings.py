"""Embedding tables stored as float8 codes: exact values, kept interface, tables read elsewhere left alone."""

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.passes import QuantizeEmbeddingsPass

from helpers import run_ort, run_reference, sqnr_db


def embedding(path, rows=1000, dim=8, tied=False):
    """ids -> Gather(table) -> the output "e" (and, with ``tied``, MatMul(e, table^T) reading the table too)."""
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((rows, dim)) * np.exp(rng.standard_normal((rows, 1)) * 3)).astype(np.float32)
    table[7] = 0.0  # an all-zero row
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed")]
    outputs = [helper.make_tensor_value_info("e", TensorProto.FLOAT, ["b", "s", dim])]
    if tied:
        nodes.append(helper.make_node("MatMul", ["e", "table_t"], ["logits"], name="head"))
        nodes.insert(0, helper.make_node("Transpose", ["table"], ["table_t"], name="t"))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", rows]))
    graph = helper.make_graph(
        nodes,
        "emb",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        outputs,
        [numpy_helper.from_array(table, "table")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path, table


def test_decoded_rows_are_exactly_the_quantized_rows(tmp_path):
    path, table = embedding(tmp_path / "m.onnx")
    model = ir.load(path)
    result = QuantizeEmbeddingsPass()(model)
    assert result.modified and result.quantized == ["table"]
    assert "table" not in model.graph.initializers
    ir.save(model, tmp_path / "q.onnx")
    assert not QuantizeEmbeddingsPass()(ir.load(tmp_path / "q.onnx")).modified  # idempotent
    q = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(q, full_check=True)
    assert [o.name for o in q.graph.output] == ["e"]
    scale = (np.abs(table).max(1, keepdims=True) / np.float32(448)).astype(np.float32)
    scale[7] = 1.0
    want = (table / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    ids = np.array([[0, 7, 999, 3], [5, 5, 1, 2]], np.int64)
    for run in (run_ort, run_reference):
        got = run(q, {"ids": ids})[0]
        assert np.array_equal(got, want[ids])
    assert sqnr_db(table[ids], want[ids]) > 25
    codes = next(i for i in q.graph.initializer if i.name.endswith("_codes"))
    assert codes.data_type == TensorProto.UINT8 and list(codes.dims) == [1000, 8]


def test_a_table_read_by_another_op_is_left_alone(tmp_path):
    path, _ = embedding(tmp_path / "m.onnx", tied=True)
    result = QuantizeEmbeddingsPass()(ir.load(path))
    assert not result.modified and "also read by Transpose 't'" in result.skipped["table"]


def test_quantize_embeddings_fp8_shrinks_the_file(tmp_path):
    path, _ = embedding(tmp_path / "m.onnx", rows=4000, dim=64)
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", embeddings="fp8", activations="none", provider="cpu")
    assert report.modified and any("stored 1 embedding tables as e4m3fn codes" in p for p in report.prepared)
    assert report.output_bytes < 0.27 * report.input_bytes
    assert report.config["embeddings"] == "fp8"
    small, _ = embedding(tmp_path / "s.onnx", rows=100)
    kept = fp8onnx.quantize(small, tmp_path / "k.onnx", embeddings="fp8", activations="none", provider="cpu")
    assert not kept.modified  # nothing else to quantize either: the output is the input graph
