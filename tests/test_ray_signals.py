"""SIGTERM to a command running on a local Ray (--workers 2) exits 143 with nothing of fp8onnx's left,
whenever it lands: while Ray starts, while the workers calibrate, and while Ray shuts down after the
output was written (Ray's core worker used to set SIGTERM's action back to the default there: the
process died of the signal, -15). Real subprocesses of the console script."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from helpers import SAMPLE

pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # Ray workers: left out of the default suite, CI's own step (-m ray)


def _run(tmp: pathlib.Path, when: str) -> tuple[int | None, str]:
    out = tmp / "stats.json"
    calib, batch = SAMPLE / "calib.npz", "4"
    if when == "calibrating":
        # Long enough that the signal lands while the workers calibrate: the 32 batches of the sample data
        # took 0.3 s, and on a loaded machine the progress bar's first line (the marker) reached this
        # process after they were done (the run wrote its output before the signal came).
        calib, batch = tmp / "long.npz", "1"
        with np.load(SAMPLE / "calib.npz") as data:
            np.savez(calib, input_ids=np.tile(data["input_ids"], (16, 1)))  # 2,048 batches of one sample
    command = [os.path.join(sys.prefix, "bin", "fp8onnx"), "calibrate", str(SAMPLE / "decoder.onnx")]
    command += ["--calib", str(calib), "-o", str(out), "--workers", "2", "--provider", "cpu"]
    command += ["--batch-size", batch]
    p = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ | {"TMPDIR": str(tmp)}
    )
    seen = b""
    if when == "starting":
        _wait_for_ray_processes(p.pid)
    else:
        marker = b"calibration:" if when == "calibrating" else f"wrote {out}".encode()
        while marker not in seen:
            chunk = p.stdout.read1(4096)
            if not chunk:
                break
            seen += chunk
        if when == "shutting down":
            time.sleep(0.3)  # Ray's shutdown takes about 1 s here
    if p.poll() is not None:  # the command ended before the signal could be sent: the moment was missed
        seen += p.stdout.read()
        return None, seen.decode(errors="replace")
    p.send_signal(signal.SIGTERM)
    seen += p.stdout.read()
    return p.wait(timeout=120), seen.decode(errors="replace")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _wait_for_ray_processes(pid: int, timeout: float = 60) -> None:
    """Until the command has started Ray's own processes (its GCS server): Ray is starting. (Before it
    has imported fp8onnx, a SIGTERM ends the interpreter the default way: nothing was written yet.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in _descendants(pid):
            try:
                if b"gcs_server" in pathlib.Path(f"/proc/{child}/cmdline").read_bytes():
                    return
            except OSError:
                continue
        time.sleep(0.02)
    raise AssertionError("Ray's GCS server did not start")


@pytest.fixture
def short_tmp():
    """A short TMPDIR: a local Ray's sockets live under it, and AF_UNIX paths stop at 107 bytes."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("when", ["starting", "calibrating", "shutting down"])
def test_sigterm_on_a_local_ray_exits_143_and_leaves_nothing(short_tmp, when):
    tmp_path = short_tmp
    for _ in range(3):  # a loaded machine can let Ray's shutdown end before the signal: then once more
        code, output = _run(tmp_path, when)
        if code is not None:
            break
        (tmp_path / "stats.json").unlink(missing_ok=True)
    assert code == 128 + signal.SIGTERM, output[-2000:]
    assert "fp8onnx: interrupted (SIGTERM)" in output or "Stopped" in output or "interrupted" in output
    assert "Traceback" not in output
    ours = [p.name for p in tmp_path.iterdir() if p.name.startswith(("fp8onnx", ".fp8onnx")) or p.suffix == ".tmp"]
    assert not ours, ours  # Ray's own session folder (TMPDIR/ray) is Ray's to keep, as it does after any run
    stats = tmp_path / "stats.json"
    if when != "shutting down":
        assert not stats.exists()
    else:
        assert stats.stat().st_size > 0  # written before the signal, complete
