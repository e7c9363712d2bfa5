"""The placement predictor (fp8onnx.graph.placement) against onnxruntime's CPU EP, on every graph of the
exporter corpus and its fast-form output (``--target onnxruntime-cuda``, whose op has no CPU kernel):

- nodes predicted to run = nodes onnxruntime runs (its profiler, graph optimizations off so that the
  nodes keep their names): a graph predicted to load loads, and every node it ran was predicted on the CPU;
- a graph predicted to fail at load fails, naming a node predicted to fail;
and, from the CUDA EP's kernel table, that no node of the fast-form outputs fails on CUDA.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np
import onnxruntime as ort
import pytest

import fp8onnx
from fp8onnx.graph.model_io import load_model
from fp8onnx.graph.placement import predict_placement

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from corpus import CASES, available, build, feeds

NAMES = list(CASES)


def _profiled(path: pathlib.Path, data: dict, layout: str, tmp: pathlib.Path) -> set[str]:
    """The names of the nodes the CPU EP ran (onnxruntime's profiler, no graph optimizations)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / path.stem)
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    for feed in feeds(data, layout):
        session.run(None, {k: v for k, v in feed.items() if k in names})
    trace = json.loads(pathlib.Path(session.end_profiling()).read_text())
    ran = set()
    for event in trace:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            assert event["args"]["provider"] == "CPUExecutionProvider"
            ran.add(event["name"][: -len("_kernel_time")])
    return ran


@pytest.mark.wild
@pytest.mark.parametrize("name", NAMES)
def test_the_cpu_placement_predicted_is_what_onnxruntime_does(name, tmp_path):
    if not available(name):
        pytest.skip(f"needs {', '.join(CASES[name].requires)} (pip install -e .[wild])")
    model, data = build(name, tmp_path / "src")
    predicted = predict_placement(load_model(model), "cpu")
    assert not [p for p in predicted if p.where not in ("cpu", "initializer", "inlined")], predicted
    ran = _profiled(model, data, CASES[name].layout, tmp_path)
    # Cast nodes onnxruntime inserts around float16 nodes without a float16 kernel have names of its own
    ran = {n for n in ran if not re.match(r"InsertedPrecisionFreeCast_|.*_token_\d+$", n)}
    if any(p.where == "inlined" for p in predicted):  # an inlined function's nodes are named at load
        ran = {n for n in ran if "_inlfunc_" not in n}
    assert ran <= {p.node for p in predicted}, sorted(ran - {p.node for p in predicted})[:5]
    # the fast form for the CUDA EP: its op has no CPU kernel
    out = tmp_path / "cuda.onnx"
    np.savez(tmp_path / "calib.npz", **data)
    report = fp8onnx.quantize(model, out, tmp_path / "calib.npz", target="onnxruntime-cuda", provider="cpu")
    written = set((report.fast_form or {}).get("w8a8", []) + (report.fast_form or {}).get("w8a16", []))
    fails = {p.node for p in predict_placement(load_model(out), "cpu") if p.where == "fails at load"}
    assert fails == written
    on_cuda = predict_placement(load_model(out), "cuda")  # the CUDA EP's table, read from its source
    failing = [p for p in on_cuda if p.where.startswith("fails")]
    assert not failing, failing
    fast = {p.node for p in on_cuda if p.op.endswith("MatMulBlockQuantizedFp8Weight")}
    assert fast <= {p.node for p in on_cuda if p.where == "cuda"}
    if not fails:
        return
    with pytest.raises(Exception, match="Could not find an implementation for MatMulBlockQuantizedFp8Weight") as info:
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    named = re.search(r"node with name '([^']*)'", str(info.value))
    assert named and named.group(1) in fails, str(info.value)
