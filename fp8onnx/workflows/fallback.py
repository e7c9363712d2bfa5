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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from fp8onnx.accuracy.sensitivity import SensitivityResult, measure_sensitivity
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import Data
from fp8onnx.graph.guard import as_path, check_paths, model_reads, model_writes
from fp8onnx.graph.model_io import write_text_atomic
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.graph.runtime import RunOptions, resolve_provider
from fp8onnx.pipeline.calibration import Stats
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.report import QuantizeReport
from fp8onnx.techniques.family import detect_family
from fp8onnx.workflows.candidates import Candidates

__all__ = ["FallbackResult", "TargetNotMet", "quantize_to_target", "search", "sensitivity"]

logger = logging.getLogger(__name__)


# --refine's default in each command: scoring nodes is `sensitivity --eval`'s whole job, while for the
# accuracy search 5 refined nodes changed no result on the sample decoder (targets 99-99.85%) or the
# digits CNN and cost 5 more evaluations each.
REFINE_DEFAULTS = {"sensitivity": 5, "quantize_to_target": 0}


@dataclasses.dataclass
class FallbackResult:
    accuracy_target: float  # percent of FP16's headline metric
    metric: str
    tried: dict[int, float | None]  # nodes kept in float -> headline relative to FP16 (fraction)
    kept_in_float: list[str]  # the chosen nodes, most sensitive first
    met: bool
    report: QuantizeReport | None  # None when the target was not met (nothing written)
    evaluations: int = 0  # models scored on the end metric, refinement included
    sensitivity: list[dict] = dataclasses.field(default_factory=list)  # per node, as SensitivityResult.to_json()
    unit: str = "nodes"  # what was kept in float: whole nodes, or only their activations (W8A16)

    def summary(self) -> str:
        lines = [self.report.summary()] if self.report else []
        verdict = "met" if self.met else "NOT met (nothing written)"
        lines.append(
            f"  accuracy target {self.accuracy_target:g}% of FP16 ({self.metric}): {verdict}; "
            f"{self.evaluations} models evaluated"
        )
        for k, ratio in sorted(self.tried.items()):
            shown = "-" if ratio is None else f"{ratio:.2%}"
            mark = "  <- written" if self.met and k == len(self.kept_in_float) else ""
            lines.append(f"    {k:>4} {self._in_float}: {shown}{mark}")
        if self.kept_in_float:
            shown = ", ".join(self.kept_in_float[:8]) + (" ..." if len(self.kept_in_float) > 8 else "")
            what = "kept in float" if self.unit == "nodes" else "activations kept in float (W8A16)"
            lines.append(f"  {what} (most sensitive first): {shown}")
        return "\n".join(lines)

    @property
    def _in_float(self) -> str:
        return "nodes in float" if self.unit == "nodes" else "with float activations"

    def to_json(self) -> dict:
        return {
            "target_pct_of_fp16": self.accuracy_target,
            "metric": self.metric,
            "tried": {str(k): v for k, v in sorted(self.tried.items())},
            "kept_in_float": self.kept_in_float,
            "met": self.met,
            "evaluations": self.evaluations,
            "unit": self.unit,
            "report": self.report.to_json() if self.report else None,
        }


class TargetNotMet(Fp8OnnxError):
    """The target did not hold within the float-node budget; nothing was written. ``result`` says
    what was tried (its ``kept_in_float`` is the best count's nodes)."""

    def __init__(self, message: str, result: FallbackResult):
        super().__init__(message)
        self.result = result


