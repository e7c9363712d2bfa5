"""Whether onnxruntime's CUDA EP really starts in this process, and if not, onnxruntime's reason.

onnxruntime-gpu lists ``CUDAExecutionProvider`` among its available providers whether or not its CUDA
libraries load. A session asked for CUDA then comes up on the CPU EP alone and says why only on stderr
("Failed to load library .../libonnxruntime_providers_cuda.so with error: libcublasLt.so.13: cannot open
shared object file"). So the first session that asks for CUDA is a probe: a graph without nodes, its
``get_providers()`` read, onnxruntime's log caught. Where CUDA does not come up, the probe asks
``onnxruntime.preload_dlls()`` to load the CUDA and cuDNN libraries of the ``nvidia-*`` wheels that
``onnxruntime-gpu[cuda,cudnn]`` installs (its CUDA provider library has no search path to them), and tries
once more. The answer is kept for the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import io
import logging
import os
import pathlib
import re
import sys
import tempfile

import onnxruntime as ort

from fp8onnx.base.errors import Fp8OnnxError, first_line

__all__ = [
    "CPU",
    "CUDA",
    "GPU_INSTALL",
    "auto_provider",
    "cuda_unavailable",
    "install_hint",
    "onnxruntime_reason",
    "require_cuda",
]

logger = logging.getLogger(__name__)
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
GPU_INSTALL = "pip install 'fp8onnx[gpu]'"


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _probe_model() -> bytes:
    """A model whose graph passes its input through, without a node: enough to start the providers."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([], "fp8onnx-provider-probe", [x], [x])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@contextlib.contextmanager
def _caught_output():
    """What onnxruntime writes to the process's stderr (its C++ log) and Python's stdout (preload_dlls'
    print) meanwhile, in the yielded list's one string once the block ends."""
    caught: list[str] = []
    with tempfile.TemporaryFile() as log, contextlib.redirect_stdout(io.StringIO()) as printed:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to catch (a detached process)
            saved = None
        if saved is not None:
            os.dup2(log.fileno(), 2)
        try:
            yield caught
        finally:
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            caught.append(log.read().decode(errors="replace") + "\n" + printed.getvalue())


def _starts(model: bytes) -> tuple[bool, str]:
    """(whether a session asked for CUDA got it, what onnxruntime said meanwhile)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    with _caught_output() as said:
        try:
            session = ort.InferenceSession(model, options, providers=[CUDA, CPU])
            up, error = CUDA in session.get_providers(), ""
        except Exception as exc:  # the CUDA EP's constructor throws, e.g. without a device
            up, error = False, first_line(exc)
    return up, (error + "\n" + said[0]).strip()


@functools.cache
def cuda_unavailable() -> str | None:
    """None where a session asked for the CUDA EP gets it in this process; otherwise why not, in
    onnxruntime's words where it gave any (one clause)."""
    if CUDA not in ort.get_available_providers():
        if _distribution("onnxruntime") and _distribution("onnxruntime-gpu"):
            return "onnxruntime and onnxruntime-gpu are both installed, one module, and the CPU build's files won"
        return f"this onnxruntime ({_installed_build()}) has no CUDA EP"
    model = _probe_model()
    up, said = _starts(model)
    if not up and hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21: the nvidia-* wheels' libraries
        with _caught_output(), contextlib.suppress(Exception):  # it prints what it could not load
            ort.preload_dlls()
        up, said = _starts(model)
    return None if up else onnxruntime_reason(said) or _library_error() or "onnxruntime gave no reason"


def _installed_build() -> str:
    names = [f"{n} {v}" for n in ("onnxruntime", "onnxruntime-gpu") if (v := _distribution(n))]
    return ", ".join(names) or f"onnxruntime {ort.__version__}"


def _library_error() -> str:
    """The error of loading the CUDA provider library here (a library it needs that is missing)."""
    library = pathlib.Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if not library.exists():
        return ""
    try:
        ctypes.CDLL(str(library))
    except OSError as exc:
        return f"{library.name}: {first_line(exc)}"
    return ""


def onnxruntime_reason(log: str) -> str:
    """The telling part of what onnxruntime logged: a library that failed to load (which, and why), an
    exception's first line, else the last line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in log.splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if (m := re.search(r"Failed to load library (\S+) with error: (.*)", line)) is not None:
            return f"{pathlib.Path(m[1]).name}: {m[2].strip()}"
    return lines[0][-300:] if lines else ""


def install_hint(reason: str) -> str:
    """What fixes a CUDA EP that does not start for ``reason`` (:func:`cuda_unavailable`'s), as a clause."""
    gpu = _distribution("onnxruntime-gpu")
    if "both installed" in reason:
        return f"pip uninstall -y onnxruntime onnxruntime-gpu && {GPU_INSTALL}"
    if gpu is None:
        return f"install the GPU build instead: pip uninstall -y onnxruntime && {GPU_INSTALL}"
    if "libcuda.so" in reason:
        return "the NVIDIA driver provides libcuda.so.1, not pip: this machine has no usable GPU driver"
    if "cannot open shared object file" in reason or "Failed to load" in reason:
        extras = f"pip install 'onnxruntime-gpu[cuda,cudnn]=={gpu}'"
        return f"install its CUDA libraries: {extras} (what {GPU_INSTALL} brings)"
    return "check that the GPU and its driver are visible to this process (nvidia-smi, CUDA_VISIBLE_DEVICES)"


def require_cuda() -> str:
    """'cuda', where the CUDA EP starts; otherwise the sentence saying why not and what fixes it."""
    missing = cuda_unavailable()
    if missing is not None:
        raise Fp8OnnxError(
            f"Provider 'cuda' was asked for, but onnxruntime {ort.__version__} cannot start its CUDA EP here "
            f"({missing}); {install_hint(missing)}."
        )
    return "cuda"


@functools.cache
def auto_provider() -> str:
    """--provider auto's choice ('cuda' where the CUDA EP starts, else 'cpu'), said once a process."""
    missing = cuda_unavailable()
    if missing is None:
        logger.info("--provider auto: onnxruntime's CUDA EP")
        return "cuda"
    if CUDA in ort.get_available_providers() or "both installed" in missing:
        logger.warning(
            "--provider auto: onnxruntime %s cannot start its CUDA EP here (%s); running on the CPU EP. For the "
            "GPU, %s",
            ort.__version__,
            missing,
            install_hint(missing),
        )
    else:
        logger.info("--provider auto: the CPU EP (%s)", missing)
    return "cpu"
