"""The prepared GPU check (tests/gpu/run_gpu_checks.py) runs end to end on the CPU EP (--dry-run): every
single-GEMM model built by fp8onnx, the CPU-runnable ones (FP16, Q/DQ, the fast form emulated) timed at
tiny widths in both DeepGEMM processes, the JSON and the table written; and the parts that only a GPU
exercises (the kernel trace, the log probe, the path rules) are checked on made-up input, so that a lent
GPU's minutes go to numbers, not to fixing the script."""

import importlib.util
import json
import subprocess
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "tests" / "gpu"))
SCRIPT = REPO / "tests" / "gpu" / "run_gpu_checks.py"


def _dry_run(tmp_path, *extra, timeout=120):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return json.loads((tmp_path / "gpu_checks.json").read_text()), done.stdout


def test_the_gpu_check_dry_runs_on_the_cpu(tmp_path):
    import gemm_models

    results, stdout = _dry_run(tmp_path)
    gemm = results["gemm"]
    widths = [gemm_models.width_key(k, n) for k, n in gemm_models.DRY_WIDTHS]
    assert gemm["widths"] == widths and gemm["ms"] == list(gemm_models.DRY_MS)
    assert all(forms == sorted(gemm_models.FORMS) for forms in gemm["built"].values())  # GemmFloat8 too
    assert gemm["settings"]["deepgemm_on"]["env"] == {"ORT_FP8_MATMUL_DEEPGEMM": "1"}
    assert "ORT_FP8_MATMUL_DEEPGEMM" not in gemm["settings"]["deepgemm_off"]["env"]
    rows = {(r["width"], r["m"], r["form"], r["deepgemm"]): r for r in gemm["rows"]}
    expected = {
        (w, m, f, on) for w in widths for m in gemm_models.DRY_MS for f in gemm_models.CPU_FORMS for on in (False, True)
    }
    assert set(rows) == expected  # GemmFloat8 has no CPU kernel: not run
    for (_, m, form, on), row in rows.items():
        assert row["wall_ms"] > 0 and row["ratio"] > 0, row
        assert form != "fp16" or row["ratio"] == 1.0
        if form.startswith("fast"):  # the log probe ran (no DeepGEMM on the CPU); the path by the rules (no trace)
            assert row["log_deepgemm"] is False
            assert row["expected_path"] == (
                "gemv" if m <= 32 else "deepgemm" if on and form == "fast_w8a8" else "dequant+cublas"
            )
    assert "dry run builds no onnxruntime-genai folders" in results["genai"]["skipped"]
    layers = results["layers"]["forms"]  # on the CPU the fast form is its own emulation: bit-equal
    rows = [layers[f][m] for f in ("fast_w8a16", "fast_w8a8") for m in ("4", "256")]
    assert all(r["vs_cpu"]["bit_equal"] == 1.0 and 0.01 < r["device_vs_fp16"]["rel_l2"] < 0.1 for r in rows)
    assert "GemmFloat8" in layers["gemm_float8"]["4"]["error"]  # no CPU kernel
    table = (tmp_path / "gpu_checks_table.txt").read_text()
    assert all(f"K x N = {w}" in table and f"K x N = {w}" in stdout for w in widths)


def test_the_time_guard_skips_what_would_not_fit(tmp_path):
    import gemm_timing

    plan = {"models": {"4096x4096": {"fp16": "never.onnx"}}, "ms": [1], "provider": "cpu", "deadline": 0}
    assert gemm_timing.run(plan)["results"] == {"4096x4096": {"fp16": {"skipped": "time guard"}}}


def test_the_kernel_path_is_read_from_the_kernels_that_ran():
    import gemm_timing

    mma = "void onnxruntime::contrib::cuda::(anonymous namespace)::MatMulBlockScaledFp8MmaGemvKernel<__half, 32>"
    assert gemm_timing.kernel_path([mma]) == "gemv-mma"
    assert gemm_timing.kernel_path(["MatMulBlockScaledFp8GemvKernel<__half>"]) == "gemv"
    deepgemm = "void deep_gemm::sm90_fp8_gemm_1d1d_impl<0u, 0u, 0u, 1u, 64u, 64u, 128u>"
    assert gemm_timing.kernel_path(["QuantizeActivation", deepgemm]) == "deepgemm"
    assert gemm_timing.kernel_path(["DequantizeBlockScaledFp8Vec16Kernel", "sm90_xmma_gemm_f16f16"]) == "dequant+cublas"
    assert gemm_timing.kernel_path(["sm90_xmma_gemm_f16f16_f32"]) == "other"


