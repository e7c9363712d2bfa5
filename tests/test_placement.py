"""Where onnxruntime runs each node, predicted (fp8onnx.graph.placement, ``inspect --target``): on the CPU
EP against real sessions (tests/wild/test_wild_placement.py does the same on the whole exporter corpus)."""

import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

import fp8onnx
from fp8onnx.cli import main
from fp8onnx.graph.model_io import load_model
from fp8onnx.graph.placement import predict_placement

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
    with pytest.raises(Exception, match="Could not find an implementation for MatMulBlockQuantizedFp8Weight"):
        ort.InferenceSession(str(forms["fast"]), providers=["CPUExecutionProvider"])


def test_inspect_says_where_nodes_run(forms):
    result = CliRunner().invoke(main, ["inspect", str(forms["fast"]), "--target", "onnxruntime"])
    assert result.exit_code == 0, result.output
    assert "29 fails at load" in result.output and "MatMulBlockQuantizedFp8Weight: no kernel" in result.output
    assert "29 of 37 MatMul/Gemm nodes read float8 inputs" in result.output  # 8 attention MatMuls in float
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
