"""Where onnxruntime runs each node, predicted (fp8onnx.graph.placement, ``inspect --target``): on the CPU
EP against real sessions (tests/wild/test_wild_placement.py does the same on the whole exporter corpus)."""

import json
import logging
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.cli import main
from fp8onnx.graph import kernels
from fp8onnx.graph.model_io import load_model
from fp8onnx.graph.placement import infer_types, predict_placement

from helpers import SAMPLE


@pytest.fixture(scope="module")
def forms(tmp_path_factory):  # the sample decoder (a TorchScript export) in three FP8 forms
    tmp = tmp_path_factory.mktemp("forms")
    calib = SAMPLE / "calib.npz"
    paths = {"qdq": tmp / "qdq.onnx", "fast": tmp / "fast.onnx", "blocked": tmp / "blocked.onnx"}
    fp8onnx.quantize(SAMPLE / "decoder.onnx", paths["qdq"], calib, provider="cpu")
    fp8onnx.quantize(SAMPLE / "decoder.onnx", paths["fast"], calib, target="onnxruntime-cuda", provider="cpu")
    fp8onnx.quantize(SAMPLE / "decoder.onnx", paths["blocked"], calib, weight_block_size=32, provider="cpu")
    return paths


def test_what_the_cpu_ep_runs_is_predicted(forms):
    for name in ("qdq", "blocked"):
        predicted = predict_placement(load_model(forms[name]), "cpu")
        assert {p.where for p in predicted} <= {"cpu", "initializer"}, name
        ort.InferenceSession(str(forms[name]), providers=["CPUExecutionProvider"])  # loads, as predicted
    fast = predict_placement(load_model(forms["fast"]), "cpu")
    failing = {p.node for p in fast if p.where == "fails at load"}
    written = {n.name for n in onnx.load(forms["fast"]).graph.node if n.op_type == "MatMulBlockQuantizedFp8Weight"}
    assert failing == written and len(written) == 29
    # onnxruntime 1.31 says it the other way: its float32 Cast in front of the op fails the op's type check
    refused = "Could not find an implementation for MatMulBlockQuantizedFp8Weight|of operator .MatMulBlockQuantizedFp8"
    with pytest.raises(Exception, match=refused):
        ort.InferenceSession(str(forms["fast"]), providers=["CPUExecutionProvider"])


def test_inspect_says_where_nodes_run(forms):
    result = CliRunner().invoke(main, ["inspect", str(forms["fast"]), "--target", "onnxruntime"])
    assert result.exit_code == 0, result.output
    assert "29 fails at load" in result.output and "MatMulBlockQuantizedFp8Weight: no kernel" in result.output
    # 8 attention MatMuls in float, and the default's 29 kept-channel products (--keep-channels 4)
    assert "29 of 66 MatMul/Gemm nodes read float8 inputs" in result.output
    assert "block 128 along K" in result.output or "one block over K" in result.output
    info = fp8onnx.inspect(forms["qdq"], target="onnxruntime")
    assert set(info["placement"]["counts"]) <= {"cpu", "initializer"}
    with pytest.raises(fp8onnx.Fp8OnnxError, match="inspect --target takes onnxruntime or onnxruntime-cuda"):
        fp8onnx.inspect(forms["qdq"], target="tensorrt")


