"""How ``compare`` runs the models over the data: in this process (the reference's outputs spilled to disk,
one model at a time; or, where those outputs would not fit the free disk, every model beside the reference
batch by batch) or on Ray workers; the FP16 baseline's session; the FP32 reference run once for every round
of a search (:class:`ReferenceRun`)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import pathlib
import shutil
import time
from collections.abc import Callable

import numpy as np
import onnx

from fp8onnx.accuracy.compare_results import _REFERENCE, _row
from fp8onnx.accuracy.metrics import _label_output, _OutputStats, _Score, _score, labelled
from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.base.progress import progress_bar
from fp8onnx.data.datasource import DataSource
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.graph.runtime import available_memory, make_session, portable_model, session_for_model
from fp8onnx.passes import ConvertFloat16Pass
from fp8onnx.pipeline.segments import Spill

logger = logging.getLogger(__name__)


def _no_fp16(exc: Fp8OnnxError, notes: list[str]) -> None:
    # The baseline is ours, not the user's: without it, report against FP32 only.
    notes.append(f"No FP16 baseline: {exc} Results are against FP32 only.")
    logger.warning("%s", notes[-1])


@dataclasses.dataclass
class _Evaluation:
    """What one compare run evaluates, and how: the executors' one argument."""

    reference: pathlib.Path
    models: dict  # name -> (path or None, builder of its session)
    source: DataSource  # fp8onnx.data.datasource.as_data's data source
    out_names: list[str]
    total: int | None  # batches expected (progress bars)
    max_samples: int | None
    run: RunOptions  # its provider resolved ("cpu", "cuda"); batch and progress bars from it too
    notes: list[str]  # appended to: why there is no FP16 row, ...
    memory: bool  # measure each session's heap
    classes: frozenset = frozenset()  # outputs whose top-1 agreement is measured
    open_reference: Callable[[], object] | None = None  # the reference's session; None: from its file

    def reference_session(self):
        if self.open_reference is not None:
            return self.open_reference()
        what = f"Reference model {str(self.reference)!r}"
        return make_session(pathlib.Path(self.reference), self.run.provider, what, arena=False)


# The reference's outputs wait on disk only while they leave this share of the disk's free space (and
# SPILL_MARGIN bytes) free: a language model's logits over a whole benchmark (SmolLM2-135M on LAMBADA's
# 5,153 items: about 100 GB) go batch by batch beside the other models instead (_evaluate_lockstep).
SPILL_SHARE = 0.8
SPILL_MARGIN = 1 << 30
# A session beside the others holds about this many times the reference's file (Gemma 3 270M's five models
# and reference side by side on HellaSwag: 13-16 GB for a 1.6 GB reference, ~1.6x a session)
SESSION_SHARE = 1.6


class _TooBigToSpill(Exception):
    """The reference's outputs over the data would not fit the spill's share of the free disk."""


