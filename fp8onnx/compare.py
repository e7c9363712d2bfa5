"""Accuracy of candidate models against a reference (FP32) and its FP16 baseline, on the same data.

Per output, streamed batch by batch, one model at a time (running sums are kept; the reference's
outputs wait on disk):
  cosine similarity of each row (vectors along the last axis): mean and min;
  relative L2 error ||c - r|| / ||r||; maximum absolute error;
  top-1 agreement (argmax over the last axis) when the output looks like logits;
  task accuracy when the data has ``labels`` (argmax of the output whose leading shape they match),
  and perplexity: exp of the mean cross-entropy of that output's softmax at the labels (for a
  language model's next-token labels, its perplexity).

Each candidate's headline metric (task accuracy, else top-1 agreement, else mean cosine) is put
against the FP16 model's: the FP8 LLM paper's criterion is >= 99.5% of FP16, the PTQ paper's a
relative loss within 1%.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import pathlib
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from .data import input_specs
from .datasource import as_data
from .errors import Fp8OnnxError, first_line
from .model_io import load_model, model_file
from .passes import ConvertFloat16Pass
from .progress import progress_bar
from .runtime import (
    RunOptions,
    heap_in_use,
    make_session,
    portable_model,
    resolve_provider,
    session_for_model,
    session_from_portable,
)
from .segments import Spill

__all__ = ["LLM_RATIO", "PTQ_REL_LOSS", "CompareResult", "ReferenceRun", "RowResult", "compare"]

logger = logging.getLogger(__name__)
LLM_RATIO = 0.995  # FP8 within 99.5% of FP16 (FP8 LLM paper)
PTQ_REL_LOSS = 0.01  # within 1% relative loss (PTQ paper)
GENERATE_TOKENS = 32  # greedy tokens each model generates in the generation check
GENERATE_PROMPTS = 5
PROMPT_TOKENS = 32  # each prompt: the first tokens of a row of the data
_LOGITS_NAME = re.compile(r"logit|score|prob|class", re.IGNORECASE)


@dataclasses.dataclass
class _OutputStats:
    rows: int = 0
    cos_sum: float = 0.0
    cos_min: float = 1.0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs: float = 0.0
    top1_hits: int = 0
    top1_rows: int = 0

    def update(self, ref: np.ndarray, out: np.ndarray, logits: bool) -> None:
        if ref.shape != out.shape:
            raise Fp8OnnxError(f"Output shapes differ: reference {ref.shape}, candidate {out.shape}.")
        r = ref.astype(np.float64).reshape(-1, ref.shape[-1] if ref.ndim else 1)
        c = out.astype(np.float64).reshape(r.shape)
        nr, nc = np.linalg.norm(r, axis=1), np.linalg.norm(c, axis=1)
        dot = (r * c).sum(axis=1)
        both_zero = (nr == 0) & (nc == 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = np.where(both_zero, 1.0, dot / (nr * nc))
        cos = np.nan_to_num(cos, nan=0.0)
        self.rows += len(cos)
        self.cos_sum += float(cos.sum())
        self.cos_min = min(self.cos_min, float(cos.min())) if len(cos) else self.cos_min
        diff = c - r
        self.err_sq += float(np.nansum(diff * diff))
        self.ref_sq += float((r * r).sum())
        self.max_abs = max(self.max_abs, float(np.nanmax(np.abs(diff))) if diff.size else 0.0)
        if logits:
            self.top1_hits += int((r.argmax(axis=1) == c.argmax(axis=1)).sum())
            self.top1_rows += r.shape[0]

    def merge(self, other: _OutputStats) -> None:
        """Add another batch's sums (in batch order: the same floats as one running update)."""
        self.rows += other.rows
        self.cos_sum += other.cos_sum
        self.cos_min = min(self.cos_min, other.cos_min)
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq
        self.max_abs = max(self.max_abs, other.max_abs)
        self.top1_hits += other.top1_hits
        self.top1_rows += other.top1_rows

    def to_json(self) -> dict:
        return {
            "cosine_mean": self.cos_sum / self.rows if self.rows else None,
            "cosine_min": self.cos_min if self.rows else None,
            "rel_l2": float(np.sqrt(self.err_sq / self.ref_sq)) if self.ref_sq else None,
            "max_abs_err": self.max_abs,
            "top1_agreement": self.top1_hits / self.top1_rows if self.top1_rows else None,
        }


