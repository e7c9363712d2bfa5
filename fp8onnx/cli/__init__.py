"""The ``fp8onnx`` command line: a thin layer over the Python API that prints and sets exit codes.

Exit codes: 0 success; 2 bad usage or bad input (one sentence naming the file, tensor or node);
1 an internal error (a bug: run with --debug for the traceback, and report it); 128 + N when
stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP). SIGTERM and SIGHUP unwind like Ctrl-C,
so every temporary file and spill folder is removed and a previous output stays as it was.

One module per command group: :mod:`.common` (the group, exit codes, signals, logging, shared
options), :mod:`.quantize`, :mod:`.evaluate` (compare, study, sensitivity), :mod:`.tools`
(calibrate, inspect, data, fp16, demo), :mod:`.experiments` (zoo, train-study).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from fp8onnx.base.scratch import drain
from fp8onnx.cli import evaluate, experiments, quantize, tools  # noqa: F401  (each registers its commands)
from fp8onnx.cli.common import _STOPPED, main

__all__ = ["entry", "main"]


def note_stops(noted: list[int]) -> None:
    """SIGINT, SIGTERM and SIGHUP, where they still have their default action, are appended to ``noted``
    instead of stopping the process (one the parent ignored stays ignored). The console script's first
    step (``fp8onnx_boot``) installs the same before fp8onnx is imported, with a copy of its own: it runs
    before this module can be imported, and it imports this module, never the other way round."""

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


def entry(noted: list[int] | None = None) -> None:
    """The console script: run the command, flush what it printed and logged, and leave without
    tearing the interpreter down. Freeing the imported modules (sympy's caches, through onnx_ir, and
    onnxscript) took 0.15 s at every exit, 3% of quantizing all-MiniLM-L6-v2. Every file a command
    writes is closed (atomically renamed) before it returns, so nothing is left for exit handlers.
    ``noted``: the signals the console script's first step (``fp8onnx_boot``) noted while fp8onnx was
    being imported (its handlers keep noting into it); one there means the command does not start."""
    # Before and after the command (a local Ray shutting down takes seconds), a stopping signal is noted,
    # not fatal halfway: the exit code says it (128 + N), what the command wrote is complete. During the
    # command its own handlers take over (fp8onnx.cli.common) and give this one back when it ends.
    late: list[int] = noted if noted is not None else []
    note_stops(late)  # where fp8onnx_boot did not already (its handlers note into ``noted``)
    if late:  # stopped while fp8onnx was being imported: nothing was started
        print(f"fp8onnx: interrupted ({signal.Signals(late[0]).name})", file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + late[0])
    try:
        main()  # click's standalone mode ends in SystemExit, whatever happened
        code = 0
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):  # sys.exit("message")
            print(exc.code, file=sys.stderr)
            code = 1
        else:
            code = exc.code or 0
    if _STOPPED and code == 1:  # stopped before the command's own handling began: click said "Aborted!"
        print(f"fp8onnx: interrupted ({signal.Signals(_STOPPED[0]).name})", file=sys.stderr)
        code = 128 + _STOPPED[0]
    if "fp8onnx.pipeline.distributed" in sys.modules:  # Ray workers and a local Ray started for them
        sys.modules["fp8onnx.pipeline.distributed"].close_all()
    drain()  # os._exit below runs no atexit handler
    if late and not code:
        print(f"fp8onnx: interrupted ({signal.Signals(late[0]).name})", file=sys.stderr)
        code = 128 + late[0]
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
            pass
    if sys.getprofile() is not None or sys.gettrace() is not None:  # cProfile, coverage: let them write
        sys.exit(code)
    os._exit(code or 0)