def test_the_cuda_ep_runs_the_fast_form_and_refuses_blocked_float8_dq_at_run(forms):
    """From the CUDA EP's kernel table (read from onnxruntime's source): every node of the fast form on
    CUDA; the CPU EP's blocked Q/DQ form placed on CUDA, each blocked float8 DequantizeLinear failing at
    Run; the per-axis Q/DQ form (--target onnxruntime-cuda --gemm-op qdq) all on CUDA."""
    fast = predict_placement(load_model(forms["fast"]), "cuda")
    assert {p.where for p in fast} <= {"cuda", "initializer"}, [p for p in fast if p.where != "cuda"][:3]
    blocked = predict_placement(load_model(forms["blocked"]), "cuda")
    at_run = {p.node for p in blocked if p.where == "fails at run"}
    model = onnx.load(forms["blocked"])
    blocks = [n for n in model.graph.node if any(a.name == "block_size" for a in n.attribute)]
    dq = {n.name for n in blocks if n.op_type == "DequantizeLinear"}
    assert at_run == dq and len(dq) == 29
    assert all("int4 only" in p.why for p in blocked if p.where == "fails at run")
    info = fp8onnx.inspect(forms["blocked"], target="onnxruntime-cuda")
    assert info["placement"]["counts"]["fails at run"] == 29


def _q_transpose_dq(path, *, typed_custom_op: bool = True):
    """x -> QuantizeLinear(e4m3fn) -> Transpose -> DequantizeLinear -> y, no value_info in between; without
    ``typed_custom_op`` a node of an unknown domain (no schema, no type) feeds a Relu (its output unread)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="quant"),
        helper.make_node("Transpose", ["q"], ["t"], name="float8_transpose", perm=[1, 0]),
        helper.make_node("DequantizeLinear", ["t", "s", "zp"], ["y"], name="dequant"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])]
    opsets = [helper.make_opsetid("", 21)]
    if not typed_custom_op:
        nodes += [
            helper.make_node("Mystery", ["x"], ["m"], name="mystery", domain="example.custom"),
            helper.make_node("Relu", ["m"], ["r"], name="relu_of_mystery"),
        ]
        opsets.append(helper.make_opsetid("example.custom", 1))
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], outputs, inits), opset_imports=opsets), path)
    return path


def test_types_are_inferred_before_placing(tmp_path):
    """The CUDA EP has no float8 Transpose kernel: with the intermediate types inferred, the Transpose
    between a float8 Q and DQ goes to the CPU EP (unknown types used to match the float kernel)."""
    path = _q_transpose_dq(tmp_path / "qtdq.onnx")
    model = load_model(path)
    where = {p.node: (p.where, p.why) for p in predict_placement(model, "cuda")}
    assert where["quant"][0] == where["dequant"][0] == "cuda"
    assert where["float8_transpose"] == ("cpu", "no CUDA kernel for opset 21, T=tensor(float8e4m3fn)")
    assert model.graph.node(1).inputs[0].dtype is None  # the caller's model is left as it was
    result = CliRunner().invoke(main, ["inspect", str(path), "--target", "onnxruntime-cuda"])
    assert result.exit_code == 0, result.output
    assert "1 cpu, 2 cuda" in result.output and "cpu: Transpose: no CUDA kernel" in result.output


def test_nodes_of_unknown_input_types_are_named_not_placed(tmp_path):
    path = _q_transpose_dq(tmp_path / "untyped.onnx", typed_custom_op=False)
    placed = {p.node: p for p in predict_placement(load_model(path), "cuda")}
    assert placed["mystery"].where == "fails at load"  # no kernel for any type
    assert placed["relu_of_mystery"].where == "not placed"
    assert "'m' is unknown after type inference" in placed["relu_of_mystery"].why
    result = CliRunner().invoke(main, ["inspect", str(path), "--target", "onnxruntime-cuda", "--json"])
    assert json.loads(result.output)["placement"]["not_placed"] == ["relu_of_mystery"]
    result = CliRunner().invoke(main, ["inspect", str(path), "--target", "onnxruntime-cuda"])
    assert "1 not placed" in result.output
    assert "not placed: Relu: the type of 'm' is unknown after type inference" in result.output
    assert "relu_of_mystery" in result.output


def test_contrib_op_outputs_get_their_schema_types(tmp_path):
    """onnx's inference does not know com.microsoft ops; their schemas' type constraints carry the type on."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT16, [2, 64])
    k, n = 64, 8
    inits = [
        helper.make_tensor("b", TensorProto.FLOAT8E4M3FN, [n, k], [0] * (n * k)),
        numpy_helper.from_array(np.ones((n, 1), np.float32), "b_scale"),
    ]
    nodes = [
        helper.make_node(
            "MatMulBlockQuantizedFp8Weight", ["a", "b", "b_scale"], ["mm"], domain="com.microsoft", block_size=k
        ),
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
    ]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = ir.from_proto(helper.make_model(helper.make_graph(nodes, "g", [a], [y], inits), opset_imports=opsets))
    inferred = infer_types(model)
    assert inferred.graph.node(0).outputs[0].dtype == ir.DataType.FLOAT16
    assert {p.where for p in predict_placement(model, "cuda")} == {"cuda"}


