"""Quantize to a stated accuracy: keep the fewest, most sensitive nodes in float until the headline
metric on held-out data is at least ``accuracy_target`` percent of the FP16 model's.

The order comes from :mod:`fp8onnx.accuracy.sensitivity` (one pass, SQNR per node; with ``refine`` > 0 the
lowest-SQNR nodes are re-ordered by their measured end-metric gain), the statistics from that same
calibration. The all-FP8 model is scored first; if it misses the target, candidates keeping the
first 1, 2, 4 nodes in float are scored in one ``compare`` run, then 8, 16, ... up to the budget in
another if none passed
(:class:`fp8onnx.workflows.candidates.Candidates`); the smallest count that meets the target is narrowed
down between the last failing and the first passing count. A count counts as passing only if every
larger count tried passes too: the headline metric is not monotone in the number of float nodes,
and a count that passes while a larger one fails met the target by the noise of the evaluation
set (seen on the sample decoder at 99.9%: 27 nodes passed, 28 failed, and 27 missed the target on
held-out data). If no count within the budget meets
the target, nothing is written: :class:`TargetNotMet` carries what was tried.

Every ratio carries its noise (one standard error, paired with FP16's samples: LM windows), and a
gap to the target within ``Z`` standard errors is not a reason to keep a node in float (SPEC §12): a
count whose ratio cannot be told from the target counts as meeting it, and where the all-FP8 model is
such a count the summary says the data cannot resolve the target and how many samples would. The
search chooses on two thirds of ``eval_data`` and confirms its choice on the other third
(:mod:`fp8onnx.data.split`), which is reported separately.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import pathlib

from fp8onnx.accuracy.compare import compare
from fp8onnx.accuracy.compare_results import CompareResult
from fp8onnx.accuracy.sensitivity import SensitivityResult, measure_with
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.scratch import temporary_dir
from fp8onnx.data.datasource import Data, as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.data.split import EVERY, Part, count_samples
from fp8onnx.graph.guard import as_path, check_calibration_source, check_paths, model_reads, model_writes
from fp8onnx.graph.model_io import load_model, model_file, write_text_atomic
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.graph.run_settings import RunOptions, entry_settings
from fp8onnx.pipeline.calibration import Stats
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.keywords import take
from fp8onnx.techniques.family import detect_family
from fp8onnx.workflows.candidates import Candidates
from fp8onnx.workflows.quantizer import quantize_with
from fp8onnx.workflows.target_result import FallbackResult, TargetNotMet, Z, nearly_all, not_met, unresolved

__all__ = ["FallbackResult", "Scoring", "TargetNotMet", "TargetSearch", "quantize_to_target", "search", "sensitivity"]

logger = logging.getLogger(__name__)


# --refine's default in each command: scoring nodes is `sensitivity --eval`'s whole job, while for the
# accuracy search 5 refined nodes changed no result on the sample decoder (targets 99-99.85%) or the
# digits CNN and cost 5 more evaluations each.
REFINE_DEFAULTS = {"sensitivity": 5, "quantize_to_target": 0}


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How :func:`sensitivity` scores nodes on the end metric: the ``refine`` lowest-SQNR nodes, each alone
    in float, on the headline ``metric`` (``fp8onnx.accuracy.metrics.METRICS``; auto: compare's own choice);
    ``needs_data``: the variants' recipe reads the calibration data (GPTQ, bias correction, smoothing)."""

    refine: int = REFINE_DEFAULTS["sensitivity"]
    metric: str = "auto"
    needs_data: bool = False


@dataclasses.dataclass(frozen=True)
class TargetSearch:
    """What :func:`quantize_to_target` searches for: the headline ``metric`` at ``accuracy_target`` percent of
    FP16's with at most ``max_float_nodes`` nodes in float, the ``refine`` lowest-SQNR nodes scored first, and
    (``confirm``) the choice scored on a held-out third of the evaluation data."""

    accuracy_target: float = 99.5
    max_float_nodes: int | None = None
    refine: int = REFINE_DEFAULTS["quantize_to_target"]
    metric: str = "auto"
    confirm: bool = True