def _evaluate_here(job: _Evaluation, cache: ReferenceRun | None = None):
    """One model at a time in this process: the reference's outputs (and the inputs) wait on disk and
    are read back batch by batch for each other model, so memory holds one session; where they would not
    fit the free disk, every model runs beside the reference instead (:func:`_evaluate_lockstep`).
    ``cache``: the reference's pass is kept there, or taken from there when it is."""
    reference, out_names, classes, progress = job.reference, job.out_names, job.classes, job.run.progress
    done = cache if cache is not None else ReferenceRun()
    if not done.batches:
        try:
            _reference_pass(done, job)
        except _TooBigToSpill as big:
            return _evaluate_lockstep(job, str(big))
    spill, scored, batches, label_out = done.spill, done.labelled, done.batches, done.label_out
    feed_names = done.feed_names
    if spill is None or done.score is None:
        raise Fp8OnnxError(f"The reference run of {str(reference)!r} was closed; it has no outputs to compare.")
    try:
        rows = [_row(_REFERENCE, str(reference), done.score, scored)]
        rows[0].latency_ms, rows[0].session_mib = done.cost
        for name, (path, build) in job.models.items():
            try:
                cost = _Cost(job.memory)
                session = build()
                total_score = _Score({o: _OutputStats() for o in out_names})
                for b in progress_bar(range(batches), total=batches, desc=name, unit="batch", enable=progress):
                    feed = {k: spill.load(f"in/{k}", b) for k in feed_names}
                    labels = None if label_out is None else spill.load("labels", b)
                    ref = [spill.load(f"out/{o}", b) for o in out_names]
                    with cost.run():
                        outs = _run(session, name, feed, b)
                    total_score.merge(_score(ref, outs, out_names, labels, label_out, classes, feed))
                outs = []
                cost.release()
            except Fp8OnnxError as exc:
                if name != "FP16":
                    raise
                _no_fp16(exc, job.notes)
                continue
            finally:
                session = None
            rows.append(_row(name, path, total_score, scored))
            rows[-1].latency_ms, rows[-1].session_mib = cost.result()
    finally:
        if cache is None:
            done.close()
    return rows, done.samples, batches


@dataclasses.dataclass
class ReferenceRun:
    """The FP32 reference's pass over the data (its outputs and the inputs on disk, its own score),
    kept for later ``compare`` calls on the same reference and data: the accuracy search's rounds run
    it once. ``close()`` removes the spill."""

    spill: Spill | None = None
    score: _Score | None = None
    labelled: int = 0
    samples: int = 0
    batches: int = 0
    label_out: int | None = None
    feed_names: list = dataclasses.field(default_factory=list)
    cost: tuple = (None, None)

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None


def _reference_pass(run: ReferenceRun, job: _Evaluation) -> None:
    """The reference over the data, into ``run`` (closed again on failure); :class:`_TooBigToSpill` as soon
    as its outputs are seen not to fit the free disk (after the first batch where the batch count is known)."""
    out_names = job.out_names
    spill = run.spill = Spill()
    budget = int(shutil.disk_usage(spill.root).free * SPILL_SHARE) - SPILL_MARGIN
    try:
        cost = _Cost(job.memory)
        session = job.reference_session()
        run.score = _Score({o: _OutputStats() for o in out_names})
        batches = job.source.batches(job.run.batch)
        for batch in progress_bar(batches, total=job.total, desc="FP32", unit="batch", enable=job.run.progress):
            b = run.batches
            (score, run.label_out), ref = reference_batch(
                session, b, batch.feed, batch.labels, out_names, job.classes, cost
            )
            run.score.merge(score)
            keeps = [*ref, *batch.feed.values(), *([] if batch.labels is None else [batch.labels])]
            _check_spill(spill, run.batches, job.total, budget, sum(np.asarray(a).nbytes for a in keeps))
            for o, r in zip(out_names, ref):
                run.spill.save(f"out/{o}", b, r)
            for k, v in batch.feed.items():
                run.spill.save(f"in/{k}", b, v)
            if run.label_out is not None and batch.labels is not None:  # labels: what label_out was found by
                run.labelled += labelled(batch.labels)
                run.spill.save("labels", b, batch.labels)
            run.samples += batch.size
            run.batches += 1
            run.feed_names = list(batch.feed)
            if job.max_samples is not None and run.samples >= job.max_samples:
                break
        cost.release()
        session = None
        if run.batches == 0:
            raise Fp8OnnxError("The evaluation data gave no batches.")
        run.cost = cost.result()
    except BaseException:
        run.close()
        raise


def _check_spill(spill: Spill, done: int, total: int | None, budget: int, nbytes: int) -> None:
    """:class:`_TooBigToSpill` before the next batch's ``nbytes`` are written where they outgrow ``budget``
    bytes or, the batch count known (``total``; ``done`` written so far), the batches at this rate will."""
    grown = spill.nbytes + nbytes
    expected = None if total is None else grown / (done + 1) * total
    if grown > budget or (expected is not None and expected > budget):
        size = expected if expected is not None else grown
        raise _TooBigToSpill(
            f"the reference's outputs over the data ({size / 2**30:.1f} GiB{' expected' if expected else ' and more'}) "
            f"would not fit {SPILL_SHARE:.0%} of the free disk at {str(spill.root.parent)!r}"
        )