def test_inspect_runs_in_a_child_without_crashing():
    """In onnxruntime-gpu 1.31.1 without its CUDA libraries, onnxruntime's kernel listing ends the process
    (SIGSEGV): here inspect runs in a child process, so a crash fails the test (.ci/run runs this file
    again against that wheel)."""
    done = subprocess.run(
        [sys.executable, "-m", "fp8onnx.cli", "inspect", str(SAMPLE / "decoder.onnx"), "--target", "onnxruntime-cuda"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "placement on onnxruntime-cuda (predicted): 226 cuda" in done.stdout


def test_a_kernel_listing_that_crashes_falls_back_to_the_shipped_table(monkeypatch, caplog):
    """A build with a provider library is asked in a child process; where onnxruntime ends that child
    (here a stand-in that prints onnxruntime's load error and dies of SIGSEGV), fp8onnx's copy of a CPU
    build's table is used, and a warning says why."""
    crash = (
        "import os, signal, sys; sys.stderr.write('\\x1b[1;31m[E:onnxruntime:Default] Failed to load library "
        "/x/libonnxruntime_providers_cuda.so with error: libcublasLt.so.13: cannot open shared object file: "
        "No such file or directory\\x1b[m\\n'); sys.stderr.flush(); os.kill(os.getpid(), signal.SIGSEGV)"
    )
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(kernels, "_CHILD", crash)
    kernels.cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fp8onnx.graph.kernels"):
            table, source = kernels.cpu_kernels()
    finally:
        kernels.cpu_kernels.cache_clear()
    shipped = json.loads(kernels.CPU_KERNELS_FILE.read_text())
    assert source.startswith(shipped["source"]) and "could not list its own" in source
    assert sum(len(k) for k in table.values()) == len(shipped["kernels"])
    assert "ended with SIGSEGV after libonnxruntime_providers_cuda.so: libcublasLt.so.13" in caplog.text


def test_the_child_process_lists_what_this_process_lists():
    if set(ort.get_available_providers()) - {"CPUExecutionProvider", "AzureExecutionProvider"}:
        pytest.skip("a build with provider libraries: its kernel listing may end the process")
    rows, why = kernels._rows_in_child()
    assert why == "" and sorted(map(json.dumps, rows)) == sorted(map(json.dumps, kernels.cpu_kernel_rows()))


def test_the_shipped_cpu_table_is_that_builds():
    """tests/bench/cpu_kernel_table.py wrote it from a CPU build; checked where that build is installed."""
    shipped = json.loads(kernels.CPU_KERNELS_FILE.read_text())
    if set(ort.get_available_providers()) - {"CPUExecutionProvider", "AzureExecutionProvider"}:
        pytest.skip("not a CPU build: its kernel listing may end the process")
    if not shipped["source"].startswith(f"onnxruntime {ort.__version__}'s CPU build"):
        pytest.skip(f"the shipped table is {shipped['source']}; this is onnxruntime {ort.__version__}")
    rows = [[k["domain"], k["op"], k["since"], k["until"], k["constraints"]] for k in shipped["kernels"]]
    assert sorted(map(json.dumps, rows)) == sorted(map(json.dumps, kernels.cpu_kernel_rows()))
