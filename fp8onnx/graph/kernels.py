"""The CPU and CUDA EPs' kernel tables, which the placement predictor (:mod:`fp8onnx.graph.placement`) reads.

The CPU EP's table is the installed onnxruntime's own (``get_all_opkernel_def()``). That call builds every
execution provider of the build; in onnxruntime-gpu without its CUDA libraries (``libcublasLt.so.13:
cannot open shared object file``) the CUDA provider's factory is missing and the call ends the process
with a segmentation fault (onnxruntime-gpu 1.31.1). So a build that lists more than the CPU EP is asked
in a child process (after ``onnxruntime.preload_dlls()``, as :mod:`fp8onnx.graph.providers` does); where
the child dies, :data:`CPU_KERNELS_FILE` (a CPU build's table, written by
``tests/bench/cpu_kernel_table.py``) stands in, and a warning says why. The CUDA EP's table is
:data:`CUDA_KERNELS_FILE`, read from onnxruntime's source (see its ``source`` entry); only a CUDA build
carries that registry.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import pathlib
import signal
import subprocess
import sys

from fp8onnx.graph.providers import onnxruntime_reason

__all__ = ["CPU_KERNELS_FILE", "CUDA_KERNELS_FILE", "Kernel", "cpu_kernel_rows", "cpu_kernels", "cuda_kernels"]

logger = logging.getLogger(__name__)
CUDA_KERNELS_FILE = pathlib.Path(__file__).with_name("cuda_kernels.json")
CPU_KERNELS_FILE = pathlib.Path(__file__).with_name("cpu_kernels.json")
OPEN = 2**31 - 1  # a kernel's open-ended last version
# Providers built into onnxruntime's core library: a build with only these loads no provider library.
_BUILT_IN = {"CPUExecutionProvider", "AzureExecutionProvider"}
_CHILD_TIMEOUT = 300.0
# The child's program: cpu_kernel_rows without importing fp8onnx (tests check that both give the same rows).
_CHILD = """import contextlib, io, json, sys
import onnxruntime
from onnxruntime.capi import _pybind_state as C
if hasattr(onnxruntime, "preload_dlls"):  # the nvidia-* wheels' CUDA libraries, as fp8onnx.graph.providers loads them
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
        onnxruntime.preload_dlls()
json.dump([[k.domain, k.op_name, *k.version_range, {p: sorted(t) for p, t in sorted(k.type_constraints.items())}]
           for k in C.get_all_opkernel_def() if k.provider == "CPUExecutionProvider"], sys.stdout)
"""
Table = dict[tuple[str, str], list["Kernel"]]


@dataclasses.dataclass(frozen=True)
class Kernel:
    domain: str
    op: str
    since: int
    until: int
    constraints: tuple[tuple[str, frozenset[str]], ...] = ()  # type parameter -> the types it admits
    typed: str | None = None  # a typed registration: the type of the node's first input

    def admits(self, since: int, types: dict[str, set[str]], first: str | None) -> bool:
        """Whether a node whose schema dates from opset ``since`` (onnxruntime's KernelRegistry: the
        kernel's first version equals it, or a closed range covers it) with these types runs here."""
        if not (self.since == since or (self.until != OPEN and self.since <= since <= self.until)):
            return False
        if self.typed is not None and first is not None and first != self.typed:
            return False
        return all(not types.get(p) or types[p] <= allowed for p, allowed in self.constraints)


def domain_of(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _table(rows) -> Table:
    """Kernels from rows of (domain, op, since, until, {type parameter: types})."""
    table: Table = collections.defaultdict(list)
    for domain, op, since, until, constraints in rows:
        typed = tuple((p, frozenset(t)) for p, t in sorted(constraints.items()))
        table[domain_of(domain), op].append(Kernel(domain_of(domain), op, since, until, typed))
    return dict(table)


def cpu_kernel_rows() -> list[list]:
    """The installed onnxruntime's CPU kernels as rows of (domain, op, since, until, {type parameter:
    types}), asked in this process: only for a build without provider libraries (see the module's text)."""
    from onnxruntime.capi import _pybind_state as C

    return [
        [k.domain, k.op_name, *k.version_range, {p: sorted(t) for p, t in sorted(k.type_constraints.items())}]
        for k in C.get_all_opkernel_def()
        if k.provider == "CPUExecutionProvider"
    ]


@functools.cache
def cpu_kernels() -> tuple[Table, str]:
    """The CPU EP's kernels, and where they were read."""
    import onnxruntime as ort

    here = f"onnxruntime {ort.__version__}'s own table"
    if set(ort.get_available_providers()) <= _BUILT_IN:
        return _table(cpu_kernel_rows()), here
    rows, why = _rows_in_child()
    if rows is not None:
        return _table(rows), here + " (read in a child process)"
    doc = json.loads(CPU_KERNELS_FILE.read_text(encoding="utf-8"))
    logger.warning(
        "onnxruntime %s could not list its CPU kernels (%s); the CPU EP's placement comes from fp8onnx's copy of "
        "the table (%s), which may differ from this build's",
        ort.__version__,
        why,
        doc["source"],
    )
    return _table([(k["domain"], k["op"], k["since"], k["until"], k["constraints"]) for k in doc["kernels"]]), (
        doc["source"] + f" (this install's onnxruntime {ort.__version__} could not list its own)"
    )


def _rows_in_child() -> tuple[list | None, str]:
    """(the rows :data:`_CHILD` printed as JSON in a child Python, or None; why not)."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=_CHILD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"a child process asking for them failed: {exc}"
    if done.returncode == 0:
        try:
            return json.loads(done.stdout), ""
        except ValueError:
            return None, "a child process asking for them printed no table"
    ended = f"exit code {done.returncode}"
    if done.returncode < 0:
        try:
            ended = signal.Signals(-done.returncode).name
        except ValueError:
            pass
    last = onnxruntime_reason(done.stderr)
    return None, f"asked in a child process, it ended with {ended}" + (f" after {last}" if last else "")


@functools.cache
def cuda_kernels() -> tuple[Table, str]:
    """The CUDA EP's kernels from :data:`CUDA_KERNELS_FILE`, and where they were read."""
    doc = json.loads(CUDA_KERNELS_FILE.read_text(encoding="utf-8"))
    table: Table = collections.defaultdict(list)
    for k in doc["kernels"]:
        constraints = tuple((p, frozenset(t)) for p, t in sorted((k.get("constraints") or {}).items()))
        kernel = Kernel(domain_of(k["domain"]), k["op"], k["since"], k["until"] or OPEN, constraints, k.get("type"))
        table[kernel.domain, kernel.op].append(kernel)
    return dict(table), doc["source"]
