"""--ray ADDRESS where nothing answers: one sentence within --ray-timeout (Ray itself retries its GCS
connection for minutes)."""

from __future__ import annotations

import time

import pytest

import fp8onnx
from fp8onnx.errors import Fp8OnnxError

from helpers import SAMPLE

pytest.importorskip("ray")


def test_an_address_where_nothing_answers_is_one_sentence_in_time():
    t0 = time.perf_counter()
    with pytest.raises(Fp8OnnxError, match=r"Nothing answers at the Ray address '127\.0\.0\.1:9' within 2 s"):
        fp8onnx.calibrate(
            SAMPLE / "decoder.onnx", SAMPLE / "calib.npz", provider="cpu", workers=2,
            ray_address="127.0.0.1:9", ray_timeout=2,
        )  # fmt: skip
    assert time.perf_counter() - t0 < 10


def test_the_cli_says_it_and_exits_2(tmp_path):
    from click.testing import CliRunner

    from fp8onnx.cli import main

    args = ["calibrate", str(SAMPLE / "decoder.onnx"), "--calib", str(SAMPLE / "calib.npz")]
    args += ["-o", str(tmp_path / "s.json")]
    result = CliRunner().invoke(main, [*args, "--ray", "127.0.0.1:9", "--ray-timeout", "1"])
    assert result.exit_code == 2 and "Nothing answers at the Ray address '127.0.0.1:9' within 1 s" in result.output
