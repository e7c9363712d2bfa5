"""Temporary folders of one job: removed when the job ends (``with scratch():``), or at exit where
no job is open. Weights moved out of a single-file model and GPTQ's rounded weights live there
until the model is written."""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import shutil
import tempfile

__all__ = ["scratch", "scratch_folder"]

_OPEN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("fp8onnx_scratch", default=None)


@contextlib.contextmanager
def scratch():
    """Remove every folder :func:`scratch_folder` made inside this block when it ends."""
    folders: list[str] = []
    token = _OPEN.set(folders)
    try:
        yield
    finally:
        _OPEN.reset(token)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def scratch_folder(prefix: str) -> str:
    """A new temporary folder (in TMPDIR) for the open job, or until exit."""
    folder = tempfile.mkdtemp(prefix=prefix)
    folders = _OPEN.get()
    if folders is not None:
        folders.append(folder)
    else:
        atexit.register(shutil.rmtree, folder, True)
    return folder
