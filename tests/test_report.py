"""QuantizeReport: the summary people read and the JSON machines read say the same things."""

import json

import numpy as np

from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.report import NodeReport, QuantizeReport, TensorReport, describe_config


def _report(nodes, **kw):
    base = dict(
        model="m.onnx",
        output="q.onnx",
        config=QuantizeConfig().to_json(),
        opset_from=17,
        opset_to=21,
        prepared=["upgraded opset 17 -> 21 (2 nodes rewritten)"],
        nodes=nodes,
        calibration={"batches": 2, "samples": 20, "source": "calib.npz"},
        input_bytes=4000,
        output_bytes=1000,
        modified=True,
    )
    return QuantizeReport(**{**base, **kw})


QUANTIZED = NodeReport(
    "fc1",
    "MatMul",
    True,
    None,
    [TensorReport("x", "activation", "e4m3fn", 0.01, 4.48), TensorReport("w", "weight", "e4m3fn", 0.002, 0.896)],
)


def test_summary_lines():
    skipped = [NodeReport(f"attn{i}", "MatMul", False, "both inputs are activations") for i in range(5)]
    lines = _report([QUANTIZED, *skipped]).summary().splitlines()
    assert lines[0] == "m.onnx -> q.onnx"
    assert "upgraded opset 17 -> 21 (2 nodes rewritten) (float8 Q/DQ without zero points)" in lines[1]
    assert "quantized 1 of 6 MatMul nodes to e4m3fn, amax scaling" in lines[2]
    assert "calibrated on 20 samples in 2 batches (calib.npz)" in lines[3]
    assert "1 weights stored as float8, 1 activation tensors with Q/DQ" in lines[4]
    assert "size 0.00 MB -> 0.00 MB (0.25x)" in lines[5]
    assert lines[6] == "  left alone: attn0, attn1, attn2, ... (5 nodes): both inputs are activations"


def test_nothing_quantized_says_so_first():
    skipped = [NodeReport("conv", "Conv", False, "Conv is not in --op-types")]
    summary = _report(skipped, modified=False, calibration=None).summary()
    assert summary.splitlines()[0] == (
        "NOTHING QUANTIZED in m.onnx (the output is the input graph, unchanged): Conv is not in --op-types"
    )
    assert _report([], modified=False).summary().startswith("NOTHING QUANTIZED in m.onnx (the output is the input")


def test_json_round_trips_every_field():
    doc = json.loads(json.dumps(_report([QUANTIZED]).to_json()))
    assert doc["nodes"][0]["tensors"][1] == {
        "name": "w",
        "kind": "weight",
        "format": "e4m3fn",
        "scale": 0.002,
        "amax": 0.896,
        "axis": None,
        "block_size": 0,
    }
    assert doc["calibration"]["source"] == "calib.npz" and doc["prepared"][0].startswith("upgraded")


def test_json_lists_channel_scales_and_summarises_block_scales():
    """Per-channel scales are listed; block scales (one per 32 weights: a report the size of the
    float8 weights) are given as their shape, min and max."""
    channels = TensorReport("w", "weight", "e4m3fn", np.array([0.5, 0.25], np.float32), np.array([224.0, 112.0]), 1)
    blocks = np.arange(1, 7, dtype=np.float32).reshape(2, 3) / 64
    blocked = TensorReport("v", "weight", "e4m3fn", blocks, blocks * 448, 0, 32)
    node = NodeReport("fc", "MatMul", True, None, [channels, blocked])
    doc = json.loads(json.dumps(_report([node]).to_json()))
    first, second = doc["nodes"][0]["tensors"]
    assert first["scale"] == [0.5, 0.25] and first["amax"] == [224.0, 112.0] and first["block_size"] == 0
    assert second["scale"] == {"blocks": [2, 3], "min": 1 / 64, "max": 6 / 64} and second["block_size"] == 32
    assert second["amax"] == {"blocks": [2, 3], "min": 7.0, "max": 42.0}


def test_describe_config_names_every_choice():
    cfg = QuantizeConfig(
        weight_format="e4m3fn", activation_format="e5m2", scaling="pow2", margin=1, per_channel=True
    ).to_json()
    assert describe_config(cfg) == "e4m3fn weights / e5m2 activations, pow2 margin 1 scaling, per-channel weights"
    assert describe_config(QuantizeConfig(scaling="constant", scale=0.5).to_json()) == "e4m3fn, constant 0.5 scaling"
    dyn = QuantizeConfig(activations="dynamic", precision="fp16").to_json()
    assert describe_config(dyn) == "e4m3fn, amax scaling, dynamic activations, FP16 graph"
