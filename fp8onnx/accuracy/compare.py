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

import dataclasses
import functools
import logging
import os
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from fp8onnx.accuracy.compare_results import _REFERENCE, CompareResult, _headline
from fp8onnx.accuracy.evaluation import (
    ReferenceRun,
    _evaluate_here,
    _Evaluation,
    _fp16_session,
    _session,
)
from fp8onnx.accuracy.generation import Generator, agreement
from fp8onnx.accuracy.metrics import METRICS, class_outputs, next_token_labels
from fp8onnx.accuracy.on_workers import _evaluate_distributed
from fp8onnx.accuracy.scored_positions import ScoredPositions, trimmable, trimmed
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import Data, as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.data.kv_cache import cache_sizes
from fp8onnx.graph import known
from fp8onnx.graph.cpu_ep import cuda_only_ops
from fp8onnx.graph.model_io import load_model, model_file
from fp8onnx.graph.run_settings import RunOptions, resolve_provider
from fp8onnx.graph.runtime import folds_at_load, make_session, session_for_model
from fp8onnx.passes import BLOCK_FP8_OP
from fp8onnx.settings.keywords import refuse_unknown, take
from fp8onnx.techniques.family import detect_family

__all__ = ["GENERATE_PROMPTS", "GENERATE_TOKENS", "PROMPT_TOKENS", "CompareOptions", "compare"]

logger = logging.getLogger(__name__)

GENERATE_TOKENS = 32  # greedy tokens each model generates in the generation check


GENERATE_PROMPTS = 5


PROMPT_TOKENS = 32  # each prompt: the first tokens of a row of the data


@dataclasses.dataclass(frozen=True)
class CompareOptions:
    """What :func:`compare` measures, apart from how it runs (:class:`~fp8onnx.graph.run_settings.RunOptions`):
    the FP16 baseline, at most about ``max_samples`` samples, ``generate`` greedy tokens from ``prompts``
    prompts (language models), each session's heap (``memory``), the headline ``metric``."""

    fp16: bool = True
    max_samples: int | None = None
    generate: int = GENERATE_TOKENS
    prompts: int = GENERATE_PROMPTS
    memory: bool = True
    metric: str = "auto"


def compare(
    reference: str | os.PathLike,
    candidates: Sequence[str | os.PathLike],
    data: Data,
    *,
    measure: CompareOptions | None = None,
    reference_run: ReferenceRun | None = None,
    run: RunOptions | None = None,
    **options,
) -> CompareResult:
    """Run the reference, its FP16 baseline (unless ``fp16=False``) and each candidate on ``data``
    (at most about ``max_samples`` samples: whole batches until that many are seen). A language
    model (``input_ids`` in, ``logits`` out) also generates ``generate`` tokens greedily from
    ``prompts`` prompts taken from the data (``generate=0``: not), each model against FP32's tokens.
    ``memory``: measure the heap each session holds (a garbage collection per model, 0.1-0.3 s).
    ``metric``: the headline compared with FP16 (``METRICS``): auto is task accuracy with labels (a decoder
    LLM's data needs none: each position's next token is its label), else top-1 agreement for class
    scores (named like logits, computed by a Softmax, or a linear head's 2-D output), else mean cosine;
    ``rel-l2`` scores 1 - relative L2 error (regression outputs). ``reference_run``: a
    :class:`ReferenceRun` that keeps the reference's pass for later calls on the same reference, data
    and batching (the first call fills it; on Ray workers it is not used). What it measures is ``measure``
    (:class:`CompareOptions`), how it runs ``run``; keyword ``options`` are either's fields (``generate=0``,
    ``provider="cpu"``), in place of the object's own.

    One model at a time: the reference's outputs (and the inputs) are kept on disk and read back
    batch by batch for each other model, so memory holds one session, whatever the models' size (where
    they would not fit the free disk, every model runs beside the reference instead: all at once where their
    sessions fit the available memory, else in pairs, the reference again beside each)."""
    measure = take(CompareOptions, measure, options)
    refuse_unknown("compare", options, RunOptions)
    fp16, max_samples, generate, prompts = measure.fp16, measure.max_samples, measure.generate, measure.prompts
    memory, metric = measure.memory, measure.metric
    run = RunOptions.of(run, **options)
    run = RunOptions.of(run, provider=resolve_provider(run.provider))
    provider = run.provider
    named = [pathlib.Path(c).name for c in candidates]  # an export folder is named by its folder
    reference, candidates = model_file(reference), [model_file(c) for c in candidates]  # export folders too
    ref_model = load_model(reference)
    out_names = [known.name(v) for v in ref_model.graph.outputs]
    if metric not in METRICS:
        raise Fp8OnnxError(f"--metric must be one of {', '.join(METRICS)}, got {metric!r}.")
    classes = class_outputs(ref_model) | ({out_names[0]} if metric == "top1" else set())
    models, unfolded = _models(ref_model, reference, zip(candidates, named), provider, fp16)
    source, total = _source(data, ref_model, run.batch, max_samples)
    notes = _emulation_notes(models, provider) + [f"{name}: {why}." for name, why in unfolded.items()]
    open_reference = None
    # a kept reference pass (reference_run) serves later calls whose candidates may not trim: runs as it is
    if getattr(source, "task", None) is not None and not run.distributed and reference_run is None:
        trim = _trimmed_models(ref_model, reference, models, provider, unfolded)
        if trim is not None:
            open_reference, models = trim
            source = ScoredPositions(source)
            notes.append(
                "Each model computed its logits at the task's scored positions only (its vocabulary projection "
                "gathered first): top-1 agreement and the output errors cover those positions."
            )
    job = _Evaluation(reference, models, source, out_names, total, max_samples, run, notes, memory, frozenset(classes))
    job.open_reference = open_reference
    rows, samples, batches = _evaluate_distributed(job) if run.distributed else _evaluate_here(job, reference_run)
    task = getattr(source, "task", None)
    if task is not None:  # zero-shot task items: scored from the samples' sums, an item per unit
        _task_scores(rows, task)
        notes.append(task.describe())
        generate = 0
    if not any(r.name == "FP16" for r in rows):
        fp16 = False
    if isinstance(source, _NextTokenLabels) and source.derived:
        notes.append(
            f"Labels: the next token of each position of {source._input!r} (padding and each row's last position "
            "not scored): next-token accuracy and perplexity without labels in the data."
        )
    overflow = _headline(rows, out_names[0], fp16, metric)
    if overflow:
        notes.append(overflow)
    generation = None
    if generate and _is_language_model(ref_model):
        generation = _generation(reference, models, rows, source, generate, prompts, provider, notes)
    named_data = str(data) if isinstance(data, (str, os.PathLike)) else "feeds"
    baseline = _REFERENCE if overflow else "FP16"
    return CompareResult(str(reference), named_data, samples, batches, provider, rows, notes, generation, baseline)


