"""Model files from strangers, and writes that must be all or nothing."""

import errno
import os
import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph.model_io import load_model

from helpers import mlp_data, mlp_model, run_ort


def external_model(tmp_path, location="w.data"):
    """The MLP with its weights in an external data file, then pointed at ``location``."""
    path = mlp_model(tmp_path / "src.onnx")
    model = onnx.load(path)
    (tmp_path / "m").mkdir(exist_ok=True)
    onnx.save(model, tmp_path / "m" / "m.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    model = onnx.load(tmp_path / "m" / "m.onnx", load_external_data=False)
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, tmp_path / "m" / "m.onnx")
    return tmp_path / "m" / "m.onnx"


def test_external_data_model_quantizes(tmp_path):
    path = external_model(tmp_path)
    data = mlp_data(tmp_path / "d.npz")
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")
    assert len(report.quantized) == 2
    assert (tmp_path / "q.onnx.data").exists()  # weights that came in a side file go out in one
    result = fp8onnx.compare(path, [tmp_path / "q.onnx"], data, provider="cpu")
    assert result.rows[-1].outputs["y"]["cosine_mean"] > 0.99
    x = np.ones((2, 16), np.float32)
    ref = run_ort(onnx.load(tmp_path / "src.onnx"), {"x": x})[0]
    assert np.allclose(run_ort(onnx.load(tmp_path / "q.onnx"), {"x": x})[0], ref, rtol=0.2, atol=0.2)


@pytest.mark.parametrize(
    "location, message",
    [
        ("../outside.data", "outside the model's folder; refused"),
        ("/etc/passwd", "absolute external-data path '/etc/passwd'; refused"),
        ("sub/../../outside.data", "outside the model's folder; refused"),
        ("link.data", "outside the model's folder; refused"),  # a symlink pointing out
        ("missing.data", "needs external data file 'missing.data', which is missing"),
        ("short.data", "(truncated?)"),
    ],
)
def test_untrusted_external_data_is_refused_before_reading(tmp_path, location, message):
    path = external_model(tmp_path, location)
    (tmp_path / "outside.data").write_bytes((tmp_path / "m" / "w.data").read_bytes())
    os.symlink(tmp_path / "outside.data", tmp_path / "m" / "link.data")
    (tmp_path / "m" / "short.data").write_bytes(b"\0" * 10)
    with pytest.raises(Fp8OnnxError, match=re.escape(message)):
        load_model(path)


def test_failed_write_keeps_the_previous_output_and_leaves_no_partial_file(tmp_path, monkeypatch):
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    out = tmp_path / "q.onnx"
    out.write_bytes(b"previous output")
    real_fsync = os.fsync

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(Fp8OnnxError, match="No space left on device; the previous file, if any, is untouched"):
        fp8onnx.quantize(path, out, data, provider="cpu")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert out.read_bytes() == b"previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "m.onnx", "q.onnx"]


def test_an_invalid_result_is_never_written(tmp_path, monkeypatch):
    from fp8onnx.workflows import rewrite as q

    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")

    class Broken(q.InsertQDQPass):
        def call(self, model):
            result = super().call(model)
            next(iter(model.graph)).op_type = "NoSuchOp"  # what a buggy rewrite could leave behind
            return result

    monkeypatch.setattr(q, "InsertQDQPass", Broken)
    with pytest.raises(Fp8OnnxError, match=r"fails onnx\.checker|does not load in onnxruntime"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")
    assert not (tmp_path / "q.onnx").exists()


def test_a_model_only_onnxruntime_refuses_is_never_written(tmp_path):
    from fp8onnx.graph.model_io import write_bytes_atomic

    out = tmp_path / "q.onnx"
    out.write_bytes(b"previous output")

    def refuses():
        raise Fp8OnnxError("The output model does not load in onnxruntime (cpu): no kernel.")

    with pytest.raises(Fp8OnnxError, match="does not load in onnxruntime"):
        write_bytes_atomic(out, b"new model", check=refuses)
    assert out.read_bytes() == b"previous output"
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx"]  # no temporary file left
    ran = []
    write_bytes_atomic(out, b"new model", check=lambda: ran.append(out.read_bytes()))
    assert out.read_bytes() == b"new model" and ran == [b"previous output"]  # checked before the rename


def test_declared_sizes_beyond_the_machine_are_refused_not_oom_killed(tmp_path):
    # A 160 GB tensor backed by a sparse file: the containment and size checks pass, memory cannot.
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "huge",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 200_000])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 200_000])],
    )
    weight = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[200_000, 200_000])
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "w.data"), ("offset", "0"), ("length", str(200_000 * 200_000 * 4))):
        weight.external_data.add(key=key, value=value)
    graph.initializer.append(weight)
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    with open(tmp_path / "w.data", "wb") as fh:
        fh.truncate(200_000 * 200_000 * 4)
    with pytest.raises(Fp8OnnxError, match=r"declares 149\.0 GiB of weights; this machine has .* GiB of memory"):
        load_model(tmp_path / "m.onnx")


