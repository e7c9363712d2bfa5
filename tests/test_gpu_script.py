"""The prepared GPU check (tests/gpu/run_gpu_checks.py) runs end to end on the CPU EP (--cpu-dry-run):
the same steps, the fast form emulated where the GPU runs it, so that a lent GPU's minutes go to numbers,
not to fixing the script."""

import json
import subprocess
import sys

from helpers import REPO


def test_the_gpu_check_script_dry_runs_on_the_cpu(tmp_path):
    script = REPO / "tests" / "gpu" / "run_gpu_checks.py"
    done = subprocess.run(
        [sys.executable, str(script), "--cpu-dry-run", "--runs", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_checks.json").read_text())
    forms = {"fp16", "fp8_qdq", "fp8_fast", "fp8_fast_w8a8"}
    assert set(results["decoder_latency_ms"]) == forms and set(results["stack_latency_ms"]) == forms
    assert sorted(results["stack_decode_ms"]) == [str(m) for m in range(1, 9)]
    fast = results["placement"]["fp8_fast"]["nodes"]
    assert "MatMul" in fast  # on the CPU the emulation's MatMuls stand in for the op
    for key in ("fp8_fast", "fp8_fast_w8a8"):  # the same emulation twice: identical logits
        assert results["fast_form"][key]["rel_l2_vs_cpu_emulation"] == 0.0
    rows = {row["name"] for row in results["accuracy"]["rows"]}
    assert {"decoder.fast.onnx", "decoder.fast_w8a8.onnx"} <= rows