@dataclasses.dataclass
class _Score:
    """One model's sums over its batches, or one batch's: per-output statistics, and with labels the
    correct predictions and the summed cross-entropy."""

    outputs: dict[str, _OutputStats]
    correct: int = 0
    nll: float = 0.0

    def merge(self, other: _Score) -> None:
        for o, stats in self.outputs.items():
            stats.merge(other.outputs[o])
        self.correct += other.correct
        self.nll += other.nll


def _score(ref: list[np.ndarray], outs: list[np.ndarray], out_names, labels, label_out, classes=frozenset()) -> _Score:
    score = _Score({o: _OutputStats() for o in out_names})
    for o, r, c in zip(out_names, ref, outs):
        score.outputs[o].update(r, c, _looks_like_logits(o, r.shape, labels, classes))
    if label_out is not None:
        score.correct = int((outs[label_out].argmax(axis=-1) == labels).sum())
        score.nll = _nll(outs[label_out], labels)
    return score


def reference_batch(
    session, b: int, feed: dict, labels, out_names, classes=frozenset(), cost: _Cost | None = None
) -> tuple[tuple[_Score, int | None], list]:
    """The reference on batch ``b``: ((its score against itself, the labelled output), its outputs);
    ``cost`` times the onnxruntime run alone."""
    with cost.run() if cost is not None else contextlib.nullcontext():
        ref = _run(session, _REFERENCE, feed, b)
    label_out = _label_output(ref, out_names, labels)
    return (_score(ref, ref, out_names, labels, label_out, classes), label_out), ref


def candidate_batch(
    session, name: str, b: int, feed: dict, ref: list, labels, label_out, out_names, classes=frozenset()
) -> _Score:
    """Model ``name`` on batch ``b``, scored against the reference's outputs ``ref``."""
    return _score(ref, _run(session, name, feed, b), out_names, labels, label_out, classes)


@dataclasses.dataclass
class RowResult:
    name: str
    path: str | None
    outputs: dict[str, dict]
    accuracy: float | None = None  # task accuracy against labels
    perplexity: float | None = None  # exp(mean cross-entropy of the labelled output's softmax)
    headline: str = ""  # which metric is compared with FP16
    value: float | None = None
    ratio_to_fp16: float | None = None
    rel_loss_vs_fp16: float | None = None
    latency_ms: float | None = None  # median onnxruntime time per batch after the first (warm-up)
    session_mib: float | None = None  # resident memory the session added, built and run once
    generation: dict | None = None  # greedy generation vs FP32 (fp8onnx.generation.agreement)

    @property
    def passes_llm(self) -> bool | None:
        return None if self.ratio_to_fp16 is None else self.ratio_to_fp16 >= LLM_RATIO

    @property
    def passes_ptq(self) -> bool | None:
        return None if self.rel_loss_vs_fp16 is None else self.rel_loss_vs_fp16 <= PTQ_REL_LOSS

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["passes_llm_99_5pct_of_fp16"] = self.passes_llm
        d["passes_ptq_1pct_rel_loss"] = self.passes_ptq
        return d


