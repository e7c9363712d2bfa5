"""The ``fp8onnx`` console script's first step, before fp8onnx is imported.

Importing fp8onnx takes a third of a second or more (onnx, onnxruntime, numpy, onnx_ir). A SIGINT,
SIGTERM or SIGHUP in that time used to end the interpreter the default way (killed by the signal, or a
KeyboardInterrupt traceback); here it is noted, and the command does not start: exit 128 + N, as at any
other moment (fp8onnx.cli.entry). Before that, a missing onnxruntime is one sentence (exit 2): the
package names no runtime of its own, its extras choose the CPU or the GPU build (pyproject.toml).
"""

import signal
import sys


def note_stops(noted: list[int]) -> None:
    """SIGINT, SIGTERM and SIGHUP, where they still have their default action, are appended to ``noted``
    instead of stopping the process (one the parent ignored stays ignored). A copy of
    fp8onnx.cli.note_stops, which cannot be imported before fp8onnx is: this module imports the CLI
    (once noting), the CLI never imports this module (tests/test_layout.py); ``noted`` is handed over."""
    note = _Note(noted)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, note)


class _Note:
    """The handler :func:`note_stops` installs: it appends the signal's number to its list."""

    fp8onnx_late = True  # the mark fp8onnx.cli.common looks for: a command's own handlers replace this one

    def __init__(self, noted: list[int]):
        self.noted = noted

    def __call__(self, signum: int, frame: object) -> None:
        self.noted.append(signum)


def entry() -> None:
    noted: list[int] = []
    note_stops(noted)
    try:
        from fp8onnx.cli import entry as run
    except ModuleNotFoundError as exc:  # fp8onnx's own sentence for a missing runtime (fp8onnx/__init__.py)
        if exc.name != "onnxruntime":
            raise
        print(f"fp8onnx: error: {exc}", file=sys.stderr)
        sys.exit(2)
    run(noted)
