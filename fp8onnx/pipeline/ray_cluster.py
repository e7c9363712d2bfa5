"""Reaching a Ray cluster (or starting a local one) and reading its failures: what
:mod:`fp8onnx.pipeline.distributed`'s pools and tasks stand on."""

from __future__ import annotations

import logging
import os
import signal
import threading

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.graph.run_settings import RAY_TIMEOUT

__all__ = ["cause", "connect", "lost_errors", "probe", "threads_per_worker"]

logger = logging.getLogger(__name__)

# Ray's core worker installs absl's failure signal handler, SIGTERM included, and on ray.shutdown() sets
# SIGTERM's action back to the default: a SIGTERM during the seconds a local Ray takes to shut down then
# killed the process (-15) instead of reaching fp8onnx's handler (143, nothing left behind). Ray reads this
# when it is imported, so it is set before fp8onnx imports Ray (a local Ray's processes inherit it).
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


def probe(address: str, timeout: float) -> None:
    """One clear sentence, within ``timeout`` seconds, when nothing answers at a cluster's address (Ray
    itself retries its GCS connection for minutes). ``auto``/``local`` and names Ray resolves itself
    are left to it."""
    import socket

    host_port = address.split("://", 1)[-1]
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise Fp8OnnxError(
            f"Nothing answers at the Ray address {address!r} within {timeout:g} s ({exc.strerror or exc}): "
            "is the cluster running (ray start --head), and is that its address? (--ray-timeout sets the wait.)"
        ) from exc


def connect(workers: int, address: str | None, timeout: float = RAY_TIMEOUT) -> bool:
    """Connect to ``address``, or start a local Ray; True when this call started one. The caller's
    SIGTERM/SIGINT handlers stay (ray.init installs one that exits with code 15 mid-run)."""
    import ray

    if address:
        probe(address, timeout)
    if ray.is_initialized():
        return False
    kwargs = {"address": address} if address else {"num_cpus": max(workers, os.cpu_count() or 1)}
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    stopped = None
    # Ray's own notices (e.g. on token authentication of the local cluster) are not the user's business
    try:
        ray.init(**kwargs, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    except SystemExit as exc:  # Ray's SIGTERM handler, while connecting
        if exc.code != signal.SIGTERM:
            raise
        stopped = signal.SIGTERM
    except Exception as exc:  # no cluster there, or a local one that cannot start
        logger.debug("ray.init failed", exc_info=True)
        where = f"the Ray cluster at {address!r}" if address else "a local Ray"
        hint = ""
        if "AF_UNIX path length" in str(exc):
            hint = " (a local Ray's sockets live under TMPDIR or RAY_TMPDIR: set RAY_TMPDIR to a short path, e.g. /tmp)"
        raise Fp8OnnxError(f"Could not start or reach {where}: {first_line(exc)}{hint}") from exc
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    if stopped is not None:  # the caller's handler gets it (the CLI: exit 143, nothing left behind)
        os.kill(os.getpid(), stopped)
    return not address


def threads_per_worker(workers: int, address: str | None) -> int:
    """onnxruntime threads per worker: this machine's cores shared; on a cluster, one per actor
    (each asks Ray for what it uses, so a cluster's cores are filled by more workers)."""
    return 1 if address else max(1, (os.cpu_count() or 1) // workers)


def lost_errors(ray) -> tuple[type[BaseException], ...]:
    """Ray's errors for a worker or node that went away (not for a batch that failed)."""
    e = ray.exceptions
    return (e.RayActorError, e.NodeDiedError, e.ObjectLostError)


def cause(exc: Exception) -> str:
    """The user-facing sentence inside a Ray error (an Fp8OnnxError raised in the worker, else the
    last line of the remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, Fp8OnnxError):
        return str(cause)
    text = str(cause or exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
