"""A stopped run leaves nothing behind: real subprocesses get SIGINT or SIGTERM (and SIGHUP) at each
phase of `fp8onnx quantize` - calibration, the layer-by-layer spill, writing the output inline or
with external data - and of `fp8onnx compare` (its reference outputs wait on disk). Each must exit
with 128 + the signal, leave no temporary file next to the output or in TMPDIR, and leave the
previous output byte for byte as it was.

The signal is real (``os.kill`` of the process itself) and is sent from inside the phase: the
subprocess patches one function of that phase to send it, then runs the CLI as a user would.
"""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import SAMPLE

SIGNAL_AFTER_A_RUN = """
import onnxruntime
real = onnxruntime.InferenceSession.run
def run(self, *a, **k):
    out = real(self, *a, **k)
    os.kill(os.getpid(), SIG)
    return out
onnxruntime.InferenceSession.run = run
"""
QUANTIZE = ["quantize", "{src}", "--calib", "{data}", "--batch-size", "16", "-o", "{out}"]
# phase -> (code run in the child before the CLI, CLI arguments)
PHASES = {
    "calibration": (SIGNAL_AFTER_A_RUN, QUANTIZE),
    "compare": (SIGNAL_AFTER_A_RUN, ["compare", "{src}", "--data", "{data}", "--json", "{out}"]),
    "layer-by-layer spill": (
        """
        from fp8onnx.pipeline import segments
        real = segments.Spill.save
        def save(self, *a, **k):
            real(self, *a, **k)
            os.kill(os.getpid(), SIG)
        segments.Spill.save = save
        """,
        QUANTIZE + ["--weight-memory", "1"],
    ),
    "write": (
        """
        real = os.fsync
        def fsync(fd):
            real(fd)
            os.kill(os.getpid(), SIG)
        os.fsync = fsync
        """,
        QUANTIZE,
    ),
    "write with external data": (
        """
        from fp8onnx.graph import model_io
        real = model_io.make_session
        def make_session(*a, **k):
            out = real(*a, **k)
            os.kill(os.getpid(), SIG)
            return out
        model_io.make_session = make_session
        """,
        QUANTIZE + ["--weight-memory", "1"],
    ),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Three 512x512 MatMuls (1 MiB of weights each): layer by layer at --weight-memory 1."""
    t = tmp_path_factory.mktemp("sig")
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(3):
        inits.append(numpy_helper.from_array((rng.standard_normal((512, 512)) / 23).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 512])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["b", 512])],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(m, t / "m.onnx")
    np.savez(t / "d.npz", x=rng.standard_normal((64, 512)).astype(np.float32))
    ext = t / "ext"
    ext.mkdir()
    onnx.save(m, ext / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    return t


def _default_signals() -> None:
    """The child starts as from an interactive shell. Under nohup or as a background job, SIGHUP or
    SIGINT arrive ignored, and fp8onnx (rightly) keeps ignoring what its parent ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _run(phase: str, sig: signal.Signals, model_dir, tmp_path):
    setup, args = PHASES[phase]
    src = model_dir / ("ext" if "external" in phase else "") / "m.onnx"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "q.onnx"
    out.write_bytes(b"previous output")
    spill_dir = tmp_path / "tmp"
    spill_dir.mkdir()
    code = "import os, signal, sys\nSIG = signal." + sig.name + "\n" + textwrap.dedent(setup)
    code += "from fp8onnx.cli import main\nmain()\n"
    args = [a.format(src=src, data=model_dir / "d.npz", out=out) for a in args]
    env = {**os.environ, "TMPDIR": str(spill_dir)}
    # onnxruntime itself keeps a session-id file (.ses) in TMPDIR: what it leaves on import is not ours.
    subprocess.run([sys.executable, "-c", "import onnxruntime"], env=env, check=True)
    before = sorted(spill_dir.iterdir())
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=_default_signals,
    )
    return proc, out, before, spill_dir


# Every phase with SIGINT and SIGTERM; SIGHUP shares SIGTERM's handler, so one phase is enough for it.
RUNS = [(phase, sig) for phase in PHASES for sig in (signal.SIGINT, signal.SIGTERM)] + [("write", signal.SIGHUP)]


@pytest.mark.parametrize("phase, sig", RUNS, ids=[f"{p}-{s.name}" for p, s in RUNS])
def test_stopped_run_leaves_nothing(model, tmp_path, phase, sig):
    proc, out, before, spill_dir = _run(phase, sig, model, tmp_path)
    assert proc.returncode == 128 + sig, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"fp8onnx: interrupted ({sig.name})", proc.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["q.onnx"]
    assert out.read_bytes() == b"previous output"
    assert sorted(spill_dir.iterdir()) == before


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (/proc's SigCgt mask)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_fp8onnx_is_imported_stops_it_with_128_plus_n(tmp_path, sig):
    """The console script notes stopping signals before it imports fp8onnx (a third of a second or more):
    one sent as soon as it is caught, mid-import, stops the command before it starts: 128 + N, one line.
    (SIGINT cannot be timed so: Python catches it from its own start, before any line of fp8onnx runs.)"""
    code = "import sys; sys.argv[0] = 'fp8onnx'; from fp8onnx_boot import entry; entry()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "inspect", str(SAMPLE / "decoder.onnx")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
    )
    deadline = time.monotonic() + 30
    while not _catches(proc.pid, sig) and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert err.strip() == f"fp8onnx: interrupted ({sig.name})" and "Traceback" not in err and not out
