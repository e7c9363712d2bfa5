import numpy as np
import onnx_ir as ir
import pytest

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.feeds import FeedData, InputSpec, NpzData, input_specs

from helpers import mlp_model

SPECS = [InputSpec("x", np.dtype(np.float32), (None, 16))]
FIXED = [InputSpec("x", np.dtype(np.float32), (1, 16))]


def test_input_specs_of_a_model(tmp_path):
    specs = input_specs(ir.load(mlp_model(tmp_path / "m.onnx")))
    assert specs == SPECS


def test_batch_layout_cuts_batches_with_a_short_last_one(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((10, 16), np.float32), labels=np.arange(10), _meta=np.array(1))
    data = NpzData(tmp_path / "d.npz", SPECS)
    batches = list(data.batches(4))
    assert [b.size for b in batches] == [4, 4, 2]
    assert batches[-1].labels.tolist() == [8, 9]
    assert data.num_samples == 10 and data.count_batches(4) == 3


def test_feed_layout_concatenates_along_dynamic_batch(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((6, 2, 16), np.float64))  # 6 feeds of batch 2, cast to float32
    data = NpzData(tmp_path / "d.npz", SPECS)
    batches = list(data.batches(4))
    assert [b.feed["x"].shape for b in batches] == [(8, 16), (4, 16)]
    assert data.count_batches(4) == 2
    assert batches[0].feed["x"].dtype == np.float32


def test_feed_layout_with_an_empty_kv_axis_concatenates(tmp_path):
    """A prefill's feeds: every past KV cache has a 0-length sequence axis (what onnxruntime-genai's
    decoders take); they are ordinary data and batch like the rest."""
    specs = SPECS + [InputSpec("past", np.dtype(np.float32), (None, 3, None, 64))]
    np.savez(tmp_path / "d.npz", x=np.ones((5, 1, 16), np.float32), past=np.zeros((5, 1, 3, 0, 64), np.float32))
    batches = list(NpzData(tmp_path / "d.npz", specs).batches(2))
    assert [b.feed["past"].shape for b in batches] == [(2, 3, 0, 64)] * 2 + [(1, 3, 0, 64)]
    assert [b.feed["x"].shape for b in batches] == [(2, 16)] * 2 + [(1, 16)]


def test_feed_layout_runs_one_by_one_with_fixed_batch(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((3, 1, 16), np.float32))
    data = NpzData(tmp_path / "d.npz", FIXED)
    batches = list(data.batches(8))
    assert [b.feed["x"].shape for b in batches] == [(1, 16)] * 3
    assert data.count_batches(8) == 3


def test_folder_read_in_name_order(tmp_path):
    np.savez(tmp_path / "b.npz", x=np.full((2, 16), 2, np.float32))
    np.savez(tmp_path / "a.npz", x=np.full((3, 16), 1, np.float32))
    (tmp_path / "notes.txt").write_text("ignored")
    batches = list(NpzData(tmp_path, SPECS).batches(8))
    assert [b.feed["x"][0, 0] for b in batches] == [1, 2]


def test_feed_iterable():
    feeds = [{"x": np.zeros((2, 16), np.float32), "labels": np.array([1, 2])}]
    (batch,) = list(FeedData(feeds, SPECS).batches(4))
    assert batch.labels.tolist() == [1, 2]
    with pytest.raises(Fp8OnnxError, match="feed #0 has no array for input 'x'"):
        list(FeedData([{"y": 1}], SPECS).batches(1))


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"y": np.zeros((2, 16), np.float32)}, "has no array for input 'x'; the model expects x float32 \\[\\?, 16\\]"),
        ({"x": np.zeros((2, 3, 4, 16), np.float32)}, "has rank 4; the model input is float32"),
        ({"x": np.zeros((2, 15), np.float32)}, "contradicts the model input float32 \\[\\?, 16\\] at axis 1"),
        ({"x": np.zeros((0, 16), np.float32)}, "'x' .* is empty"),
        ({"x": np.zeros((2, 16), np.complex64)}, "has dtype complex64"),
        ({"x": np.full((2, 16), np.nan, np.float32)}, "contains NaN or Inf"),
        ({"x": np.zeros((2, 16), np.float32), "labels": np.zeros(3)}, "different sample counts"),
    ],
)
def test_bad_data_is_refused_with_one_sentence(tmp_path, arrays, message):
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(Fp8OnnxError, match=message):
        list(NpzData(tmp_path / "d.npz", SPECS).batches(4))


def test_pickled_objects_are_refused_without_unpickling(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(Fp8OnnxError, match="holds Python objects; refused"):
        NpzData(tmp_path / "d.npz", SPECS)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(Fp8OnnxError, match="does not exist"):
        NpzData(tmp_path / "nope.npz", SPECS)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(Fp8OnnxError, match=r"is not an npz \(zip\) file"):
        NpzData(tmp_path / "bad.npz", SPECS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Fp8OnnxError, match=r"contains no \.npz file"):
        NpzData(tmp_path / "empty", SPECS)


@pytest.mark.parametrize("spelling", ["dim_param", "unknown", "-1", "0"])
def test_dynamic_dims_however_spelled(tmp_path, spelling):
    """paddle2onnx writes dim_value -1 for a dynamic axis; 0, empty and named dims are dynamic too."""
    from onnx import TensorProto, helper, numpy_helper

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])
    dim = value.type.tensor_type.shape.dim[0]
    if spelling == "unknown":
        dim.Clear()
    elif spelling != "dim_param":
        dim.dim_value = int(spelling)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [value],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((16, 4), np.float32), "w")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert input_specs(model) == SPECS
    np.savez(tmp_path / "d.npz", x=np.ones((5, 16), np.float32))
    assert [b.size for b in NpzData(tmp_path / "d.npz", input_specs(model)).batches(4)] == [4, 1]


def test_feeds_from_a_generator_serve_a_recipe_that_reads_them_twice(tmp_path):
    """Data is converted once at quantize's entry; feeds given as a generator (read once by nature)
    are kept for a recipe that reads them twice (activation statistics, then GPTQ's X^T X): the
    model is byte-identical to the one made from a list. Before, GPTQ found no batch left."""
    import fp8onnx

    from helpers import SAMPLE

    ids = np.load(SAMPLE / "calib.npz")["input_ids"]
    feeds = [{"input_ids": ids[i : i + 16]} for i in range(0, 64, 16)]
    options = {"preset": "none", "weight_rounding": "gptq", "provider": "cpu"}
    listed = fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "list.onnx", feeds, **options)
    fp8onnx.quantize(SAMPLE / "decoder.onnx", tmp_path / "gen.onnx", (f for f in feeds), **options)
    assert listed.calibration["samples"] == 64
    assert (tmp_path / "gen.onnx").read_bytes() == (tmp_path / "list.onnx").read_bytes()
