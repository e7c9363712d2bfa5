"""Tied input/output embeddings stored once: torch exports (TorchScript and dynamo) of a tiny tied LM."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.passes import TieEmbeddingsPass

from helpers import assert_same_sums, run_ort, run_reference, sqnr_db, sum_magnitude

torch = pytest.importorskip("torch")

VOCAB, DIM = 2000, 32


def tied_lm(path, dynamo: bool, tied: bool = True):
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM)
            self.fc = torch.nn.Linear(DIM, DIM)
            self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
            if tied:
                self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.relu(self.fc(self.emb(ids))))

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8))
    if dynamo:
        torch.onnx.export(LM().eval(), (ids,), path, dynamo=True, input_names=["ids"], verbose=False)
    else:
        axes = {"ids": {0: "b", 1: "s"}}
        torch.onnx.export(
            LM().eval(), (ids,), path, dynamo=False, opset_version=17, input_names=["ids"], dynamic_axes=axes
        )
    return path


def ids(seed, shape=(2, 8)):
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int64)


def tables(model: onnx.ModelProto) -> list[tuple[str, list[int]]]:
    return [(i.name, list(i.dims)) for i in model.graph.initializer if len(i.dims) == 2 and VOCAB in i.dims]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_prepare_stores_the_tied_table_once_and_computes_the_same(tmp_path, dynamo):
    path = tied_lm(tmp_path / "lm.onnx", dynamo)
    assert len(tables(onnx.load(path))) == (1 if dynamo else 2)  # dynamo: Transpose(E), folded into a copy
    model, _, done = prepare_model(path)
    assert "stored the tied input/output embedding table once" in done
    ir.save(model, tmp_path / "prepared.onnx")
    prepared = onnx.load(tmp_path / "prepared.onnx")
    onnx.checker.check_model(prepared, full_check=True)
    assert [dims for _, dims in tables(prepared)] == [[DIM, VOCAB]]
    feed = {"ids": ids(1)}
    # the same numbers, multiplied by two graphs (a constant table or a computed transpose): equal up to
    # the summation order (SPEC §11)
    terms, magnitude = sum_magnitude(prepared, feed, output=prepared.graph.output[0].name)
    assert_same_sums(run_ort(prepared, feed)[0], run_ort(path, feed)[0], terms, magnitude)
    assert_same_sums(run_reference(prepared, feed)[0], run_reference(path, feed)[0], terms, magnitude)
    assert not TieEmbeddingsPass()(ir.load(tmp_path / "prepared.onnx")).modified  # idempotent


def test_untied_weights_are_left_alone(tmp_path):
    path = tied_lm(tmp_path / "lm.onnx", dynamo=False, tied=False)
    model, _, done = prepare_model(path)
    assert not any("tied" in d for d in done)
    assert sorted(dims for _, dims in tables(ir.to_proto(model))) == [[DIM, VOCAB], [VOCAB, DIM]]


def test_equal_shapes_but_different_values_are_not_tied(tmp_path):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((300, 8)).astype(np.float32)
    weight = table.T.copy()
    weight[3, 5] += 1e-3  # one value differs
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
            helper.make_node("MatMul", ["e", "w"], ["logits"], name="head"),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 300])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "w")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert not TieEmbeddingsPass()(model).modified
    assert sorted(model.graph.initializers) == ["table", "w"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_quantized_tied_lm_keeps_one_table(tmp_path, dynamo):
    path = tied_lm(tmp_path / "lm.onnx", dynamo)
    calib = tmp_path / "calib.npz"
    np.savez(calib, ids=np.stack([ids(s) for s in range(4)]))
    feed = {"ids": ids(3)}
    want = run_ort(path, feed)[0]

    # lm_head in float (--preset llm): the Gather reads the float projection weight, no codes table.
    out = tmp_path / "llm.onnx"
    report = fp8onnx.quantize(path, out, calib=calib, config=fp8onnx.QuantizeConfig.for_preset("llm"))
    q = onnx.load(out)
    assert [dims for _, dims in tables(q)] == [[DIM, VOCAB]]
    assert not any(i.name.endswith("_codes") for i in q.graph.initializer)
    assert any("stays in float with it" in p for p in report.prepared)
    assert sqnr_db(want, run_ort(q, feed)[0]) > 25

    # lm_head in FP8 with --embeddings fp8: the Gather reads the projection's DequantizeLinear.
    out = tmp_path / "fp8.onnx"
    report = fp8onnx.quantize(path, out, calib=calib, config=fp8onnx.QuantizeConfig(embeddings="fp8"))
    q = onnx.load(out)
    onnx.checker.check_model(q, full_check=True)
    big = [i for i in q.graph.initializer if VOCAB in i.dims]
    assert [(i.data_type, list(i.dims)) for i in big] == [(TensorProto.FLOAT8E4M3FN, [DIM, VOCAB])]
    gather = next(n for n in q.graph.node if n.op_type == "Gather" and n.attribute[0].i == 1)
    producer = next(n for n in q.graph.node if gather.input[0] in n.output)
    assert producer.op_type == "DequantizeLinear" and producer.input[0] == big[0].name
    assert any("gathered from its projection's e4m3fn weight" in p for p in report.prepared)
    got = run_ort(q, feed)[0]
    assert sqnr_db(want, got) > 20
    assert np.allclose(run_reference(q, feed)[0], got, rtol=1e-4, atol=1e-4)