@dataclasses.dataclass
class CompareResult:
    reference: str
    data: str
    samples: int
    batches: int
    provider: str
    rows: list[RowResult]
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. why there is no FP16 baseline
    generation: dict | None = None  # prompts, prompt_tokens, tokens of the generation check

    def to_json(self) -> dict:
        return {
            "reference": self.reference,
            "data": self.data,
            "samples": self.samples,
            "batches": self.batches,
            "provider": self.provider,
            "generation": self.generation,
            "criteria": {"llm_ratio_to_fp16": LLM_RATIO, "ptq_rel_loss_vs_fp16": PTQ_REL_LOSS},
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
        }

    def table(self) -> str:
        first = next(iter(self.rows[0].outputs)) if self.rows and self.rows[0].outputs else None
        head = [
            "model",
            "cos mean",
            "cos min",
            "rel L2",
            "max abs",
            "top-1 agr",
            "accuracy",
            "ppl",
            "vs FP16",
            "99.5%",
            "1% rel",
            "ms/batch",
            "MiB",
        ]
        lines = []
        for r in self.rows:
            o = r.outputs.get(first, {})
            lines.append(
                [
                    r.name,
                    _fmt(o.get("cosine_mean"), ".5f"),
                    _fmt(o.get("cosine_min"), ".4f"),
                    _fmt(o.get("rel_l2"), ".4f"),
                    _fmt(o.get("max_abs_err"), ".3g"),
                    _fmt(o.get("top1_agreement"), ".4f"),
                    _fmt(r.accuracy, ".4f"),
                    _fmt(r.perplexity, ".2f"),
                    _fmt(r.ratio_to_fp16, ".2%"),
                    _yes(r.passes_llm),
                    _yes(r.passes_ptq),
                    _fmt(r.latency_ms, ".1f"),
                    _fmt(r.session_mib, ".0f"),
                ]
            )
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        out = [f"{self.samples} samples from {self.data}, output {first!r} vs the FP32 reference ({self.provider})"]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.append("  ".join("-" * w for w in widths))
        out.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)
        out.extend(f"note: {n}" for n in self.notes)
        headline = next((r.headline for r in self.rows if r.headline), "")
        if headline:
            out.append(
                f"vs FP16: {headline} relative to the FP16 model's; pass at >= 99.5% (FP8 LLM paper) "
                "and within 1% relative loss (PTQ paper)"
            )
        if any(r.latency_ms is not None for r in self.rows):
            out.append(
                f"ms/batch: median onnxruntime time per batch after a warm-up one; MiB: heap the session holds "
                f"({self.provider}). On the CPU EP FP8 buys file size, not speed or memory: it has no FP8 GEMM; "
                "these sessions set session.disable_quant_qdq=1, which dequantizes each float8 weight once at load "
                "(at onnxruntime's defaults, again at every run)."
            )
        out.extend(self._generation_lines())
        return "\n".join(out)

    def _generation_lines(self) -> list[str]:
        if not self.generation:
            return []
        g = self.generation
        out = [
            f"greedy generation, {g['prompts']} prompts of {g['prompt_tokens']} tokens from the data, "
            f"{g['tokens']} new tokens, vs FP32's:"
        ]
        head = ["model", "tokens before divergence", "token agreement", "identical text"]
        lines = [
            [
                r.name,
                f"{r.generation['tokens_before_divergence']:.1f} of {g['tokens']}",
                f"{r.generation['token_agreement']:.1%}",
                f"{r.generation['identical']:.0%}",
            ]
            for r in self.rows
            if r.generation
        ]
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)
        return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _yes(v: bool | None) -> str:
    return "-" if v is None else ("pass" if v else "FAIL")


def _looks_like_logits(name: str, shape: tuple, labels: np.ndarray | None, classes=frozenset()) -> bool:
    """Whether top-1 agreement is measured on this output: class scores by their labels, their name, a
    Softmax computing them, or ``--metric top1`` (``classes``)."""
    if len(shape) < 2 or shape[-1] < 2:
        return False
    if name in classes or (labels is not None and tuple(labels.shape) == tuple(shape[:-1])):
        return True
    return bool(_LOGITS_NAME.search(name))


METRICS = ("auto", "accuracy", "top1", "cosine", "rel-l2")
_PASS_THROUGH = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose")


def class_outputs(model) -> frozenset[str]:
    """Outputs computed by a Softmax/LogSoftmax (through reshapes and casts): class scores."""
    found = set()
    for value in model.graph.outputs:
        node = value.producer()
        while node is not None and node.op_type in _PASS_THROUGH and node.inputs and node.inputs[0] is not None:
            node = node.inputs[0].producer()
        if node is not None and node.op_type in ("Softmax", "LogSoftmax"):
            found.add(value.name)
    return frozenset(found)


