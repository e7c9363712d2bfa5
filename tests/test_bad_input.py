"""Every way of giving fp8onnx bad input that we know of, as one table: each must exit with code 2
and one line that says what is wrong and where - never a traceback, never a partial output file.
docs/graphs.md ("Bad input") counts the rows of CASES."""

import json
import os

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.cli import main

from helpers import mlp_data, mlp_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every artifact the cases below refer to, built once."""
    t = tmp_path_factory.mktemp("bad")
    m = mlp_model(t / "m.onnx")
    mlp_data(t / "d.npz")
    raw = m.read_bytes()
    (t / "folder.onnx").mkdir()
    (t / "text.onnx").write_text("this is not a model")
    (t / "half.onnx").write_bytes(raw[: len(raw) // 2])
    broken = onnx.load(m)
    broken.graph.node[0].input[0] = "nowhere"
    onnx.save(broken, t / "unchecked.onnx")
    nan = onnx.load(m)
    w1 = numpy_helper.to_array(nan.graph.initializer[0]).copy()
    w1[0, 0] = np.nan
    nan.graph.initializer[0].CopyFrom(numpy_helper.from_array(w1, "w1"))
    onnx.save(nan, t / "nan_weight.onnx")
    utf8 = raw.replace(b"fc1", b"f\xc9\x01", 1)
    (t / "utf8.onnx").write_bytes(utf8)
    # external data: one good copy in ext/, then models pointing elsewhere
    (t / "ext").mkdir()
    onnx.save(onnx.load(m), t / "ext" / "m.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    (t / "outside.data").write_bytes((t / "ext" / "w.data").read_bytes())
    os.symlink(t / "outside.data", t / "ext" / "link.data")
    (t / "ext" / "short.data").write_bytes(b"\0" * 8)
    for name, location in [
        ("missing", "gone.data"),
        ("dotdot", "../outside.data"),
        ("absolute", "/etc/passwd"),
        ("symlink", "link.data"),
        ("truncated", "short.data"),
    ]:
        proto = onnx.load(t / "ext" / "m.onnx", load_external_data=False)
        for init in proto.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(proto, t / "ext" / f"{name}.onnx")
    huge = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "huge",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 200_000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 200_000])],
    )
    weight = onnx.TensorProto(
        name="w", data_type=TensorProto.FLOAT, dims=[200_000, 200_000], data_location=TensorProto.EXTERNAL
    )
    weight.external_data.add(key="location", value="huge.data")
    huge.initializer.append(weight)
    onnx.save(helper.make_model(huge, opset_imports=[helper.make_opsetid("", 21)]), t / "ext" / "huge.onnx")
    with open(t / "ext" / "huge.data", "wb") as fh:
        fh.truncate(200_000 * 200_000 * 4)
    # a model quantized to INT8 already (onnxruntime.quantization's dynamic recipe), and one that
    # onnxruntime cannot load (an op of a domain it does not know, after the MatMul)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(m), str(t / "int8.onnx"), weight_type=QuantType.QInt8)
    custom = onnx.load(m)
    custom.graph.node.append(helper.make_node("Foo", ["y"], ["z"], domain="com.example", name="foo"))
    custom.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 8]))
    custom.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(custom, t / "custom_op.onnx")
    # data
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    (t / "empty_dir").mkdir()
    (t / "zip.npz").write_bytes(b"PK not really")
    np.savez(t / "wrong_key.npz", y=x)
    np.savez(t / "complex.npz", x=x.astype(np.complex64))
    np.savez(t / "rank.npz", x=x[:, :, None, None])
    np.savez(t / "dims.npz", x=x[:, :15])
    np.savez(t / "empty.npz", x=x[:0])
    np.savez(t / "counts.npz", x=x, labels=np.zeros(3))
    np.savez(t / "nan.npz", x=np.where(x > 1, np.nan, x))
    np.savez(t / "pickle.npz", x=np.array([{"a": 1}, None], dtype=object))
    np.savez(t / "labels.npz", x=x, labels=np.zeros((8, 3)))
    two = helper.make_graph(
        [
            helper.make_node("MatMul", ["a", "w"], ["p"], name="a"),
            helper.make_node("MatMul", ["b", "w"], ["q"], name="b"),
        ],
        "two",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 16]) for n in "ab"],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 4]) for n in "pq"],
        [numpy_helper.from_array(x[:, :4].T.copy().T[:16] if False else np.ones((16, 4), np.float32), "w")],
    )
    onnx.save(helper.make_model(two, opset_imports=[helper.make_opsetid("", 21)]), t / "two.onnx")
    np.savez(t / "mixed.npz", a=x, b=x[None])
    other = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="mm")],
        "other",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 4])],
        [numpy_helper.from_array(np.ones((16, 4), np.float32), "w")],
    )
    onnx.save(helper.make_model(other, opset_imports=[helper.make_opsetid("", 21)]), t / "other.onnx")
    # hostile or corrupt data files
    np.save(t / "plain.npy", x)
    np.savez(t / "good.npz", x=x)
    raw_npz = bytearray((t / "good.npz").read_bytes())
    raw_npz[raw_npz.find(b"\x93NUMPY") + 200] ^= 0xFF
    (t / "crc.npz").write_bytes(bytes(raw_npz))
    np.savez_compressed(t / "deflate.npz", x=x)
    raw_npz = bytearray((t / "deflate.npz").read_bytes())
    raw_npz[120:124] = b"\xff\x00\x1b\x07"
    (t / "deflate.npz").write_bytes(bytes(raw_npz))
    (t / "huge_header.npz").write_bytes(_with_header(x, "(8000000000000, 2000)"))
    import gzip

    (t / "gzip.npz").write_bytes(gzip.compress(b"x" * 100))
    (t / "text.npz").write_text("x,y\n1,2\n")
    whole = (t / "good.npz").read_bytes()
    (t / "cut.npz").write_bytes(whole[: len(whole) // 2])
    np.savez(t / "int_for_float.npz", x=np.full((8, 16), 2**24 + 1, np.int64))
    os.mkfifo(t / "fifo.npz")
    os.mkfifo(t / "ext" / "fifo.data")
    proto = onnx.load(t / "ext" / "m.onnx", load_external_data=False)
    for init in proto.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = "fifo.data"
    onnx.save(proto, t / "ext" / "fifo.onnx")
    ids = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
            helper.make_node("MatMul", ["e", "w"], ["y"], name="mm"),
        ],
        "ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT32, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, 4])],
        [
            numpy_helper.from_array(np.ones((10, 4), np.float32), "table"),
            numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
        ],
    )
    onnx.save(helper.make_model(ids, opset_imports=[helper.make_opsetid("", 21)]), t / "ids.onnx")
    np.savez(t / "ids_wrap.npz", ids=np.full((2, 4), 2**32 + 3, np.int64))
    dup = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="first"), helper.make_node("Neg", ["x"], ["y"], name="second")],
        "dup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])],
    )
    onnx.save(helper.make_model(dup, opset_imports=[helper.make_opsetid("", 21)]), t / "dup.onnx")
    os.mkfifo(t / "fifo.onnx")
    # statistics
    good = {"fp8onnx_stats_version": 2, "num_batches": 1, "num_samples": 8, "amax": {"x": 1.0, "r": 1.0}}
    for name, change in [
        ("stats_float_batches", {"num_batches": 1.5}),
        ("stats_list_amax", {"amax": [1.0, 2.0]}),
        ("stats_negative", {"amax": {"x": -1.0, "r": 1.0}}),
        ("stats_nan", {"amax": {"x": float("nan"), "r": 1.0}}),
        ("stats_stranger", {"amax": {"x": 1.0, "r": 1.0, "elsewhere": 2.0}}),
        ("stats_bad_hist", {"histograms": {"x": {"zeros": 0, "bins": [1, 2], "counts": [3]}}}),
    ]:
        (t / f"{name}.json").write_text(json.dumps({**good, **change}))
    (t / "stats_deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (t / "stats_bad.json").write_text("{")
    (t / "stats_partial.json").write_text(json.dumps({"fp8onnx_stats_version": 2, "amax": {"x": 1.0}}))
    (t / "stats_nohist.json").write_text(json.dumps({"fp8onnx_stats_version": 2, "amax": {"x": 1.0, "r": 1.0}}))
    return t


def _with_header(x, shape: str) -> bytes:
    """An npz whose only member declares ``shape`` in its header but holds ``x``'s bytes."""
    import io
    import zipfile

    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (118 - len(header)) + "\n"
    member = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + x.tobytes()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.npy", member)
    return buf.getvalue()


