"""Scale-out on Ray: the batches of a run spread over actors that each hold one onnxruntime session.

requires: Ray (the ``[ray]`` extra); a running cluster (``ray start``, KubeRay) for ``address``, or
none for a local one on this machine. ensures: every batch's result comes back to the caller in
batch order, whichever worker computed it, so that a reduction in that order gives the
single-process answer bit for bit; a worker that dies is restarted (with its session) and its
batch rerun, up to ``RETRIES`` times; a batch whose worker was lost with its node runs again on a
live worker (a new actor takes the lost one's place). Actors reserve their onnxruntime threads as
CPUs and are spread over the nodes.

The work of a batch is a module-level function ``task(session, *args)`` - the same one the
single-process path calls, so the two paths cannot drift apart. Only small per-batch summaries
(amax scalars, histogram counts, metric sums) travel back to the caller; a model travels once per
worker (through Ray's object store, or as a path on a local run), and large per-batch arrays can
stay in the object store as references (``keep``).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.graph.run_settings import RAY_TIMEOUT, check_ray
from fp8onnx.graph.runtime import portable_model, worker_session
from fp8onnx.pipeline.ray_cluster import cause, connect, lost_errors, threads_per_worker

__all__ = [
    "RETRIES",
    "WorkerPool",
    "close_all",
    "fetch",
    "remote_tasks",
    "shared_pool",
    "statistics_pool",
]

logger = logging.getLogger(__name__)
RETRIES = 3  # restarts of a dead worker, and reruns of the batch it held
_IN_FLIGHT = 2  # batches queued per worker: one running, one waiting
_NODE_CHECK_S = 5.0  # on a cluster, when no batch finished for this long, the workers' nodes are checked


class _Worker:
    """A Ray actor holding one onnxruntime session at a time."""

    def __init__(self) -> None:
        self.session: object | None = None  # make's: an onnxruntime session
        self.model: str | None = None  # the key of the model the session is of

    def load(self, key: str, model, make: Callable, args: tuple) -> None:
        """Build the session for ``model`` (bytes, their object-store reference, or a path) with
        ``make(model, *args)``, unless this worker holds it already."""
        if key != self.model:
            if type(model).__name__ == "ObjectRef":
                import ray

                model = ray.get(model)
            self.session = None  # one session at a time: the old one goes first
            self.session, self.model = make(model, *args), key

    def run(self, model: tuple, task: Callable, *args):
        """``task(session, *args)``; ``model`` is the :meth:`load` arguments, so that a worker Ray
        restarted (which starts without a session) builds it again before rerunning the batch."""
        self.load(*model)
        return task(self.session, *args)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def remote_tasks(
    fn: Callable, calls: list[tuple], *, workers: int, address: str | None = None, timeout: float = RAY_TIMEOUT
) -> Iterator[object]:
    """``fn(*call)`` for every call as independent Ray tasks (at most ``workers`` at once on a local
    Ray), results in call order. A task whose worker died is rerun (``RETRIES`` times); one that
    still fails gives ``{"error": ...}`` instead of ending the others."""
    check_ray(max(workers, 2), address)
    import ray

    started = connect(workers, address, timeout)
    try:
        remote = ray.remote(num_cpus=threads_per_worker(workers, address), max_retries=RETRIES)(fn)
        refs = [remote.remote(*call) for call in calls]
        for ref in refs:
            try:
                yield ray.get(ref)
            except ray.exceptions.RayError as exc:
                yield {"error": f"the Ray task failed: {cause(exc)}"}
    finally:
        if started:
            ray.shutdown()


class WorkerPool:
    """``workers`` Ray actors; :meth:`load` gives each a session of one model, :meth:`map` runs a
    task per batch on them. Use as a context manager: the actors end with it, and a local Ray
    started here is shut down."""

    def __init__(
        self, *, workers: int, address: str | None = None, threads: int | None = None, timeout: float = RAY_TIMEOUT
    ) -> None:
        check_ray(max(workers, 2), address)
        import ray

        self._ray = ray
        self.local = not address
        self._started = connect(workers, address, timeout)
        self.threads = threads_per_worker(workers, address) if threads is None else threads
        # Each actor reserves the cores its session uses, so Ray spreads them over the nodes (with the
        # default of no CPU reserved while running, every actor could land on one 1-CPU node).
        self._actor = ray.remote(
            num_cpus=self.threads, max_restarts=RETRIES, max_task_retries=RETRIES, scheduling_strategy="SPREAD"
        )(_Worker)
        self.timeout = timeout
        self.workers = [self._actor.remote() for _ in range(workers)]
        # A worker takes batches once Ray has placed it (its node known); one the cluster has no room for
        # joins when it has, and a run never waits on it while another worker is placed.
        self._nodes: list[str | None] = [None] * workers
        self._placing = {w: actor.node.remote() for w, actor in enumerate(self.workers)}
        self._placed(self.timeout, every=True)
        self._keep: list[object] = []  # object-store references the loaded models need while the actors live
        self._model: tuple[str, object, Callable, tuple] | None = None  # (key, model, make, args): load's
        self.replaced = 0  # workers replaced after their node was lost
        self.shared = False
        logger.info("%d Ray workers, %d onnxruntime threads each", workers, self.threads)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        if not self.shared:
            self.close()

    def close(self) -> None:
        for w in self.workers:
            self._ray.kill(w)
        self.workers, self._keep, self._placing = [], [], {}
        if self._started:
            self._ray.shutdown()

    def put(self, value):
        """``value`` in the object store (a reference any worker can read)."""
        return self._ray.put(value)

    def get(self, ref):
        """The value behind an object-store reference (``put``'s, or a task's kept result)."""
        return self._ray.get(ref)

    def load(self, model, make: Callable, *args) -> None:
        """Every worker builds ``make(model, *args, threads)`` (``model``: bytes, or a path that every
        worker can read). A worker that holds the same model (same bytes, or the same unchanged file)
        with the same arguments keeps its session."""
        if isinstance(model, (bytes, tuple)):  # serialized, or runtime.portable_model's (graph, weights)
            key = _digest(model)
            model = self._ray.put(model)
            self._keep.append(model)
        else:
            st = os.stat(model)
            key = f"{os.path.abspath(model)}:{st.st_size}:{st.st_mtime_ns}"
        key = f"{key}:{make.__module__}.{make.__qualname__}{args!r}"
        loaded = self._model = (key, model, make, (*args, self.threads))
        placed = [self.workers[w] for w in self._placed(0)]  # the others load with their first batch
        try:
            self._ray.get([w.load.remote(*loaded) for w in placed])
        except self._ray.exceptions.RayError as exc:  # e.g. the model does not load in onnxruntime
            raise Fp8OnnxError(cause(exc)) from exc

    def map(self, task: Callable, items: Iterable[tuple], *, keep: bool = False) -> Iterator[object]:
        """``task(session, *item)`` for each item, results in item order; at most ``_IN_FLIGHT``
        items per worker are queued, so the items are produced as fast as the workers use them.
        With ``keep``, the task returns (small, large) and this yields (small, a reference to large):
        the large part stays in the object store, for later tasks to take as an argument."""
        ray = self._ray
        pending: dict[object, tuple] = {}  # reference -> (index, worker, large, item, tries)
        done: dict[int, object] = {}
        load = [0] * len(self.workers)
        items = iter(items)
        next_index = next_out = 0
        exhausted = False
        while True:
            while not exhausted and len(pending) < _IN_FLIGHT * len(self.workers):
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                self._submit(pending, load, task, item, next_index, keep, 0)
                next_index += 1
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
            if not pending:
                if exhausted:
                    return
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_NODE_CHECK_S)
            if not ready:  # nothing finished for a while: are the workers' nodes still there?
                self._resubmit_from_lost_nodes(pending, load, task, keep)
            for ref in ready:
                index, worker, large, item, tries = pending.pop(ref)
                load[worker] -= 1
                try:
                    done[index] = (ray.get(ref), large) if keep else ray.get(ref)
                except lost_errors(ray) as exc:
                    # the worker (or its node) was lost, not the batch: a batch is pure, so it runs again
                    # on a live worker and gives the same result
                    if tries >= RETRIES:
                        logger.debug("Ray: %s", exc)
                        raise Fp8OnnxError(
                            f"Batch {index} was lost with its Ray worker {tries + 1} times (a node or worker "
                            "keeps failing); run with --debug for Ray's account."
                        ) from exc
                    logger.warning("batch %d: its Ray worker was lost; running it again on a live one", index)
                    logger.debug("Ray: %s", exc)
                    self._replace_if_dead(worker)
                    self._submit(pending, load, task, item, index, keep, tries + 1)
                except ray.exceptions.RayError as exc:
                    raise Fp8OnnxError(f"Batch {index} failed on a Ray worker: {cause(exc)}") from exc

    def _placed(self, timeout: float, every: bool = False) -> list[int]:
        """The workers Ray has placed. Those still being placed are polled; when none is placed yet (with
        ``every``: until all are) this waits up to ``timeout`` seconds. One sentence when none is."""
        ray = self._ray
        if self._placing:
            refs = {ref: w for w, ref in self._placing.items()}
            if every:
                ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
            elif all(node is None for node in self._nodes):
                ray.wait(list(refs), num_returns=1, timeout=timeout)
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in ready:
                w = refs[ref]
                del self._placing[w]
                try:
                    self._nodes[w] = ray.get(ref)
                except ray.exceptions.RayError as exc:  # it died before it started: a new one is placed
                    logger.debug("Ray: a worker did not start: %s", exc)
                    self._replace(w)
        placed = [w for w, node in enumerate(self._nodes) if node is not None]
        if not placed:
            raise Fp8OnnxError(
                f"No Ray worker could be placed within {self.timeout:g} s: the cluster has no free room for an "
                f"actor reserving {self.threads} CPU(s) (ray status shows its resources; --ray-timeout sets the wait)."
            )
        if every and self._placing:
            logger.warning(
                "%d of %d Ray workers placed within %g s (the cluster has no room for the others); they join when "
                "it has",
                len(placed),
                len(self.workers),
                timeout,
            )
        return placed

    def _submit(self, pending: dict, load: list, task: Callable, item: tuple, index: int, keep: bool, tries: int):
        placed = self._placed(self.timeout)
        worker = min(placed, key=lambda w: (load[w], w))  # the least busy
        load[worker] += 1
        call = self.workers[worker].run
        if keep:
            ref, large = call.options(num_returns=2).remote(self._model, task, *item)
        else:
            ref, large = call.remote(self._model, task, *item), None
        pending[ref] = (index, worker, large, item, tries)

    def _resubmit_from_lost_nodes(self, pending: dict, load: list, task: Callable, keep: bool) -> None:
        """Ray may never resolve a batch whose worker's node was removed: the workers on nodes the
        cluster no longer lists as alive are replaced, and their batches run again on live ones."""
        ray = self._ray
        if self.local:
            return
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        lost = [w for w, node in enumerate(self._nodes) if node is not None and node not in alive]
        for w in lost:
            logger.warning("a Ray node was lost: its worker is replaced and its batches run again")
            self._replace(w)
        for ref, (index, worker, _large, item, tries) in list(pending.items()):
            if worker in lost:
                pending.pop(ref)
                load[worker] -= 1
                self._submit(pending, load, task, item, index, keep, tries + 1)

    def _replace(self, worker: int) -> None:
        try:
            self._ray.kill(self.workers[worker])
        except Exception:  # already gone
            logger.debug("Ray: killing a lost worker", exc_info=True)
        self.workers[worker] = self._actor.remote()
        self._nodes[worker] = None  # takes batches once placed (never waited on while another is)
        self._placing[worker] = self.workers[worker].node.remote()
        self.replaced += 1

    def _replace_if_dead(self, worker: int) -> None:
        """A new actor in place of one that does not answer (its node is gone); it loads the model when
        its first batch comes (``_Worker.run``)."""
        ray = self._ray
        try:
            ray.get(self.workers[worker].pid.remote(), timeout=10)
            return  # restarted by Ray, or it was only the batch's object that was lost
        except (ray.exceptions.RayError, TimeoutError):
            pass
        self._replace(worker)


def _digest(model) -> str:
    """What identifies a model's content: its bytes, or a portable model's graph and weights (file
    locations, or the arrays themselves)."""
    h = hashlib.sha256()
    if isinstance(model, bytes):
        h.update(model)
        return h.hexdigest()
    graph, where = model
    h.update(graph)
    for name in sorted(where):
        w = where[name]
        h.update(name.encode())
        h.update(repr(w).encode() if isinstance(w, tuple) else w.tobytes())
    return h.hexdigest()


_SHARED: dict[tuple[int, str | None], WorkerPool] = {}


def shared_pool(workers: int, address: str | None, timeout: float = RAY_TIMEOUT) -> WorkerPool:
    """One pool per (workers, address) for the whole process: calibration, every evaluation of a
    study and each round of the fallback search reuse the same actors (starting them costs seconds).
    ``with shared_pool(...) as pool`` leaves them running; :func:`close_all` ends them."""
    key = (workers, address)
    pool = _SHARED.get(key)
    if pool is None or not pool.workers:
        pool = _SHARED[key] = WorkerPool(workers=workers, address=address, timeout=timeout)
        pool.shared = True
        atexit.register(pool.close)
    return pool


def close_all() -> None:
    """End every shared pool (and a local Ray they started)."""
    while _SHARED:
        _SHARED.popitem()[1].close()


def fetch(session, outputs: list[str], feed: dict, reduce: Callable | None, what: str):
    """One batch on a worker: ``outputs`` of the session on ``feed``, as ``{name: array}`` reduced by
    ``reduce`` (a module-level function: it travels by reference), or the list of arrays."""
    try:
        values = session.run(outputs, feed)
    except Exception as exc:
        raise Fp8OnnxError(f"{what} failed in onnxruntime: {first_line(exc)}") from exc
    return values if reduce is None else reduce(dict(zip(outputs, values)))


def statistics_pool(run, model, what: str) -> WorkerPool:
    """The shared pool of ``run``'s workers, each holding a session of ``model``: an instrumented
    ``ir.Model`` (a statistics graph: priority-based order, no arena), sent as
    :func:`fp8onnx.graph.runtime.portable_model`."""
    pool = shared_pool(run.workers, run.ray_address, run.ray_timeout)
    pool.load(portable_model(model, files=pool.local), worker_session, run.provider, what)
    return pool