def compare(
    reference: str | os.PathLike,
    candidates: Sequence[str | os.PathLike],
    data,
    *,
    fp16: bool = True,
    max_samples: int | None = None,
    generate: int = GENERATE_TOKENS,
    prompts: int = GENERATE_PROMPTS,
    memory: bool = True,
    metric: str = "auto",
    reference_run: ReferenceRun | None = None,
    run: RunOptions | None = None,
    **run_options,
) -> CompareResult:
    """Run the reference, its FP16 baseline (unless ``fp16=False``) and each candidate on ``data``
    (at most about ``max_samples`` samples: whole batches until that many are seen). A language
    model (``input_ids`` in, ``logits`` out) also generates ``generate`` tokens greedily from
    ``prompts`` prompts taken from the data (``generate=0``: not), each model against FP32's tokens.
    ``memory``: measure the heap each session holds (a garbage collection per model, 0.1-0.3 s).
    ``metric``: the headline compared with FP16 (``METRICS``): auto is task accuracy with labels, else
    top-1 agreement for class scores (named like logits, or computed by a Softmax), else mean cosine;
    ``rel-l2`` scores 1 - relative L2 error (regression outputs). ``reference_run``: a
    :class:`ReferenceRun` that keeps the reference's pass for later calls on the same reference, data
    and batching (the first call fills it; on Ray workers it is not used).

    One model at a time: the reference's outputs (and the inputs) are kept on disk and read back
    batch by batch for each other model, so memory holds one session, whatever the models' size."""
    run = RunOptions.of(run, **run_options)
    provider, batch_size, progress = resolve_provider(run.provider), run.batch, run.progress
    named = [pathlib.Path(c).name for c in candidates]  # an export folder is named by its folder
    reference, candidates = model_file(reference), [model_file(c) for c in candidates]  # export folders too
    ref_model = load_model(reference)
    out_names = [v.name for v in ref_model.graph.outputs]
    if metric not in METRICS:
        raise Fp8OnnxError(f"--metric must be one of {', '.join(METRICS)}, got {metric!r}.")
    classes = class_outputs(ref_model) | ({out_names[0]} if metric == "top1" else set())
    # name -> (path or None, builder of its session); checked up front, before the long runs
    models: dict[str, tuple[str | None, Callable[[], object]]] = {}
    if fp16:
        models["FP16"] = (None, lambda **kw: _fp16_session(ref_model, reference, provider, **kw))
    for cand, name in zip(candidates, named):
        theirs = [v.name for v in load_model(cand).graph.outputs]  # a clear error for a missing or bad file
        while name in models or name == _REFERENCE:
            name += "'"
        if theirs != out_names:
            raise Fp8OnnxError(f"Model {name!r} has outputs {theirs}; the reference has {out_names}.")
        models[name] = (str(cand), functools.partial(_session, cand, provider))
    source = as_data(data, input_specs(ref_model), ref_model)
    total = source.count_batches(batch_size)
    if max_samples is not None and total is not None:
        total = min(total, -(-max_samples // batch_size))

    notes: list[str] = []
    job = _Evaluation(
        reference,
        models,
        source,
        out_names,
        total,
        max_samples,
        batch_size,
        provider,
        progress,
        run,
        notes,
        memory,
        frozenset(classes),
    )
    rows, samples, batches = _evaluate_distributed(job) if run.distributed else _evaluate_here(job, reference_run)
    if not any(r.name == "FP16" for r in rows):
        fp16 = False
    _headline(rows, out_names[0], fp16, metric)
    generation = None
    if generate and _is_language_model(ref_model):
        generation = _generation(reference, models, rows, source, generate, prompts, provider, notes)
    return CompareResult(
        str(reference),
        str(data) if isinstance(data, (str, os.PathLike)) else "feeds",
        samples,
        batches,
        provider,
        rows,
        notes,
        generation,
    )


def _is_language_model(model) -> bool:
    return any(v.name == "input_ids" for v in model.graph.inputs) and any(
        v.name == "logits" for v in model.graph.outputs
    )


def _generation(reference, models, rows, source, tokens: int, prompts: int, provider: str, notes) -> dict | None:
    """Greedy generation of every model (fp8onnx.generation) from the first ``prompts`` rows of the
    data's input_ids (their first PROMPT_TOKENS tokens), each row's agreement with FP32's tokens."""
    from .generation import Generator, agreement
    from .sources import cache_sizes

    rows_ids = []
    for batch in source.batches(prompts):
        rows_ids.extend(np.asarray(batch.feed["input_ids"]).reshape(-1, batch.feed["input_ids"].shape[-1]))
        if len(rows_ids) >= prompts:
            break
    if not rows_ids:
        return None
    prompt = np.stack(rows_ids[:prompts])[:, :PROMPT_TOKENS].astype(np.int64)
    sizes = cache_sizes(pathlib.Path(reference).parent)
    builders = {_REFERENCE: lambda: make_session(pathlib.Path(reference), provider, f"Model {str(reference)!r}")}
    builders.update({name: build for name, (_, build) in models.items()})
    produced = {}
    for name, build in builders.items():
        if name == "FP16" and not any(r.name == "FP16" for r in rows):
            continue
        try:
            generator = Generator({"decoder": build()}, cache_sizes=sizes, where=f"model {name!r}")
            produced[name] = generator.greedy(prompt, tokens)
        except Fp8OnnxError as exc:
            notes.append(f"No generation check: {exc}")
            logger.warning("%s", notes[-1])
            return None
    for row in rows:
        if row.name != _REFERENCE and row.name in produced:
            row.generation = agreement(produced[_REFERENCE], produced[row.name])
    return {"prompts": int(prompt.shape[0]), "prompt_tokens": int(prompt.shape[1]), "tokens": tokens}


_REFERENCE = "FP32 (reference)"
# onnxruntime 1.32's CPU NchwcTransformer crashes the process (SIGSEGV while the session is built) on
# a float16 Conv - seen on the exporter corpus's ViT patch embedding (4x4, stride 4, 3 channels). It
# rewrites float32 Conv layouts only, so the FP16 baseline loses nothing without it.
FP16_DISABLED = ("NchwcTransformer",)


def _row(name, path, score: _Score, labelled: int) -> RowResult:
    return RowResult(
        name, path, _to_json(score.outputs), _accuracy(score.correct, labelled), _perplexity(score.nll, labelled)
    )


def _no_fp16(exc: Fp8OnnxError, notes: list[str]) -> None:
    # The baseline is ours, not the user's: without it, report against FP32 only.
    notes.append(f"No FP16 baseline: {exc} Results are against FP32 only.")
    logger.warning("%s", notes[-1])


@dataclasses.dataclass
class _Evaluation:
    """What one compare run evaluates, and how: the executors' one argument."""

    reference: pathlib.Path
    models: dict  # name -> (path or None, builder of its session)
    source: object  # fp8onnx.datasource.as_data's data source
    out_names: list[str]
    total: int | None  # batches expected (progress bars)
    max_samples: int | None
    batch_size: int
    provider: str
    progress: bool
    run: RunOptions
    notes: list[str]  # appended to: why there is no FP16 row, ...
    memory: bool  # measure each session's heap
    classes: frozenset = frozenset()  # outputs whose top-1 agreement is measured


def _evaluate_here(job: _Evaluation, cache: ReferenceRun | None = None):
    """One model at a time in this process: the reference's outputs (and the inputs) wait on disk and
    are read back batch by batch for each other model, so memory holds one session. ``cache``: the
    reference's pass is kept there, or taken from there when it is."""
    reference, out_names, classes, progress = job.reference, job.out_names, job.classes, job.progress
    done = cache if cache is not None else ReferenceRun()
    if not done.batches:
        _reference_pass(done, job)
    spill, labelled, batches, label_out = done.spill, done.labelled, done.batches, done.label_out
    feed_names = done.feed_names
    try:
        rows = [_row(_REFERENCE, str(reference), done.score, labelled)]
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
                    total_score.merge(_score(ref, outs, out_names, labels, label_out, classes))
                outs = None
                cost.release()
            except Fp8OnnxError as exc:
                if name != "FP16":
                    raise
                _no_fp16(exc, job.notes)
                continue
            finally:
                session = None
            rows.append(_row(name, path, total_score, labelled))
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
    """The reference over the data, into ``run`` (closed again on failure)."""
    reference, out_names = job.reference, job.out_names
    run.spill = Spill()
    try:
        cost = _Cost(job.memory)
        what = f"Reference model {str(reference)!r}"
        session = make_session(pathlib.Path(reference), job.provider, what, arena=False)
        run.score = _Score({o: _OutputStats() for o in out_names})
        batches = job.source.batches(job.batch_size)
        for batch in progress_bar(batches, total=job.total, desc="FP32", unit="batch", enable=job.progress):
            b = run.batches
            (score, run.label_out), ref = reference_batch(
                session, b, batch.feed, batch.labels, out_names, job.classes, cost
            )
            run.score.merge(score)
            for o, r in zip(out_names, ref):
                run.spill.save(f"out/{o}", b, r)
            for k, v in batch.feed.items():
                run.spill.save(f"in/{k}", b, v)
            if run.label_out is not None:
                run.labelled += batch.labels.size
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


def _evaluate_distributed(job: _Evaluation):
    """Every model's batches shared by Ray workers (:mod:`fp8onnx.distributed`): inputs and the
    reference's outputs stay in Ray's object store, each worker holds one model's session at a time,
    and the per-batch sums are merged here in batch order - the single-process numbers exactly."""
    from .distributed import shared_pool

    reference, models, out_names, classes, provider = (
        job.reference,
        job.models,
        job.out_names,
        job.classes,
        job.provider,
    )
    progress, max_samples = job.progress, job.max_samples
    with shared_pool(job.run.workers, job.run.ray_address) as pool:

        def ship(path):  # a path every local worker reads; the model itself (any size) to a cluster
            return str(path) if pool.local else portable_model(load_model(path), files=False)

        pool.load(ship(reference), _worker_session, provider, f"Reference model {str(reference)!r}", ())
        batches_in = []  # (batch, its feed's object-store reference)
        samples = 0

        def items():
            nonlocal samples
            for b, batch in enumerate(job.source.batches(job.batch_size)):
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
            results, total=job.total, desc="FP32", unit="batch", enable=progress
        ):
            ref_score.merge(score)
            refs.append(ref)
            label_out = labelled_output
        if not refs:
            raise Fp8OnnxError("The evaluation data gave no batches.")
        labelled = sum(b.labels.size for b, _ in batches_in) if label_out is not None else 0
        rows = [_row(_REFERENCE, str(reference), ref_score, labelled)]
        for name, (path, build) in models.items():
            try:
                if path is None:  # the FP16 baseline, built here
                    blob = build(serialized=True)
                    pool.load(
                        blob, _worker_session, provider, f"The FP16 baseline of {str(reference)!r}", FP16_DISABLED
                    )
                else:
                    pool.load(ship(path), _worker_session, provider, f"Candidate model {str(path)!r}", ())
                total_score = _Score({o: _OutputStats() for o in out_names})
                work = (
                    (name, b, feed, ref, None if label_out is None else batch.labels, label_out, out_names, classes)
                    for b, ((batch, feed), ref) in enumerate(zip(batches_in, refs))
                )
                for score in progress_bar(
                    pool.map(candidate_batch, work), total=len(refs), desc=name, unit="batch", enable=progress
                ):
                    total_score.merge(score)
            except Fp8OnnxError as exc:
                if name != "FP16":
                    raise
                _no_fp16(exc, job.notes)
                continue
            rows.append(_row(name, path, total_score, labelled))
    return rows, samples, len(refs)


def _worker_session(model, provider: str, what: str, disabled: tuple[str, ...], threads: int):
    """A worker's session of a model given as a path, or as :func:`fp8onnx.runtime.portable_model`'s
    (graph, weights)."""
    options = {"arena": False, "threads": threads, "disabled_optimizers": disabled}
    if isinstance(model, tuple):
        return session_from_portable(model, provider, what, **options)
    return make_session(pathlib.Path(model), provider, what, **options)


def _session(path, provider: str):
    return make_session(pathlib.Path(path), provider, f"Candidate model {str(path)!r}", arena=False)


def _fp16_session(ref_model, reference, provider: str, serialized: bool = False):
    """The FP16 baseline's session, or with ``serialized`` the baseline itself for workers
    (:func:`fp8onnx.runtime.portable_model`)."""
    try:
        fp16_model = ConvertFloat16Pass()(ref_model.clone() if serialized else ref_model).model
    except Exception as exc:
        raise Fp8OnnxError(
            f"The FP16 baseline of {str(reference)!r} could not be built ({type(exc).__name__}: {first_line(exc)})."
        ) from None
    if serialized:
        return portable_model(fp16_model, files=False)
    what = f"The FP16 baseline of {str(reference)!r}"
    return session_for_model(fp16_model, provider, what, arena=False, disabled_optimizers=FP16_DISABLED)


def _run(session, name: str, feed: dict, batch: int) -> list[np.ndarray]:
    try:
        return session.run(None, feed)
    except Exception as exc:
        raise Fp8OnnxError(f"Model {name!r} failed on batch {batch} in onnxruntime: {first_line(exc)}") from None


def _label_output(ref: list[np.ndarray], out_names: list[str], labels: np.ndarray | None) -> int | None:
    """Index of the output the labels score (its leading shape is theirs), or None without labels."""
    if labels is None:
        return None
    found = next((i for i, r in enumerate(ref) if r.ndim >= 2 and r.shape[:-1] == labels.shape), None)
    if found is None:
        raise Fp8OnnxError(
            f"Data 'labels' of shape {labels.shape} match no output's leading shape "
            f"({', '.join(f'{n} {r.shape}' for n, r in zip(out_names, ref))})."
        )
    return found


def _to_json(stats: dict) -> dict:
    return {o: s.to_json() for o, s in stats.items()}


def _nll(logits: np.ndarray, labels: np.ndarray) -> float:
    """Sum over the labelled positions of -log softmax(logits)[label] (one batch, float64 sums)."""
    x = logits.reshape(-1, logits.shape[-1])
    y = labels.reshape(-1).astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= x.shape[-1]):
        return float("nan")  # labels that are not class indices of this output
    total = 0.0
    for s in range(0, len(x), 1024):  # a bounded float32 copy at a time (LLM vocabularies are large)
        part = x[s : s + 1024].astype(np.float32)
        peak = part.max(axis=-1, keepdims=True)
        logz = np.log(np.exp(part - peak).sum(axis=-1, dtype=np.float64)) + peak[:, 0]
        total += float((logz - part[np.arange(len(part)), y[s : s + 1024]]).sum())
    return total


