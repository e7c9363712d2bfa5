"""Single-file models: their embedded weights are moved to a side file before parsing, streamed, so
loading holds neither the file's bytes nor a second parsed copy."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import fp8onnx
from fp8onnx.graph import embedded

from helpers import mlp_data, mlp_model


def _without_initializers(proto: onnx.ModelProto) -> bytes:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    del copy.graph.initializer[:]
    return copy.SerializeToString()


def test_the_copy_has_the_same_graph_and_tensors(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "MIN_TENSOR", 64)
    path = mlp_model(tmp_path / "m.onnx")
    proto = onnx.load(path)
    # a tensor kept in float_data (not raw_data), and metadata: both stay as they are
    proto.graph.initializer.append(numpy_helper.from_array(np.arange(40, dtype=np.float32), "unused"))
    proto.graph.initializer[-1].float_data[:] = np.arange(40, dtype=np.float32).tolist()
    proto.graph.initializer[-1].ClearField("raw_data")
    onnx.helper.set_model_props(proto, {"author": "test"})
    onnx.save(proto, path)
    (tmp_path / "out").mkdir()
    copy = embedded.externalize(path, tmp_path / "out")
    assert (tmp_path / "out" / "m.onnx.data").stat().st_size > 0
    loaded = onnx.load(copy)
    assert _without_initializers(loaded) == _without_initializers(proto)
    moved = {
        t.name
        for t in onnx.load(copy, load_external_data=False).graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    assert moved == {"w1", "w2"}  # b2 (32 bytes) and the float_data tensor stay inside
    for a, b in zip(proto.graph.initializer, loaded.graph.initializer, strict=True):
        assert a.name == b.name and np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))


def test_a_model_with_external_data_is_loaded_as_it_is(tmp_path):
    path = mlp_model(tmp_path / "m.onnx")
    proto = onnx.load(path)
    onnx.save(proto, tmp_path / "ext.onnx", save_as_external_data=True, size_threshold=0, location="ext.data")
    (tmp_path / "out").mkdir()
    assert embedded.externalize(tmp_path / "ext.onnx", tmp_path / "out") is None
    assert list((tmp_path / "out").iterdir()) == []


def test_quantizing_an_externalized_model_gives_the_same_bytes(tmp_path, monkeypatch):
    path, data = mlp_model(tmp_path / "m.onnx", hidden=512), mlp_data(tmp_path / "c.npz")
    fp8onnx.quantize(path, tmp_path / "whole.onnx", data, preset="none")
    monkeypatch.setattr(embedded, "EMBEDDED_BYTES", 0)
    report = fp8onnx.quantize(path, tmp_path / "moved.onnx", data, preset="none")
    assert (tmp_path / "whole.onnx").read_bytes() == (tmp_path / "moved.onnx").read_bytes()
    assert not (tmp_path / "moved.onnx.data").exists()  # a single file in, a single file out
    assert report.model == str(path)


def test_no_room_for_the_side_file_is_a_warning_and_the_same_output(tmp_path, monkeypatch, caplog):
    """Where the weights cannot be moved out (a full TMPDIR), the model is loaded whole: the same
    output, and one warning saying what it costs and what to do."""
    path, data = mlp_model(tmp_path / "m.onnx", hidden=512), mlp_data(tmp_path / "c.npz")
    fp8onnx.quantize(path, tmp_path / "whole.onnx", data, preset="none")

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(embedded, "EMBEDDED_BYTES", 0)
    monkeypatch.setattr(embedded, "externalize", full)
    with caplog.at_level("WARNING", logger="fp8onnx"):
        fp8onnx.quantize(path, tmp_path / "full.onnx", data, preset="none")
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "No space left on device" in said[0] and "TMPDIR" in said[0]
    assert (tmp_path / "whole.onnx").read_bytes() == (tmp_path / "full.onnx").read_bytes()


def test_a_truncated_file_is_refused_in_one_sentence(tmp_path, monkeypatch):
    path = mlp_model(tmp_path / "m.onnx", hidden=512)
    path.write_bytes(path.read_bytes()[:-100])
    monkeypatch.setattr(embedded, "EMBEDDED_BYTES", 0)
    with pytest.raises(fp8onnx.Fp8OnnxError, match="is not a readable ONNX model"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="dynamic")


def test_protobuf_varints_round_trip():
    import io

    for n in (0, 1, 127, 128, 300, 2**31, 2**63 - 1):
        assert embedded._read_varint(io.BufferedReader(io.BytesIO(embedded._varint(n)))) == n
