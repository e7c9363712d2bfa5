"""Scale-out on Ray: the batches of a statistics run spread over actors that each hold one session.

requires: Ray (the ``[ray]`` extra); a running cluster (``ray start``, KubeRay) for ``address``, or
none for a local one on this machine. ensures: every batch's result comes back to the caller in
batch order, whichever worker computed it, so that a reduction in that order gives the
single-process answer bit for bit; a worker that dies is restarted and its batch rerun
(``RETRIES`` times).

The work of each batch is a plain function of (session, feed) - :func:`run_batch` -, the same one
the single-process path calls, so the two paths cannot drift apart. Only small per-batch summaries
(amax scalars, histogram counts) travel back; the model travels once, through Ray's object store.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from .errors import Fp8OnnxError

__all__ = ["RETRIES", "WorkerPool", "check_ray", "run_batch"]

logger = logging.getLogger(__name__)
RETRIES = 3  # restarts of a dead worker, and reruns of the batch it held
_IN_FLIGHT = 2  # batches queued per worker: one running, one waiting


def check_ray(workers: int, address: str | None) -> None:
    """A clear sentence when Ray is asked for and not installed."""
    if (workers > 1 or address) and importlib.util.find_spec("ray") is None:
        raise Fp8OnnxError("--workers/--ray need Ray: pip install 'fp8onnx[ray]'.")


def run_batch(session, outputs: list[str], feed: dict, summarize: Callable) -> object:
    """One batch: run ``session`` for ``outputs`` and reduce them with ``summarize(dict)``."""
    return summarize(dict(zip(outputs, session.run(outputs, feed))))


class _Worker:
    """A Ray actor: one onnxruntime session, built once from the serialized model."""

    def __init__(self, model: bytes, provider: str, what: str, threads: int, make) -> None:
        self.session = make(model, provider, what, threads)

    def run(self, index: int, outputs: list[str], feed: dict, summarize: Callable) -> tuple[int, object]:
        return index, run_batch(self.session, outputs, feed, summarize)

    def pid(self) -> int:
        return os.getpid()


class WorkerPool:
    """``workers`` Ray actors, each holding a session of the same serialized model.

    ``make(model_bytes, provider, what, threads)`` builds the session inside the actor (a
    module-level function, so that Ray ships it by reference). Use as a context manager; the actors
    end with it, and a local Ray started here is shut down."""

    def __init__(
        self,
        model: bytes,
        make: Callable,
        *,
        workers: int,
        address: str | None = None,
        provider: str = "cpu",
        what: str = "model",
        threads: int | None = None,
    ) -> None:
        check_ray(max(workers, 2), address)
        import ray

        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            # Ray's C++ warnings (e.g. about restartable actors' arguments) are not the user's business
            os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
            kwargs = {"address": address} if address else {"num_cpus": max(workers, os.cpu_count() or 1)}
            ray.init(**kwargs, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
            self._started = not address
        if threads is None:  # share this machine's cores; on a cluster each actor asks for what it uses
            threads = 1 if address else max(1, (os.cpu_count() or 1) // workers)
        actor = ray.remote(num_cpus=threads, max_restarts=RETRIES, max_task_retries=RETRIES)(_Worker)
        self._model = ray.put(model)  # held while the actors live: a restarted one rebuilds from it
        self.workers = [actor.remote(self._model, provider, what, threads, make) for _ in range(workers)]
        logger.info("%d Ray workers, %d onnxruntime threads each", workers, threads)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            self._ray.kill(w)
        self.workers = []
        if self._started:
            self._ray.shutdown()

    def map(self, outputs: list[str], feeds: Iterable[dict], summarize: Callable) -> Iterator[object]:
        """``summarize`` of each feed's outputs, in feed order; at most ``_IN_FLIGHT`` batches per
        worker are queued, so the feeds are read as fast as the workers use them."""
        ray = self._ray
        pending, done = {}, {}
        load = [0] * len(self.workers)
        feeds = iter(feeds)
        next_index = next_out = 0
        exhausted = False
        while True:
            while not exhausted and len(pending) < _IN_FLIGHT * len(self.workers):
                feed = next(feeds, None)
                if feed is None:
                    exhausted = True
                    break
                worker = min(range(len(self.workers)), key=lambda w: (load[w], w))  # the least busy
                load[worker] += 1
                ref = self.workers[worker].run.remote(next_index, outputs, feed, summarize)
                pending[ref] = (next_index, worker)
                next_index += 1
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
            if not pending:
                if exhausted:
                    return
                continue
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                index, worker = pending.pop(ref)
                load[worker] -= 1
                try:
                    _, result = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise Fp8OnnxError(f"Batch {index} failed on a Ray worker: {_cause(exc)}") from None
                done[index] = result


def _cause(exc: Exception) -> str:
    """The user-facing sentence inside a Ray error (an Fp8OnnxError raised in the worker, else the
    first line)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, Fp8OnnxError):
        return str(cause)
    text = str(cause or exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