def sensitivity(
    model: str | os.PathLike,
    calib: Data | None = None,
    data: Data | None = None,
    *,
    config: QuantizeConfig | None = None,
    stats: str | os.PathLike | Stats | None = None,
    run: RunOptions | None = None,
    eval_data: Data | None = None,
    scoring: Scoring | None = None,
    budget: bool = False,
    **options,
) -> SensitivityResult:
    """``fp8onnx sensitivity``: the SQNR ranking (:func:`fp8onnx.accuracy.sensitivity.measure_sensitivity`;
    ``options`` are QuantizeConfig or RunOptions fields) and, with ``eval_data``, the ``refine``
    lowest-SQNR nodes scored on the end metric: the all-FP8 model and, per node, the model with only
    it in float (``refine`` + 1 models quantized and evaluated). ``needs_data``: the variants'
    recipe reads ``calib`` (GPTQ, bias correction, smoothing). ``scoring`` (:class:`Scoring`) holds ``refine``,
    ``metric`` and ``needs_data``; keyword ``options`` are its fields, QuantizeConfig's or RunOptions'."""
    scoring = take(Scoring, scoring, options)
    config, run = entry_settings(config, run, options, preset=None)
    check_calibration_source(calib, stats)
    return _sensitivity(model, calib, data, config, run, stats, eval_data, scoring, budget)


def _sensitivity(model, calib, data, config, run, stats, eval_data, scoring: Scoring, budget=False):
    """:func:`sensitivity` with its settings built and its sources checked (the accuracy search's ranking)."""
    refine, metric, needs_data = scoring.refine, scoring.metric, scoring.needs_data
    result = measure_with(model, calib, data, config, run, stats=stats, budget=budget)
    if eval_data is None or refine <= 0:
        return result
    nodes = result.ranked()[:refine]
    source = calib if calib is not None else data
    with Candidates(model, config, result.stats, eval_data, run, source, metric, needs_data) as candidates:
        base, *ratios = candidates.ratios([(), *((n.name,) for n in nodes)])
        result.metric, result.base_ratio, result.evaluations = candidates.metric, base, candidates.evaluated
        for node, ratio in zip(nodes, ratios):
            node.metric_ratio = ratio
            node.metric_gain = None if ratio is None or base is None else ratio - base
            node.gain_noise = candidates.gain_noise((node.name,), ())
    return result


def _rounds(limit: int) -> list[list[int]]:
    """Counts of nodes kept in float, scored round by round: 0 (often enough); 1, 2, 4; then 8, 16,
    ... and ``limit``."""
    counts, k = [0], 1
    while k < limit:
        counts.append(k)
        k *= 2
    counts = sorted(set(counts + [limit]))
    return [c for c in [[0], [k for k in counts if 0 < k <= 4], [k for k in counts if k > 4]] if c]


NEARLY_ALL = 0.9  # a target met only with this share of the nodes in float is refused unless allowed