def test_unwritable_output_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    # As root every folder is writable, so the permission answer is simulated.
    path, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.W_OK else real_access(p, mode))
    with pytest.raises(Fp8OnnxError, match="is not writable"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", data, provider="cpu")


def test_large_model_paths_write_external_data(tmp_path, monkeypatch):
    # The >2 GB code path, exercised on a small model by lowering its threshold.
    import fp8onnx.graph.model_io as model_io

    monkeypatch.setattr(model_io, "EXTERNAL_DATA_THRESHOLD", 0)
    path = external_model(tmp_path)
    data = mlp_data(tmp_path / "d.npz")
    out = tmp_path / "q.onnx"
    out.write_bytes(b"old")
    report = fp8onnx.quantize(path, out, data, provider="cpu")
    assert len(report.quantized) == 2
    assert (tmp_path / "q.onnx.data").exists() and report.output_bytes > (tmp_path / "q.onnx").stat().st_size
    q = onnx.load(out)  # loads its external data from beside it
    assert any(i.data_type == onnx.TensorProto.FLOAT8E4M3FN for i in q.graph.initializer)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp files left
    x = np.ones((2, 16), np.float32)
    ref = run_ort(onnx.load(tmp_path / "src.onnx"), {"x": x})[0]
    np.testing.assert_allclose(run_ort(out, {"x": x})[0], ref, rtol=0.2, atol=0.2)


def test_sizes_count_every_external_data_file_of_an_export_folder(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    onnx.save(
        onnx.load(mlp_model(tmp_path / "m.onnx")),
        folder / "model.onnx",
        save_as_external_data=True,
        location="model.onnx_data",  # Optimum's name, not <name>.data
        size_threshold=0,
    )
    report = fp8onnx.quantize(folder, tmp_path / "q.onnx", mlp_data(tmp_path / "d.npz"), provider="cpu")
    expected = (folder / "model.onnx").stat().st_size + (folder / "model.onnx_data").stat().st_size
    written = sum(f.stat().st_size for f in (tmp_path / "q.onnx", tmp_path / "q.onnx.data"))  # external in, out
    assert report.input_bytes == expected and report.output_bytes == written


@pytest.mark.parametrize("external", [False, True])
def test_outputs_get_the_permissions_of_any_new_file(tmp_path, monkeypatch, external):
    """A model written through a temporary file keeps umask permissions, not mkstemp's 0600: a
    service account that runs the model must be able to read it."""
    import fp8onnx.graph.model_io as model_io

    if external:
        monkeypatch.setattr(model_io, "EXTERNAL_DATA_THRESHOLD", 0)
    old = os.umask(0o022)
    try:
        out = tmp_path / "q.onnx"
        fp8onnx.quantize(mlp_model(tmp_path / "m.onnx"), out, mlp_data(tmp_path / "d.npz"), provider="cpu")
        os.umask(0o027)
        fp8onnx.convert_fp16(tmp_path / "m.onnx", tmp_path / "h.onnx")
    finally:
        os.umask(old)
    written = [out, tmp_path / "q.onnx.data"] if external else [out]
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o644)}
    assert oct((tmp_path / "h.onnx").stat().st_mode & 0o777) == oct(0o640)


def test_a_model_larger_than_memory_is_quantized_layer_by_layer(tmp_path, monkeypatch):
    """Weights over this machine's memory as a whole, but every tensor within it: refused only by a
    session that would load it whole (one sentence), quantized layer by layer."""
    from fp8onnx.graph import model_io, runtime

    path, data = mlp_model(tmp_path / "m.onnx", hidden=512), mlp_data(tmp_path / "d.npz")
    for module in (runtime, model_io):
        monkeypatch.setattr(module, "machine_memory", lambda: 40_000)  # the weights: 32 + 16 KiB
    report = fp8onnx.quantize(path, tmp_path / "q.onnx", data, preset="none", weight_memory=33_000)
    assert report.modified
    with pytest.raises(
        Fp8OnnxError, match=r"^The FP32 model holds 0\.0 GiB of weights; this machine has .* too little for"
    ):
        runtime.session_for_model(ir.load(path), "cpu", "the FP32 model")