def test_a_kernel_trace_splits_by_the_range_of_each_m():  # without torch's own kernels (the L2 flush)
    import gemm_timing

    events = [
        {"cat": "user_annotation", "name": "gemm_m=1", "ts": 100.0, "dur": 50.0},
        {"cat": "user_annotation", "name": "gemm_m=64", "ts": 200.0, "dur": 50.0},
        {"cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4, FillFunctor>", "ts": 101.0},
        {"cat": "kernel", "name": "MatMulBlockScaledFp8GemvKernel", "ts": 110.0, "dur": 3.0},
        {"cat": "kernel", "name": "MatMulBlockScaledFp8GemvKernel", "ts": 120.0, "dur": 3.0},
        {"cat": "kernel", "name": "DequantizeBlockScaledFp8Kernel", "ts": 210.0, "dur": 4.0},
        {"cat": "kernel", "name": "sm90_xmma_gemm", "ts": 251.0, "dur": 6.0},  # ends after the range: still M=64
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 205.0, "dur": 1.0},
    ]
    split = gemm_timing.split_trace(events, repeats=2)
    assert split[1] == {"kernel_us": 3.0, "kernels": [["MatMulBlockScaledFp8GemvKernel", 3.0]]}
    assert split[64]["kernel_us"] == 5.0 and split[64]["kernels"][0][0] == "sm90_xmma_gemm"


def test_the_deepgemm_log_line_is_read_between_probe_markers():
    import gemm_report

    stderr = "\n".join(
        [
            "@@probe fast_w8a8 4096x4096 64",
            "[V:onnxruntime:, matmul_block_scaled_fp8.cc:120] MatMulBlockQuantizedFp8Weight: using SM90 DeepGEMM",
            "@@end",
            "@@probe fast_w8a8 4096x4096 1",
            "2026-12-04 [V:onnxruntime:, sequential_executor.cc:516] Begin execution",
            "@@end",
            "MatMulBlockQuantizedFp8Weight: using SM90 DeepGEMM (outside a probe: not counted)",
        ]
    )
    assert gemm_report.logged_deepgemm(stderr) == {
        ("fast_w8a8", "4096x4096", 64): True,
        ("fast_w8a8", "4096x4096", 1): False,
    }


@pytest.mark.slow
def test_the_decoder_step_dry_runs_on_the_cpu(tmp_path):
    results, _ = _dry_run(tmp_path, "--steps", "decoder", timeout=600)
    decoder = results["decoder"]
    assert "MatMul" in decoder["placement"]["fp8_fast"]["nodes"]  # on the CPU the emulation's MatMuls stand in
    for key in ("fp8_fast", "fp8_fast_w8a8"):  # the same emulation twice: identical logits
        assert decoder["fast_form"][key]["rel_l2_vs_cpu_emulation"] == 0.0
    rows = {row["name"] for row in decoder["accuracy"]["rows"]}
    assert {"decoder.fast.onnx", "decoder.fast_w8a8.onnx"} <= rows
    assert "gemm" not in results


@pytest.mark.slow
def test_the_genai_folders_build_as_on_the_lent_machine(tmp_path):
    if any(importlib.util.find_spec(n) is None for n in ("transformers", "onnxruntime_genai", "tokenizers")):
        pytest.skip("needs the [wild] extra (pip install -e .[wild])")
    import genai_tps
    import onnx

    dims = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 512}
    built = genai_tps.build_folders(tmp_path, dims, device="cpu")
    ops = {n.op_type for n in onnx.load(f"{built['fp8']}/model.onnx", load_external_data=False).graph.node}
    assert "MatMulBlockQuantizedFp8Weight" in ops
    config = json.loads((tmp_path / "fp16" / "genai_config.json").read_text())
    assert "cuda" in json.dumps(config["model"]["decoder"]["session_options"]["provider_options"])
    assert not (tmp_path / "hf").exists()