def search(sens: SensitivityResult, candidates: Candidates, accuracy_target: float, limit: int):
    """(tried, chosen): the headline ratio to FP16 per count of nodes kept in float (in
    ``sens.order()``), and the smallest count within ``limit`` whose ratio, and that of every larger
    count tried, is >= ``accuracy_target`` percent or within ``Z`` standard errors below it (None when
    there is none). Scores come from ``candidates``; its cache makes repeated searches cheap."""
    order = [n.name for n in sens.order()]
    tried: dict[int, float | None] = {}
    if sens.base_ratio is not None:  # refinement scored these already
        tried[0] = sens.base_ratio
        if limit >= 1 and sens.order()[0].metric_gain is not None:
            tried[1] = sens.order()[0].metric_ratio
    if not candidates.metric:
        candidates.metric = sens.metric

    def score(counts: list[int]) -> None:
        counts = [k for k in counts if k not in tried]
        if counts:
            for k, ratio in zip(counts, candidates.ratios([tuple(order[:k]) for k in counts])):
                tried[k] = ratio

    def passes(k: int) -> bool:
        ratio = tried[k]
        if ratio is None:
            return False
        gap, se = accuracy_target / 100 - ratio, candidates.noise(tuple(order[:k]))
        return gap <= 0 or (se is not None and gap <= Z * se)

    def stable() -> int | None:
        """The smallest count from which every larger count tried passes too: a count that passes
        while a larger one fails met the target by the evaluation set's noise, not by its nodes."""
        best = None
        for k in sorted(tried, reverse=True):
            if not passes(k):
                break
            best = k
        return best

    for counts in _rounds(limit):
        if stable() is not None:
            break
        score(counts)
    while (best := stable()) is not None:
        below = max((k for k in tried if k < best), default=None)
        if below is None or best - below <= 1:
            break
        between = list(range(below + 1, best))
        score(between if len(between) <= 3 else [(below + best) // 2])  # narrow down
    return tried, stable()


def quantize_to_target(
    model: str | os.PathLike,
    output: str | os.PathLike,
    calib: Data,
    eval_data: Data,
    *,
    goal: TargetSearch | None = None,
    config: QuantizeConfig | None = None,
    report: str | os.PathLike | None = None,
    run: RunOptions | None = None,
    **options,
) -> FallbackResult:
    """Quantize ``model`` keeping the fewest most sensitive nodes in float (at most
    ``max_float_nodes``) such that its headline metric on ``eval_data`` is >= ``accuracy_target``% of
    FP16's, or cannot be told from it (within ``Z`` standard errors).

    requires: ``calib`` data (sensitivity and scales come from it), ``eval_data`` with an FP16 baseline;
    ensures: the output is written only when the target holds (or is within the noise) on the tuning
    part of ``eval_data`` with fewer than ``NEARLY_ALL`` of the nodes in float (more only when
    ``max_float_nodes`` allows it); otherwise :class:`TargetNotMet` is raised and nothing is written.
    With ``confirm`` (and at least ``2 * EVERY`` samples) the choice is made on two thirds of
    ``eval_data`` and the written model is scored on the other third (``FallbackResult.held_out``).
    Deterministic for the same inputs. ``metric``: the headline (``fp8onnx.accuracy.metrics.METRICS``;
    auto: compare's own choice). ``goal`` (:class:`TargetSearch`) holds ``accuracy_target``,
    ``max_float_nodes``, ``refine``, ``metric`` and ``confirm``; keyword ``options`` are its fields,
    QuantizeConfig's (and ``preset``) or RunOptions'.
    """
    if isinstance(options.get("target"), (int, float)):  # a percentage under the deploy target's name
        raise Fp8OnnxError(
            f"target={options['target']!r} names the deploy target (onnxruntime, onnxruntime-cuda, tensorrt); "
            "the accuracy goal in percent of FP16 is accuracy_target=."
        )
    goal = take(TargetSearch, goal, options)
    accuracy_target, max_float_nodes, refine = goal.accuracy_target, goal.max_float_nodes, goal.refine
    metric, confirm = goal.metric, goal.confirm
    config, run = entry_settings(config, run, options)  # like quantize: the family's recipe by default
    _check_search(accuracy_target, max_float_nodes, refine, calib)
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", as_path(calib)), ("the evaluation data", as_path(eval_data))],
        model_writes("the output model", output) + [("the report", report)],
    )
    config, chosen_line = resolved_w8a16(model, config, calib, run)
    tuning, held_out = split_eval(model, eval_data, run.batch) if confirm else (eval_data, None)
    headline = metric  # compare's --metric; ``metric`` becomes its label below
    ranked, sens = _ranked(model, config, calib, tuning, refine, metric, run)
    needs_data = ranked.weights_need_data
    order = [n.name for n in sens.order()]
    limit = len(order) if max_float_nodes is None else min(max_float_nodes, len(order))
    with Candidates(model, config, sens.stats, tuning, run, calib, metric, needs_data) as candidates:
        tried, chosen = search(sens, candidates, accuracy_target, limit)
        evaluations = sens.evaluations + candidates.evaluated
        metric, nodes, unit = candidates.metric, sens.to_json()["nodes"], ranked.fallback
        noise = {k: candidates.noise(tuple(order[:k])) for k in tried}
        if chosen is None:
            error = not_met(
                accuracy_target,
                metric,
                tried,
                order,
                limit,
                as_path(eval_data),
                evaluations,
                nodes,
                unit,
                candidates.baseline,
            )
            _with_noise(error.result, noise, candidates)
            raise error
        if order and chosen >= NEARLY_ALL * len(order) and max_float_nodes is None:
            result = FallbackResult(
                accuracy_target, metric, tried, order[:chosen], False, None, evaluations, nodes, unit
            )
            _with_noise(result, noise, candidates)
            raise TargetNotMet(nearly_all(accuracy_target, metric, chosen, len(order), candidates.baseline), result)
        final = candidates.write(order[:chosen], output, run)
        if chosen_line:
            final.prepared.append(chosen_line)
    logger.info("kept %d nodes in float for %g%% of FP16 after %d evaluations", chosen, accuracy_target, evaluations)
    result = FallbackResult(accuracy_target, metric, tried, order[:chosen], True, final, evaluations, nodes, unit)
    _with_noise(result, noise, candidates)
    result.unresolved = unresolved(result, chosen)
    if held_out is not None:
        result.held_out = confirm_on(model, output, held_out, accuracy_target, headline, run)
    if report is not None:  # the usual report, plus how the target was met and the sensitivity it used
        doc = {**final.to_json(), "accuracy_target": result.to_json(), "sensitivity": result.sensitivity}
        del doc["accuracy_target"]["report"]
        write_text_atomic(report, json.dumps(doc, indent=1) + "\n")
    return result


def resolved_w8a16(model, config: QuantizeConfig, calib, run: RunOptions) -> tuple[QuantizeConfig, str]:
    """``config`` with its ``w8a8_share`` choice made once (a quantization to a scratch file) and written as
    the nodes' names, so that the search's variants do not measure it again; and the choice's line."""
    if config.w8a8_share is None:
        return config, ""
    with temporary_dir("fp8onnx-w8a16-") as tmp:
        quiet = RunOptions.of(run, progress=False)
        done = quantize_with(model, pathlib.Path(tmp) / "choice.onnx", calib, config, quiet)
    if done.w8a16 is None:
        return config, ""
    names = tuple(glob.escape(n) for n in done.w8a16["nodes"])
    line = next((p for p in done.prepared if p.startswith("W8A16 ")), "")
    return dataclasses.replace(config, w8a8_share=None, float_activations=(*config.float_activations, *names)), line


def split_eval(model, eval_data, batch: int):
    """(the part the search chooses on, the part that confirms it or None): :mod:`fp8onnx.data.split`'s
    two parts of ``eval_data``; None where it holds fewer than ``2 * EVERY`` samples (too few to hold
    any out: the search then chooses on all of it, and says so)."""
    ir_model = load_model(model_file(model))
    source = as_data(eval_data, input_specs(ir_model), ir_model)
    if hasattr(source, "readable_again"):  # feeds given as an iterator are read many times here
        source = source.readable_again()
    if getattr(source, "task", None) is not None:
        logger.warning("a task file's items span several samples: nothing is held out; the choice is not confirmed")
        return source, None
    samples = count_samples(source, batch)
    if samples < 2 * EVERY:
        logger.warning(
            "the evaluation data holds %d samples: too few to hold a third out; the choice is not confirmed", samples
        )
        return source, None
    return Part(source, held_out=False), Part(source, held_out=True)


def confirm_on(model, output, held_out, accuracy_target: float, metric: str, run: RunOptions) -> dict:
    """The written model's headline ratio to FP16 (and its noise) on the held-out part."""
    result: CompareResult = compare(
        model, [output], held_out, generate=0, memory=False, metric=metric, run=RunOptions.of(run, progress=False)
    )
    row = result.rows[-1]
    ratio, se = row.ratio_to_fp16, row.ratio_noise
    verdict = ""
    if ratio is not None:
        gap = accuracy_target / 100 - ratio
        verdict = "confirmed" if gap <= 0 else ("within the noise" if se and gap <= Z * se else "NOT confirmed")
    return {"ratio": ratio, "noise": se, "samples": result.samples, "verdict": verdict}


def _with_noise(result: FallbackResult, noise: dict, candidates: Candidates) -> None:
    result.noise, result.samples, result.tokens = noise, candidates.samples, candidates.labelled
    result.baseline = candidates.baseline


def _ranked(model, config: QuantizeConfig, calib, eval_data, refine: int, metric: str, run: RunOptions):
    """(the recipe the nodes are ranked under, their sensitivity): measured on ``calib`` (the scales
    from it too where the activations are static), the top ``refine`` scored on ``eval_data``."""
    ranked = _ranking_config(model, config)
    scoring = Scoring(refine, metric, ranked.weights_need_data)
    # dynamic activations: the scales need no calibration; the measurement still runs on calib
    scales, data = (calib, None) if ranked.activations == "static" else (None, calib)
    return ranked, _sensitivity(model, scales, data, ranked, run, None, eval_data, scoring)


def _check_search(accuracy_target: float, max_float_nodes: int | None, refine: int, calib) -> None:
    if not 0 < accuracy_target <= 100:
        raise Fp8OnnxError(f"--accuracy-target must be a percentage in (0, 100], got {accuracy_target!r}.")
    if max_float_nodes is not None and max_float_nodes < 0:
        raise Fp8OnnxError(f"--max-float-nodes must be >= 0, got {max_float_nodes!r}.")
    if refine < 0:
        raise Fp8OnnxError(f"--refine must be >= 0, got {refine!r}.")
    if calib is None:
        raise Fp8OnnxError("--accuracy-target needs --calib DATA (the sensitivity and the scales come from it).")


def _ranking_config(model, config: QuantizeConfig) -> QuantizeConfig:
    """The recipe the nodes are ranked under: the family's for --preset auto (the search starts from it)."""
    if config.preset != "auto":
        return config
    return config.for_family(detect_family(prepare_model(model, config.precision)[0], config.native_gemm).preset)
