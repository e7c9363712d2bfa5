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