def _perplexity(nll: float, labelled: int) -> float | None:
    return float(np.exp(nll / labelled)) if labelled and np.isfinite(nll) else None


def _accuracy(correct: int, labelled: int) -> float | None:
    return correct / labelled if labelled else None


def _headline(rows: list[RowResult], first: str, fp16: bool, metric: str = "auto") -> None:
    accuracy = (lambda r: r.accuracy), "task accuracy"
    top1 = (lambda r: r.outputs[first]["top1_agreement"]), "top-1 agreement with FP32"
    cosine = (lambda r: r.outputs[first]["cosine_mean"]), "mean cosine to FP32"
    rel = (lambda r: 1.0 - r.outputs[first]["rel_l2"]), "1 - relative L2 error to FP32"
    if metric == "accuracy" and rows[0].accuracy is None:
        raise Fp8OnnxError("--metric accuracy needs 'labels' in the evaluation data.")
    if metric == "top1" and rows[0].outputs[first]["top1_agreement"] is None:
        raise Fp8OnnxError(
            f"--metric top1 needs an output of class scores; {first!r} has fewer than 2 along its last axis."
        )
    if metric == "auto":
        if rows[0].accuracy is not None:
            metric = "accuracy"
        else:
            metric = "top1" if rows[0].outputs[first]["top1_agreement"] is not None else "cosine"
    key, label = {"accuracy": accuracy, "top1": top1, "cosine": cosine, "rel-l2": rel}[metric]
    base = next((key(r) for r in rows if r.name == "FP16"), None) if fp16 else None
    for r in rows:
        r.headline, r.value = label, key(r)
        if base and r.value is not None and r.name not in ("FP32 (reference)", "FP16"):
            r.ratio_to_fp16 = r.value / base
            r.rel_loss_vs_fp16 = (base - r.value) / base