def _evaluate_lockstep(job: _Evaluation, why: str):
    """Every model beside the reference, batch by batch: nothing waits on disk. For a reference whose outputs
    over the data would not fit the free disk (``why``). All sessions open at once where their memory (about
    SESSION_SHARE times the reference's file each) fits half of the memory now available; else in pairs,
    the reference run again beside each model: two sessions at a time, the reference's time once per model
    (Gemma 3 270M's five models side by side on HellaSwag held 13-16 GB of a 24 GB machine, and were killed
    when other jobs held the rest). The data is read again from the start: feeds given as a one-shot
    iterator cannot be."""
    if getattr(job.source, "one_shot", False):
        raise Fp8OnnxError(
            f"{why[0].upper()}{why[1:]}, and the feeds, given as an iterator, cannot be read again beside the "
            "other models: give the data as a file or a list, or fewer samples (--max-samples)."
        )
    names = list(job.models)
    need, free = (len(names) + 1) * SESSION_SHARE * _weight_bytes(job.reference), available_memory()
    pairs = len(names) > 1 and free is not None and need > free / 2
    how = "in pairs, the reference again beside each model" if pairs else "side by side"
    logger.info("%s: the models run %s, batch by batch, nothing kept on disk", why, how)
    job.notes.append(f"The models ran {how} ({why}); their sessions' memory was not measured.")
    groups = [[n] for n in names] if pairs else [names]
    rows, samples, b = [], 0, 0
    for i, group in enumerate(groups):
        theirs, samples, b = _lockstep(job, group)
        rows += theirs if i == 0 else theirs[1:]  # the reference's row once: every pass gives the same
    return rows, samples, b


def _lockstep(job: _Evaluation, names: list[str]):
    """(rows: the reference's, then each of ``names``' that opened; samples; batches): the reference and
    ``names``' sessions open at once, batch by batch."""
    sessions = {_REFERENCE: job.reference_session()}
    for name in names:
        try:
            sessions[name] = job.models[name][1]()
        except Fp8OnnxError as exc:
            if name != "FP16":
                raise
            _no_fp16(exc, job.notes)
    scores = {n: _Score({o: _OutputStats() for o in job.out_names}) for n in sessions}
    costs = {n: _Cost(False) for n in sessions}
    label_out, scored, samples, b = None, 0, 0, 0
    batches = job.source.batches(job.run.batch)
    what = "all models" if len(names) > 1 else f"FP32 and {names[0]}"
    for batch in progress_bar(batches, total=job.total, desc=what, unit="batch", enable=job.run.progress):
        (score, label_out), ref = reference_batch(
            sessions[_REFERENCE], b, batch.feed, batch.labels, job.out_names, job.classes, costs[_REFERENCE]
        )
        scores[_REFERENCE].merge(score)
        labels = None if label_out is None else batch.labels
        for name, session in list(sessions.items())[1:]:
            with costs[name].run():
                outs = _run(session, name, batch.feed, b)
            scores[name].merge(_score(ref, outs, job.out_names, labels, label_out, job.classes, batch.feed))
        if label_out is not None and batch.labels is not None:
            scored += labelled(batch.labels)
        samples, b = samples + batch.size, b + 1
        if job.max_samples is not None and samples >= job.max_samples:
            break
    sessions.clear()
    if b == 0:
        raise Fp8OnnxError("The evaluation data gave no batches.")
    rows = []
    for name, score in scores.items():
        path = str(job.reference) if name == _REFERENCE else job.models[name][0]
        rows.append(_row(name, path, score, scored))
        rows[-1].latency_ms = costs[name].result()[0]
    return rows, samples, b


