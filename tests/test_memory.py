import re
import subprocess
import sys

import pytest

from helpers import REPO, SAMPLE


@pytest.mark.slow
@pytest.mark.parametrize("command", ["calibrate", "quantize"])
def test_calibration_memory_is_flat_in_sample_count(command):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/bench/calibration_memory.py"),
            str(SAMPLE / "decoder.onnx"),
            str(SAMPLE / "calib.npz"),
            "--samples",
            "128",
            "1024",
            "--command",
            command,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ratio = float(re.search(r"peak RSS ratio .*: ([0-9.]+)", out).group(1))
    assert ratio <= 1.10, out
