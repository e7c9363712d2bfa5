"""A stopped run leaves nothing, wherever the signal lands: a battery of real SIGINT/SIGTERM sent at N
points spread over each phase of a command, not at one chosen spot (tests/test_signals.py).

The child counts the Python function calls of fp8onnx, tempfile and shutil from the moment the CLI's
signal handlers are in place (a profile hook), and sends itself the signal at call K. A dry run counts
the calls of the whole command; the K are spread evenly over it. Each run must exit 128 + N (or 0 if
the signal came after the command's last step), leave TMPDIR as it was and the output folder either
as it was or with the new output complete (never a new side file beside the previous model), and
print no traceback.

The default suite runs ``POINTS`` points per command; ``FP8ONNX_SIGNAL_POINTS=40`` runs more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_signals import _default_signals  # the child starts as from an interactive shell

POINTS = int(os.environ.get("FP8ONNX_SIGNAL_POINTS", "4"))

CHILD = """
import os, signal, sys
K, SIG = int(sys.argv[1]), getattr(signal, sys.argv[2])
counted = [0]
WATCHED = ("/fp8onnx/", "/passes/", "tempfile.py", "shutil.py")

def hook(frame, event, arg):
    if event == "call" and any(w in frame.f_code.co_filename for w in WATCHED):
        counted[0] += 1
        if counted[0] == K:
            os.kill(os.getpid(), SIG)

from fp8onnx.cli import common
real = common._install_signal_handlers
def install(ctx):
    real(ctx)
    sys.setprofile(hook)
common._install_signal_handlers = install
from fp8onnx.cli import entry
sys.argv = ["fp8onnx", *sys.argv[3:]]
try:
    entry()  # as the console script runs
finally:
    sys.setprofile(None)
    if K == 0:
        print("CALLS", counted[0], file=sys.stderr)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Two 256x256 MatMuls with their weights in a side file: layer by layer at --weight-memory 1."""
    t = tmp_path_factory.mktemp("battery")
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(2):
        inits.append(numpy_helper.from_array((rng.standard_normal((256, 256)) / 16).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["b", 256])],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(m, t / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    np.savez(t / "d.npz", x=rng.standard_normal((32, 256)).astype(np.float32))
    return t


COMMANDS = {
    "quantize, layer by layer, external data": [
        "quantize", "{src}", "--calib", "{data}", "--batch-size", "8", "--weight-memory", "1", "-o", "{out}",
    ],
    "compare": ["compare", "{src}", "--data", "{data}", "--batch-size", "8", "--json", "{out}"],
}  # fmt: skip


def _run(model, tmp, command: str, k: int, sig: str):
    out_dir, spill = tmp / f"out{k}{sig}", tmp / f"tmp{k}{sig}"
    out_dir.mkdir()
    spill.mkdir()
    out = out_dir / ("q.onnx" if command.startswith("quantize") else "c.json")
    out.write_bytes(b"previous output")
    env = {**os.environ, "TMPDIR": str(spill)}
    subprocess.run([sys.executable, "-c", "import onnxruntime"], env=env, check=True)  # its own .ses file
    before = sorted(p.name for p in spill.iterdir())
    args = [a.format(src=model / "m.onnx", data=model / "d.npz", out=out) for a in COMMANDS[command]]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(k), sig, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=_default_signals,
    )
    return proc, out, sorted(p.name for p in spill.iterdir()), before


def _complete(out, where: str) -> None:
    if out.suffix == ".json":
        import json

        json.loads(out.read_text())
        return
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)  # its weights beside it, whole
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".data"], where


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_signal_anywhere_leaves_nothing(model, tmp_path, command):
    dry, _, _, _ = _run(model, tmp_path, command, 0, "SIGTERM")
    assert dry.returncode == 0, dry.stderr[-2000:]
    calls = int(dry.stderr.strip().splitlines()[-1].split()[1])
    points = sorted({max(1, round(calls * (i + 0.5) / POINTS)) for i in range(POINTS)})
    for i, k in enumerate(points):
        sig = ("SIGINT", "SIGTERM")[i % 2]
        proc, out, spill_now, spill_before = _run(model, tmp_path, command, k, sig)
        where = f"{command}: {sig} at call {k} of {calls}"
        code = 128 + getattr(signal, sig)
        assert proc.returncode in (code, 0), f"{where}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr, f"{where}\n{proc.stderr[-2000:]}"
        # exact: file names
        assert spill_now == spill_before, f"{where}: left in TMPDIR {sorted(set(spill_now) - set(spill_before))}"
        left = sorted(p.name for p in out.parent.iterdir())
        if out.read_bytes() == b"previous output":  # stopped before the output was in place: as it was
            # exact: an exit code and file names
            assert proc.returncode == code and left == [out.name], f"{where}: {left}"
        else:  # the new output, complete (the signal came after it was renamed into place)
            _complete(out, where)