def _weight_bytes(path) -> int:
    """Bytes of the model file's weights: the file and the external data files it names (read without them)."""
    path = pathlib.Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    places = {entry.value for t in proto.graph.initializer for entry in t.external_data if entry.key == "location"}
    return path.stat().st_size + sum((path.parent / p).stat().st_size for p in places if (path.parent / p).is_file())


class _Cost:
    """A session's run time per batch, and the memory it holds: the C heap in use (glibc's mallinfo2)
    while it is alive, after its last run, less before it was built. Resident-set sizes cannot tell
    this in one process: freed memory of an earlier session is reused or kept."""

    def __init__(self, memory: bool = True):
        self.times: list[float] = []
        self.memory = memory
        if memory:
            gc.collect()  # garbage freed later would count against the session (0.1-0.3 s: on request only)
        self.before = heap_in_use() if memory else None
        self.held: int | None = None

    @contextlib.contextmanager
    def run(self):
        start = time.perf_counter()
        yield
        self.times.append(time.perf_counter() - start)

    def release(self) -> None:
        """Call while the session is still alive, after its last run."""
        if not self.memory:
            return
        gc.collect()
        now = heap_in_use()
        if now is not None and self.before is not None:
            self.held = max(now - self.before, 0)

    def result(self) -> tuple[float | None, float | None]:
        warm = self.times[1:] or self.times
        latency = float(np.median(warm)) * 1e3 if warm else None
        return latency, None if self.held is None else self.held / 2**20


def _session(path, provider: str, fold: bool = True):
    return make_session(pathlib.Path(path), provider, f"Candidate model {str(path)!r}", arena=False, fold=fold)


def _fp16_session(ref_model, reference, provider: str, serialized: bool = False):
    """The FP16 baseline's session, or with ``serialized`` the baseline itself for workers
    (:func:`fp8onnx.graph.runtime.portable_model`)."""
    try:
        fp16_model = ConvertFloat16Pass()(ref_model.clone() if serialized else ref_model).model
    except Exception as exc:
        raise Fp8OnnxError(
            f"The FP16 baseline of {str(reference)!r} could not be built ({type(exc).__name__}: {first_line(exc)})."
        ) from exc
    if serialized:
        return portable_model(fp16_model, files=False)
    what = f"The FP16 baseline of {str(reference)!r}"
    return session_for_model(fp16_model, provider, what, arena=False)


def _run(session, name: str, feed: dict, batch: int) -> list[np.ndarray]:
    try:
        return session.run(None, feed)
    except Exception as exc:
        raise Fp8OnnxError(f"Model {name!r} failed on batch {batch} in onnxruntime: {first_line(exc)}") from exc


def reference_batch(
    session, b: int, feed: dict, labels, out_names, classes=frozenset(), cost: _Cost | None = None
) -> tuple[tuple[_Score, int | None], list]:
    """The reference on batch ``b``: ((its score against itself, the labelled output), its outputs);
    ``cost`` times the onnxruntime run alone."""
    with cost.run() if cost is not None else contextlib.nullcontext():
        ref = _run(session, _REFERENCE, feed, b)
    label_out = _label_output(ref, out_names, labels)
    return (_score(ref, ref, out_names, labels, label_out, classes, feed), label_out), ref


def candidate_batch(
    session, name: str, b: int, feed: dict, ref: list, labels, label_out, out_names, classes=frozenset()
) -> _Score:
    """Model ``name`` on batch ``b``, scored against the reference's outputs ``ref``."""
    return _score(ref, _run(session, name, feed, b), out_names, labels, label_out, classes, feed)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> int | None:
    """Bytes of C heap this process has in use (glibc's mallinfo2: allocated chunks plus mmapped
    ones), or None where that is not glibc. onnxruntime's sessions allocate through it when their
    arena is off."""
    try:
        call = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = _MallInfo2
    info = call()
    return int(info.uordblks + info.hblkhd)
