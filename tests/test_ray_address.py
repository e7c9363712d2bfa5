"""--ray ADDRESS where nothing answers: one sentence within --ray-timeout (Ray itself retries its GCS
connection for minutes)."""

from __future__ import annotations

import time

import pytest

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError

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


def test_a_tmpdir_too_long_for_rays_sockets_names_the_fix(tmp_path, monkeypatch):
    """A local Ray's sockets live under TMPDIR; AF_UNIX paths stop at 107 bytes."""
    from fp8onnx.pipeline import distributed

    distributed.close_all()
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    with pytest.raises(Fp8OnnxError, match=r"AF_UNIX path length.* set RAY_TMPDIR to a short path"):
        fp8onnx.calibrate(SAMPLE / "decoder.onnx", SAMPLE / "calib.npz", provider="cpu", workers=2)
