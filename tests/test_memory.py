import re
import subprocess
import sys

import pytest

from helpers import REPO, SAMPLE


# quantize (amax) is flat from the first batch. calibrate also fetches whole tensors for histograms;
# on the small decoder glibc's heap settles about 20 MiB higher after the first few hundred samples
# (measured: 270 / 290 / 288 MiB at 128 / 1,024 / 4,096 samples), so it is compared past that point.
@pytest.mark.slow
@pytest.mark.parametrize("command, samples", [("quantize", ["128", "1024"]), ("calibrate", ["512", "2048"])])
def test_calibration_memory_is_flat_in_sample_count(command, samples):
    bench = REPO / "tests" / "bench" / "calibration_memory.py"
    args = [str(SAMPLE / "decoder.onnx"), str(SAMPLE / "calib.npz"), "--samples", *samples, "--command", command]
    out = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, check=True).stdout
    ratio = float(re.search(r"peak RSS ratio .*: ([0-9.]+)", out).group(1))
    assert ratio <= 1.10, out


# A model with its weights in external data, quantized layer by layer: the process never holds
# the whole FP32 model (544 MB here; the budget is 64 MiB of weights at a time; some 250 MiB of it are
# the interpreter, onnxruntime and the libraries). Plain amax (--preset none) peaked at 0.75x the
# model, the default recipe for a decoder (GPTQ, weight-only) at 0.89-0.97x (2026-12-02, AMD EPYC):
# the bound for GPTQ is 1.0x. With blocks of 32 (GPTQ on each block's grid) it measured
# 0.96-1.01x (2.97x before block scales were expanded one weight at a time and reported as a summary).
@pytest.mark.slow
@pytest.mark.parametrize(
    "options, bound",
    [(["--preset", "none"], 0.8), ([], 1.0), (["--weight-block-size", "32"], 1.1)],
    ids=["plain", "default", "gptq-blocks"],
)
def test_layer_by_layer_quantize_stays_below_the_fp32_size(tmp_path, options, bound):
    from fp8onnx.models.build_llama import build, write_data

    path = build(tmp_path / "m", layers=8, dim=1024, heads=8, ffn=2816, vocab=16000)
    write_data(tmp_path / "m", vocab=16000, seq=64, calib=16, evals=2)
    fp32 = path.stat().st_size + path.with_name(path.name + ".data").stat().st_size
    # The child's own peak: VmHWM of its address space. Not ru_maxrss: Linux carries the parent's peak
    # over the exec (subprocess spawns by vfork), and a pytest process that collected the exporter corpus
    # (torch, transformers: about 500 MB) made this 0.75x run read 0.95x.
    code = (
        "import sys; from fp8onnx.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))"
    )
    args = ["quantize", str(path), "-o", str(tmp_path / "q.onnx"), "--calib", str(tmp_path / "m" / "calib.npz")]
    args += options
    out = subprocess.run(
        [sys.executable, "-c", code, *args, "--weight-memory", "64"], capture_output=True, text=True, check=True
    ).stdout
    peak = int(out.strip().splitlines()[-1])
    assert peak < bound * fp32, (peak, fp32)