def sensitivity(
    model: str | os.PathLike,
    calib: Data | None = None,
    data: Data | None = None,
    *,
    config: QuantizeConfig | None = None,
    stats: str | os.PathLike | Stats | None = None,
    run: RunOptions | None = None,
    eval_data: Data | None = None,
    refine: int = REFINE_DEFAULTS["sensitivity"],
    metric: str = "auto",
    needs_data: bool = False,
    budget: bool = False,
    **options,
) -> SensitivityResult:
    """``fp8onnx sensitivity``: the SQNR ranking (:func:`fp8onnx.accuracy.sensitivity.measure_sensitivity`;
    ``options`` are QuantizeConfig or RunOptions fields) and, with ``eval_data``, the ``refine``
    lowest-SQNR nodes scored on the end metric: the all-FP8 model and, per node, the model with only
    it in float (``refine`` + 1 models quantized and evaluated). ``needs_data``: the variants'
    recipe reads ``calib`` (GPTQ, bias correction, smoothing)."""
    run_kw, options = RunOptions.split(options)
    run = RunOptions.of(run, **run_kw)
    run = RunOptions.of(run, provider=resolve_provider(run.provider))
    config = config or QuantizeConfig(**options)
    result = measure_sensitivity(model, calib, data, config=config, stats=stats, run=run, budget=budget)
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
    count tried, is >= ``accuracy_target`` percent (None when there is none). Scores come from
    ``candidates``; its cache makes repeated searches cheap."""
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
        return tried[k] is not None and tried[k] * 100 >= accuracy_target

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
    while stable() is not None:
        best = stable()
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
    accuracy_target: float = 99.5,
    max_float_nodes: int | None = None,
    refine: int = REFINE_DEFAULTS["quantize_to_target"],
    config: QuantizeConfig | None = None,
    report: str | os.PathLike | None = None,
    metric: str = "auto",
    run: RunOptions | None = None,
    **options,
) -> FallbackResult:
    """Quantize ``model`` keeping the fewest most sensitive nodes in float (at most
    ``max_float_nodes``) such that its headline metric on ``eval_data`` is >= ``accuracy_target``% of FP16's.

    requires: ``calib`` data (sensitivity and scales come from it), ``eval_data`` with an FP16 baseline;
    ensures: the output is written only when the target holds on ``eval_data`` with fewer than
    ``NEARLY_ALL`` of the nodes in float (more only when ``max_float_nodes`` allows it); otherwise
    :class:`TargetNotMet` is raised and nothing is written. Deterministic for the same inputs.
    ``metric``: the headline (``fp8onnx.accuracy.metrics.METRICS``; auto: compare's own choice).
    """
    if isinstance(options.get("target"), (int, float)):  # a percentage under the deploy target's name
        raise Fp8OnnxError(
            f"target={options['target']!r} names the deploy target (onnxruntime, onnxruntime-cuda, tensorrt); "
            "the accuracy goal in percent of FP16 is accuracy_target=."
        )
    run_kw, options = RunOptions.split(options)
    run = RunOptions.of(run, **run_kw)
    if config is None:  # like quantize: the family's recipe (preset auto) under the options given
        config = QuantizeConfig.for_preset(options.pop("preset", None) or "auto", **options)
    _check_search(accuracy_target, max_float_nodes, refine, calib)
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", as_path(calib)), ("the evaluation data", as_path(eval_data))],
        model_writes("the output model", output) + [("the report", report)],
    )
    ranked, sens = _ranked(model, config, calib, eval_data, refine, metric, run)
    needs_data = ranked.weights_need_data
    order = [n.name for n in sens.order()]
    limit = len(order) if max_float_nodes is None else min(max_float_nodes, len(order))
    with Candidates(model, config, sens.stats, eval_data, run, calib, metric, needs_data) as candidates:
        tried, chosen = search(sens, candidates, accuracy_target, limit)
    evaluations = sens.evaluations + candidates.evaluated
    metric, nodes, unit = candidates.metric, sens.to_json()["nodes"], ranked.fallback
    if chosen is None:
        raise _not_met(accuracy_target, metric, tried, order, limit, as_path(eval_data), evaluations, nodes, unit)
    if order and chosen >= NEARLY_ALL * len(order) and max_float_nodes is None:
        result = FallbackResult(accuracy_target, metric, tried, order[:chosen], False, None, evaluations, nodes, unit)
        raise TargetNotMet(_nearly_all(accuracy_target, metric, chosen, len(order)), result)
    final = candidates.write(order[:chosen], output, run)
    logger.info("kept %d nodes in float for %g%% of FP16 after %d evaluations", chosen, accuracy_target, evaluations)
    result = FallbackResult(accuracy_target, metric, tried, order[:chosen], True, final, evaluations, nodes, unit)
    if report is not None:  # the usual report, plus how the target was met and the sensitivity it used
        doc = {**final.to_json(), "accuracy_target": result.to_json(), "sensitivity": result.sensitivity}
        del doc["accuracy_target"]["report"]
        write_text_atomic(report, json.dumps(doc, indent=1) + "\n")
    return result


def _ranked(model, config: QuantizeConfig, calib, eval_data, refine: int, metric: str, run: RunOptions):
    """(the recipe the nodes are ranked under, their sensitivity): measured on ``calib`` (the scales
    from it too where the activations are static), the top ``refine`` scored on ``eval_data``."""
    ranked = _ranking_config(model, config)
    scoring = {"config": ranked, "eval_data": eval_data, "refine": refine, "metric": metric, "run": run}
    scoring["needs_data"] = ranked.weights_need_data
    if ranked.activations != "static":  # the scales need no calibration; sensitivity still runs on calib
        return ranked, sensitivity(model, None, calib, **scoring)
    return ranked, sensitivity(model, calib, **scoring)


def _nearly_all(accuracy_target: float, metric: str, chosen: int, nodes: int) -> str:
    return (
        f"Accuracy target {accuracy_target:g}% of FP16 ({metric}) holds only with {chosen} of {nodes} nodes in float: "
        "that is hardly an FP8 model; nothing written (lower --accuracy-target, try a --preset, or allow it "
        f"with --max-float-nodes {chosen})."
    )


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


def _not_met(accuracy_target, metric, tried, order, limit, eval_path, evaluations, nodes, unit) -> TargetNotMet:
    """No count within ``limit`` met the target: the error, naming the best count tried."""
    best = max(tried, key=lambda k: (tried[k] or 0.0, -k))
    result = FallbackResult(accuracy_target, metric, tried, order[:best], False, None, evaluations, nodes, unit)
    shown = "no FP16 baseline" if tried[best] is None else f"{tried[best]:.2%} of FP16"
    if tried[best] is not None and tried[best] * 100 >= accuracy_target:
        shown += " (not confirmed: a count with more nodes in float missed the target)"
    return TargetNotMet(
        f"Accuracy target {accuracy_target:g}% of FP16 ({metric}) not met on {eval_path or 'the evaluation data'} "
        f"with up to {limit} of {len(order)} nodes in float: the best was {shown} with {best} in float; "
        + (
            "nothing written (raise --max-float-nodes or lower --accuracy-target)."
            if limit < len(order)
            else "nothing written: every node was allowed in float (what is not a node, such as float8 "
            "embedding tables, stays as the recipe has it; lower --accuracy-target or try --preset none)."
        ),
        result,
    )