Q = ["quantize", "{t}/m.onnx", "-o", "{t}/q.onnx"]
QC = Q + ["--calib", "{t}/d.npz"]
CASES = [
    # the model file
    (
        "model missing",
        ["quantize", "{t}/none.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "none.onnx' does not exist",
    ),
    (
        "model is a folder",
        ["quantize", "{t}/folder.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "folder.onnx' has no model.onnx",
    ),
    (
        "model not ONNX",
        ["quantize", "{t}/text.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "is not a readable ONNX model",
    ),
    ("model truncated", ["quantize", "{t}/half.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"], "half.onnx'"),
    (
        "model quantized to INT8 already",
        ["quantize", "{t}/int8.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "is quantized to integers already (2 DynamicQuantizeLinear, 2 MatMulInteger)",
    ),
    (
        "model onnxruntime cannot load",  # the input's problem, said as the input's, not the output's
        ["quantize", "{t}/custom_op.onnx", "-o", "{t}/q.onnx", "--activations", "none", "--preset", "none"],
        "custom_op.onnx' does not load in onnxruntime (cpu)",
    ),
    (
        "model fails onnx.checker",
        ["quantize", "{t}/unchecked.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "fails onnx.checker",
    ),
    (
        "weight with NaN",
        ["quantize", "{t}/nan_weight.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "Weight 'w1' contains NaN or Inf",
    ),
    ("name not UTF-8", ["quantize", "{t}/utf8.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"], "not valid UTF-8"),
    (
        "external data missing",
        ["quantize", "{t}/ext/missing.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "'gone.data', which is missing",
    ),
    (
        "external data ../",
        ["quantize", "{t}/ext/dotdot.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "outside the model's folder; refused",
    ),
    (
        "external data absolute",
        ["quantize", "{t}/ext/absolute.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "absolute external-data path",
    ),
    (
        "external data symlink out",
        ["quantize", "{t}/ext/symlink.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "outside the model's folder; refused",
    ),
    (
        "external data truncated",
        ["quantize", "{t}/ext/truncated.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "(truncated?)",
    ),
    (
        "weights beyond memory",
        ["quantize", "{t}/ext/huge.onnx", "-o", "{t}/q.onnx", "--activations", "dynamic"],
        "GiB of memory",
    ),
    # calibration and evaluation data
    ("data missing", Q + ["--calib", "{t}/none.npz"], "none.npz' does not exist"),
    ("data folder without npz", Q + ["--calib", "{t}/empty_dir"], "contains no .npz file"),
    ("data not npz", Q + ["--calib", "{t}/zip.npz"], "is not an npz (zip) file"),
    (
        "data wrong key",
        Q + ["--calib", "{t}/wrong_key.npz"],
        "has no array for input 'x'; the model expects x float32 [?, 16]",
    ),
    ("data wrong dtype", Q + ["--calib", "{t}/complex.npz"], "has dtype complex64"),
    ("data wrong rank", Q + ["--calib", "{t}/rank.npz"], "has rank 4"),
    (
        "data contradicts fixed dims",
        Q + ["--calib", "{t}/dims.npz"],
        "contradicts the model input float32 [?, 16] at axis 1",
    ),
    ("data empty", Q + ["--calib", "{t}/empty.npz"], "is empty"),
    ("data counts disagree", Q + ["--calib", "{t}/counts.npz"], "different sample counts"),
    ("data NaN", Q + ["--calib", "{t}/nan.npz"], "contains NaN or Inf"),
    ("data pickled objects", Q + ["--calib", "{t}/pickle.npz"], "holds Python objects; refused"),
    (
        "data mixed layouts",
        ["quantize", "{t}/two.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/mixed.npz"],
        "mixes layouts",
    ),
    (
        "labels match no output",
        ["compare", "{t}/m.onnx", "--data", "{t}/labels.npz"],
        "'labels' of shape (8, 3) match no output",
    ),
    (
        "data: plain .npy for a two-input model",
        ["quantize", "{t}/two.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/plain.npy"],
        "is a plain .npy (one array); the model has 2 inputs",
    ),
    ("data: bad CRC", Q + ["--calib", "{t}/crc.npz"], "Bad CRC-32 for file 'x.npy'); is the file corrupt?"),
    ("data: corrupt deflate stream", Q + ["--calib", "{t}/deflate.npz"], "cannot be read"),
    ("data: header declares 64 EB", Q + ["--calib", "{t}/huge_header.npz"], "but holds only 512 bytes"),
    ("data: gzip named .npz", Q + ["--calib", "{t}/gzip.npz"], "is not an npz (zip) file"),
    ("data: text named .npz", Q + ["--calib", "{t}/text.npz"], "is not an npz (zip) file"),
    ("data: npz cut in half", Q + ["--calib", "{t}/cut.npz"], "is not an npz (zip) file, or it is truncated"),
    ("data: a FIFO", Q + ["--calib", "{t}/fifo.npz"], "is not a regular file or folder"),
    (
        "data: int64 ids wrap in int32",
        ["quantize", "{t}/ids.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/ids_wrap.npz"],
        "value 4294967299 is not representable there",
    ),
    (
        "data: integers inexact in float32",
        Q + ["--calib", "{t}/int_for_float.npz"],
        "value 16777217 is not representable there",
    ),
    (
        "external data is a FIFO",
        ["quantize", "{t}/ext/fifo.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "'fifo.data', which is not a regular file",
    ),
    (
        "model is a FIFO",
        ["quantize", "{t}/fifo.onnx", "-o", "{t}/q.onnx", "--calib", "{t}/d.npz"],
        "is not a regular file",
    ),
    (
        "two nodes write one tensor",
        ["quantize", "{t}/dup.onnx", "-o", "{t}/q.onnx", "--activations", "dynamic"],
        "tensor 'y' is written by node 'first' (Relu) and by node 'second' (Neg)",
    ),
    (
        "stats: num_batches not an integer",
        Q + ["--stats", "{t}/stats_float_batches.json"],
        "num_batches must be a non-negative integer, got 1.5",
    ),
    (
        "stats: list for a mapping",
        Q + ["--stats", "{t}/stats_list_amax.json"],
        "amax must be a mapping of tensor name to value, got list",
    ),
    (
        "stats: negative amax",
        Q + ["--stats", "{t}/stats_negative.json"],
        "amax['x'] must be a finite non-negative number, got -1.0",
    ),
    (
        "stats: NaN amax",
        Q + ["--stats", "{t}/stats_nan.json"],
        "amax['x'] must be a finite non-negative number, got nan",
    ),
    (
        "stats: unknown tensor",
        Q + ["--stats", "{t}/stats_stranger.json"],
        "entry for tensor 'elsewhere', which this model does not have",
    ),
    (
        "stats: malformed histogram",
        Q + ["--stats", "{t}/stats_bad_hist.json"],
        "histograms['x']['counts'] must be as long as",
    ),
    ("stats: nested 100,000 deep", Q + ["--stats", "{t}/stats_deep.json"], "is not readable JSON (nested too deeply)"),
    # output paths
    (
        "output is the input",
        ["quantize", "{t}/m.onnx", "-o", "{t}/m.onnx", "--calib", "{t}/d.npz"],
        "would overwrite the input model",
    ),
    (
        "output folder missing",
        ["quantize", "{t}/m.onnx", "-o", "{t}/nowhere/q.onnx", "--calib", "{t}/d.npz"],
        "does not exist",
    ),
    (
        "output is a folder",
        ["quantize", "{t}/m.onnx", "-o", "{t}/empty_dir", "--calib", "{t}/d.npz"],
        "empty_dir' is a directory",
    ),
    (
        "stats output is the input",
        ["calibrate", "{t}/m.onnx", "--calib", "{t}/d.npz", "-o", "{t}/m.onnx"],
        "would overwrite the input model",
    ),
    # options
    ("unknown format", QC + ["--format", "e3m5"], "Invalid value for '--format'"),
    ("unknown scaling", QC + ["--scaling", "mean"], "Invalid value for '--scaling'"),
    ("unknown provider", QC + ["--provider", "rocm"], "Invalid value for '--provider'"),
    ("batch size 0", QC + ["--batch-size", "0"], "Invalid value for '--batch-size'"),
    ("weight memory 0", QC + ["--weight-memory", "0"], "Invalid value for '--weight-memory'"),
    ("negative constant scale", Q + ["--scaling", "constant", "--scale", "-1"], "needs a positive finite --scale"),
    ("scale without constant", QC + ["--scale", "0.1"], "--scale only applies to --scaling constant"),
    ("margin without pow2", QC + ["--margin", "2"], "--margin only applies to --scaling pow2"),
    ("percentile without percentile scaling", QC + ["--percentile", "99"], "--percentile only applies"),
    (
        "percentile out of range",
        QC + ["--scaling", "percentile", "--percentile", "0"],
        "--percentile must be in (0, 100]",
    ),
    ("dynamic with calibration", QC + ["--activations", "dynamic"], "needs no calibration"),
    ("dynamic with mse", Q + ["--activations", "dynamic", "--scaling", "mse"], "--scaling mse needs calibration"),
    (
        "constant with per-channel",
        Q + ["--scaling", "constant", "--scale", "1", "--per-channel"],
        "contradicts --per-channel",
    ),
    (
        "constant with dynamic",
        Q + ["--scaling", "constant", "--scale", "1", "--activations", "dynamic"],
        "contradicts --activations dynamic",
    ),
    ("calib and stats", QC + ["--stats", "{t}/stats_bad.json"], "either --calib or --stats"),
    ("accuracy target without eval", QC + ["--accuracy-target", "99"], "--accuracy-target and --eval go together"),
    ("max float nodes without target", QC + ["--max-float-nodes", "3"], "--max-float-nodes and --refine only apply"),
    ("refine without target", QC + ["--refine", "3"], "--max-float-nodes and --refine only apply"),
    ("no calibration", Q, "Activation scales need calibration"),
    ("unsupported op type", QC + ["--op-types", "Attention"], "Unsupported op type 'Attention'"),
    ("cuda without a GPU", QC + ["--provider", "cuda"], "cannot start its CUDA EP here"),
    # statistics files
    ("stats missing", Q + ["--stats", "{t}/none.json"], "none.json' does not exist"),
    ("stats not JSON", Q + ["--stats", "{t}/stats_bad.json"], "is not readable JSON"),
    ("stats lack a tensor", Q + ["--stats", "{t}/stats_partial.json"], "have no entry for tensor 'r'"),
    (
        "stats lack histograms",
        Q + ["--stats", "{t}/stats_nohist.json", "--scaling", "mse"],
        "have no histogram for tensor 'x'",
    ),
    # compare and study
    (
        "candidate missing",
        ["compare", "{t}/m.onnx", "{t}/none.onnx", "--data", "{t}/d.npz"],
        "none.onnx' does not exist",
    ),
    (
        "candidate with other outputs",
        ["compare", "{t}/m.onnx", "{t}/other.onnx", "--data", "{t}/d.npz"],
        "has outputs ['logits']",
    ),
    (
        "study plot folder's parent missing",  # a missing folder whose parent exists is made
        ["study", "{t}/m.onnx", "--calib", "{t}/d.npz", "--data", "{t}/d.npz", "--plot", "{t}/nowhere/plots"],
        "Plot folder",
    ),
]


@pytest.mark.parametrize("name, args, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(files, name, args, message):
    if name == "cuda without a GPU":
        from fp8onnx.graph.providers import cuda_unavailable

        if cuda_unavailable() is None:
            pytest.skip("this machine starts the CUDA EP")
    r = CliRunner().invoke(main, [a.format(t=files) for a in args])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], r.output
    assert not (files / "q.onnx").exists()


def test_the_table_is_large_and_distinct():
    assert len({c[0] for c in CASES}) == len(CASES) >= 50
