"""``compare`` on Ray workers: every model's batches shared by the workers of a pool
(:mod:`fp8onnx.pipeline.distributed`), the per-batch sums merged here in batch order."""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Iterator

from fp8onnx.accuracy.compare_results import _REFERENCE, _row
from fp8onnx.accuracy.evaluation import _Evaluation, _no_fp16, candidate_batch, reference_batch
from fp8onnx.accuracy.metrics import _OutputStats, _Score, labelled
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.progress import progress_bar
from fp8onnx.graph.model_io import load_model
from fp8onnx.graph.runtime import make_session, portable_model, session_from_portable
from fp8onnx.pipeline.distributed import shared_pool

__all__ = ["_evaluate_distributed", "_worker_session"]


def _evaluate_distributed(job: _Evaluation):
    """Every model's batches shared by Ray workers (:mod:`fp8onnx.pipeline.distributed`): inputs and the
    reference's outputs stay in Ray's object store, each worker holds one model's session at a time,
    and the per-batch sums are merged here in batch order - the single-process numbers exactly."""

    reference, models, out_names, classes = job.reference, job.models, job.out_names, job.classes
    provider, progress, max_samples = job.run.provider, job.run.progress, job.max_samples
    with shared_pool(job.run.workers, job.run.ray_address, job.run.ray_timeout) as pool:

        def ship(path):  # a path every local worker reads; the model itself (any size) to a cluster
            return str(path) if pool.local else portable_model(load_model(path), files=False)

        pool.load(ship(reference), _worker_session, provider, f"Reference model {str(reference)!r}", ())
        batches_in = []  # (batch, its feed's object-store reference)
        samples = 0

        def items():
            nonlocal samples
            for b, batch in enumerate(job.source.batches(job.run.batch)):
                feed = pool.put(batch.feed)
                batches_in.append((batch, feed))
                yield b, feed, batch.labels, out_names, classes
                samples += batch.size
                if max_samples is not None and samples >= max_samples:
                    return

        ref_score = _Score({o: _OutputStats() for o in out_names})
        label_out, refs = None, []
        results = pool.map(reference_batch, items(), keep=True)
        for (score, labelled_output), ref in progress_bar(
            _pairs(results), total=job.total, desc="FP32", unit="batch", enable=progress
        ):
            ref_score.merge(score)
            refs.append(ref)
            label_out = labelled_output
        if not refs:
            raise Fp8OnnxError("The evaluation data gave no batches.")
        scored = sum(labelled(b.labels) for b, _ in batches_in) if label_out is not None else 0
        rows = [_row(_REFERENCE, str(reference), ref_score, scored)]
        for name, (path, build) in models.items():
            try:
                load = build(serialized=True) if path is None else ship(path)  # the FP16 baseline: built here
                total_score = _candidate_score(pool, job, name, load, path, list(zip(batches_in, refs)), label_out)
            except Fp8OnnxError as exc:
                if name != "FP16":
                    raise
                _no_fp16(exc, job.notes)
                continue
            rows.append(_row(name, path, total_score, scored))
    return rows, samples, len(refs)


def _pairs(results: Iterable[object]) -> Iterator[tuple]:
    """The reference's results from the workers, each ((its score, the labelled output), its outputs)."""
    for result in results:
        if not isinstance(result, tuple) or len(result) != 2:
            raise Fp8OnnxError(f"A worker returned {type(result).__name__}, not the reference's (score, outputs).")
        yield result


def _candidate_score(pool, job: _Evaluation, name: str, load, path, batches: list, label_out) -> _Score:
    """A candidate's score, its batches ((batch, feed), the reference's outputs) run on the workers of
    ``pool``; ``load`` is what they load (a path, a model, or the FP16 baseline's bytes)."""
    what = f"The FP16 baseline of {str(job.reference)!r}" if path is None else f"Candidate model {str(path)!r}"
    # float16 Conv graphs leave out NchwcTransformer on their own (fp8onnx.graph.cpu_ep)
    pool.load(load, _worker_session, job.run.provider, what, ())
    total_score = _Score({o: _OutputStats() for o in job.out_names})
    work = (
        (name, b, feed, ref, None if label_out is None else batch.labels, label_out, job.out_names, job.classes)
        for b, ((batch, feed), ref) in enumerate(batches)
    )
    for score in progress_bar(
        pool.map(candidate_batch, work), total=len(batches), desc=name, unit="batch", enable=job.run.progress
    ):
        total_score.merge(score)
    return total_score


def _worker_session(model, provider: str, what: str, disabled: tuple[str, ...], threads: int):
    """A worker's session of a model given as a path, or as :func:`fp8onnx.graph.runtime.portable_model`'s
    (graph, weights)."""
    if isinstance(model, tuple):
        return session_from_portable(model, provider, what, arena=False, threads=threads, disabled_optimizers=disabled)
    return make_session(pathlib.Path(model), provider, what, arena=False, threads=threads, disabled_optimizers=disabled)