def _task_scores(rows, task) -> None:
    """Each row's accuracy (and, for completions, per-item perplexity) over the task's items."""
    for row in rows:
        row.columns.update(task.rescore(row.columns))
        right, nll = row.columns["correct"], row.columns["nll"]
        row.accuracy = float(right.mean()) if len(right) else None
        row.perplexity = float(np.exp(nll.mean())) if len(nll) and task.kind == "completion" else None


def _models(ref_model, reference, candidates, provider: str, fp16: bool) -> tuple[dict, dict[str, str]]:
    """(name -> (path or None, builder of its session), name -> why its float8 weights are dequantized at every
    run): FP16 (unless ``fp16`` is False), then each (candidate, name), a repeated name primed; every candidate
    loaded and its outputs checked here, before the long runs. A candidate's CPU session dequantizes its float8
    weights once at load where they fit the memory available then, else at every run
    (:func:`fp8onnx.graph.runtime.folds_at_load`)."""
    out_names = [v.name for v in ref_model.graph.outputs]
    models: dict[str, tuple[str | None, Callable[[], object]]] = {}
    unfolded: dict[str, str] = {}
    if fp16:
        models["FP16"] = (None, lambda **kw: _fp16_session(ref_model, reference, provider, **kw))
    for cand, name in candidates:
        model = load_model(cand)  # a clear error for a missing or bad file
        theirs = [v.name for v in model.graph.outputs]
        while name in models or name == _REFERENCE:
            name += "'"
        if theirs != out_names:
            raise Fp8OnnxError(f"Model {name!r} has outputs {theirs}; the reference has {out_names}.")
        fold, why = folds_at_load(model) if provider == "cpu" else (True, "")
        if not fold:
            unfolded[name] = why
            logger.info("%s: %s", name, why)
        models[name] = (str(cand), functools.partial(_session, cand, provider, fold))
    return models, unfolded


