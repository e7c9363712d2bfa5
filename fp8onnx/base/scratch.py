"""Every temporary file and folder fp8onnx makes, in one registry that normal exit and a stopping
signal both drain, so that a run stopped at any moment leaves nothing behind.

A path is made and registered with SIGINT, SIGTERM and SIGHUP held (:func:`held_signals`), and
removed and forgotten the same way: a signal that arrives in between is delivered right after, when
the registry already says what exists. Code removes its own paths when it is done (``remove``, or
``forget`` once a temporary was renamed into place); whatever an interrupted run left registered is
removed by :func:`drain` (the CLI calls it before it exits; ``atexit`` otherwise).

``with scratch():`` keeps the folders :func:`scratch_folder` makes for one job (weights moved out of a
single-file model, GPTQ's rounded weights) until the job ends.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import shutil
import signal
import tempfile
import threading

__all__ = [
    "drain",
    "forget",
    "held_signals",
    "make_dir",
    "make_file",
    "remove",
    "scratch",
    "scratch_folder",
    "temporary_dir",
]

_LIVE: dict[str, bool] = {}  # path -> whether it is a folder
_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_OPEN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("fp8onnx_scratch", default=None)


@contextlib.contextmanager
def held_signals():
    """The stopping signals wait while the registry and the disk change together. In the main thread
    their Python handlers are swapped for one that notes them (a signal the OS delivered just before
    is still pending in Python: swapping the mask alone would let it raise inside the block), then
    each noted one is sent again; other threads block them in their mask."""
    if threading.current_thread() is not threading.main_thread():
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return
    noted: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum)) for sig in _HELD}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in noted:
            os.kill(os.getpid(), sig)


def make_dir(prefix: str, dir: str | os.PathLike | None = None) -> str:
    """``tempfile.mkdtemp``, registered."""
    with held_signals():
        path = tempfile.mkdtemp(prefix=prefix, dir=dir)
        _LIVE[path] = True
    return path


def make_file(prefix: str, suffix: str = "", dir: str | os.PathLike | None = None) -> tuple[int, str]:
    """``tempfile.mkstemp``, registered: (open descriptor, path)."""
    with held_signals():
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=dir)
        _LIVE[path] = False
    return fd, path


@contextlib.contextmanager
def temporary_dir(prefix: str, dir: str | os.PathLike | None = None):
    """``tempfile.TemporaryDirectory``, registered: the folder's path, removed when the block ends."""
    path = make_dir(prefix, dir)
    try:
        yield path
    finally:
        remove(path)


def remove(path: str | os.PathLike) -> None:
    """Remove a registered path (whatever of it is left) and forget it."""
    path = os.fspath(path)
    with held_signals():
        folder = _LIVE.pop(path, os.path.isdir(path))
        if folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(path)


def forget(path: str | os.PathLike) -> None:
    """Stop tracking a path that is no longer temporary (renamed into place)."""
    with held_signals():
        _LIVE.pop(os.fspath(path), None)


def drain() -> list[str]:
    """Remove every registered path; returns them (what an interrupted run had left)."""
    with held_signals():  # a second Ctrl-C waits until everything is gone
        left = list(_LIVE)
        for path in left:
            remove(path)
    return left


atexit.register(drain)


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
            remove(folder)


def scratch_folder(prefix: str) -> str:
    """A new temporary folder (in TMPDIR) for the open job, or until exit."""
    folder = make_dir(prefix)
    folders = _OPEN.get()
    if folders is not None:
        folders.append(folder)
    return folder