def _trimmed_models(ref_model, reference, models: dict, provider: str, unfolded: dict):
    """(the reference's session builder, ``models`` with builders of sessions) for the models trimmed to a
    task's scored positions (:func:`fp8onnx.accuracy.scored_positions.trimmed`; the FP16 baseline is built
    from the trimmed reference), or None, nothing changed, where some model cannot be trimmed."""
    if not any(v.name == "logits" for v in ref_model.graph.outputs):
        return None
    loaded = {name: load_model(path) for name, (path, _) in models.items() if path is not None}
    for name, model in [(str(reference), ref_model), *loaded.items()]:
        if not trimmable(model):
            logger.info("Model %r: no MatMul to trim to the scored positions; every position's logits computed", name)
            return None
    for model in (ref_model, *loaded.values()):
        trimmed(model)
    mine = ref_model.clone()  # the FP16 baseline converts ref_model itself
    what = f"Reference model {str(reference)!r}"
    trims = {
        name: (
            path,
            build
            if path is None
            else functools.partial(_model_session, loaded[name], provider, path, fold=name not in unfolded),
        )
        for name, (path, build) in models.items()
    }
    return functools.partial(session_for_model, mine, provider, what, arena=False), trims


def _model_session(model, provider: str, path: str, fold: bool = True):
    return session_for_model(model, provider, f"Candidate model {path!r}", arena=False, fold=fold)


def _source(data, ref_model, batch_size: int, max_samples: int | None):
    """(the data source, its batch count or None): a language model's data gets next-token labels."""
    source = as_data(data, input_specs(ref_model), ref_model)
    if max_samples is not None and hasattr(source, "limit"):  # a task file: its first whole items
        source.limit(max_samples)
    token_input = _next_token_input(ref_model)
    if token_input is not None:
        source = _NextTokenLabels(source, token_input)
    total = source.count_batches(batch_size)
    if max_samples is not None and total is not None:
        total = min(total, -(-max_samples // batch_size))
    return source, total


def _emulation_notes(models: dict, provider: str) -> list[str]:
    """A note for each model whose CUDA-only ops run emulated on the CPU EP."""
    return [
        f"{name}: {', '.join(ops)} emulated on the CPU EP (standard ops with the CUDA kernels' numerics"
        + ("; the GPU decode path for M <= 8 rows rounds once less)" if BLOCK_FP8_OP in ops else ")")
        for name, (path, _) in models.items()
        if path and provider == "cpu" and (ops := cuda_only_ops(path))
    ]


def _next_token_input(model) -> str | None:
    """A decoder LLM's token input: its data needs no labels (each position's next token is one)."""

    if detect_family(model).name != "decoder LLM":
        return None
    return next((v.name for v in model.graph.inputs if "input_ids" in v.name), None)


class _NextTokenLabels:
    """A data source whose batches without labels get a decoder's own: the next token of each attended
    position (:func:`fp8onnx.accuracy.metrics.next_token_labels`)."""

    def __init__(self, source, token_input: str):
        self._source, self._input = source, token_input
        self.derived = False

    def __getattr__(self, name):
        return getattr(self._source, name)

    def batches(self, batch_size: int):
        for batch in self._source.batches(batch_size):
            if batch.labels is None and self._input in batch.feed:
                self.derived = True
                mask = batch.feed.get("attention_mask")
                batch = dataclasses.replace(batch, labels=next_token_labels(batch.feed[self._input], mask))
            yield batch


def _is_language_model(model) -> bool:
    return any(v.name == "input_ids" for v in model.graph.inputs) and any(
        v.name == "logits" for v in model.graph.outputs
    )


def _generation(reference, models, rows, source, tokens: int, prompts: int, provider: str, notes) -> dict | None:
    """Greedy generation of every model (fp8onnx.accuracy.generation) from the first ``prompts`` rows of the
    data's input_ids (their first PROMPT_TOKENS tokens), each row's agreement with FP32's tokens."""

    rows_ids: list[np.ndarray] = []
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
            produced[name] = _greedy(name, build, sizes, prompt, tokens)
        except Fp8OnnxError as exc:
            notes.append(f"No generation check: {exc}")
            logger.warning("%s", notes[-1])
            return None
    for row in rows:
        if row.name != _REFERENCE and row.name in produced:
            row.generation = agreement(produced[_REFERENCE], produced[row.name])
    return {"prompts": int(prompt.shape[0]), "prompt_tokens": int(prompt.shape[1]), "tokens": tokens}


def _greedy(name: str, build, sizes, prompt: np.ndarray, tokens: int) -> np.ndarray:
    """One model's greedy tokens; its session is let go on return, before the next model's is built (a 1.5B
    model's FP32 session held beside its FP16 one took compare to 18.7 GB)."""
    generator = Generator({"decoder": build()}, cache_sizes=sizes, where=f"model {name!r}")
    return generator.greedy(prompt, tokens)
