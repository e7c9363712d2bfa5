"""What the accuracy search gives back: :class:`FallbackResult` (every count tried with its ratio to FP16
and that ratio's noise, the nodes kept, the held-out check) and :class:`TargetNotMet`, and the sentences
that say why a target was not met or could not be resolved."""

from __future__ import annotations

import dataclasses

from fp8onnx.accuracy.metrics import samples_needed
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.split import EVERY
from fp8onnx.settings.report import QuantizeReport

__all__ = ["FallbackResult", "TargetNotMet", "Z", "nearly_all", "not_met", "unresolved"]

Z = 2.0  # a gap to the target within this many standard errors is within chance: no node is kept for it


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
    noise: dict[int, float | None] = dataclasses.field(default_factory=dict)  # count -> one SE of its ratio
    samples: int = 0  # samples the choice was made on (the unit of the noise)
    tokens: int = 0  # labelled positions among them (a language model's tokens), 0 without labels
    unresolved: str = ""  # why the data could not tell the chosen count from the target, and what would
    held_out: dict | None = None  # the written model on the samples the choice did not see (confirm())
    baseline: str = "FP16"  # what the percentages are of: "FP32" where FP16 overflows (compare's baseline)

    def summary(self) -> str:
        lines = [self.report.summary()] if self.report else []
        verdict = "met" if self.met else "NOT met (nothing written)"
        if self.met and self.unresolved:
            verdict = "within the noise of the tuning data"
        on = f" on {self.samples} samples" + (f" ({self.tokens} tokens)" if self.tokens else "") if self.samples else ""
        lines.append(
            f"  accuracy target {self.accuracy_target:g}% of {_of(self.baseline)} ({self.metric}{on}): {verdict}; "
            f"{self.evaluations} models evaluated"
        )
        for k, ratio in sorted(self.tried.items()):
            shown = "-" if ratio is None else f"{ratio:.2%}" + (f" ±{self.noise[k]:.2%}" if self.noise.get(k) else "")
            mark = "  <- written" if self.met and k == len(self.kept_in_float) else ""
            lines.append(f"    {k:>4} {self._in_float}: {shown}{mark}")
        if self.kept_in_float:
            shown = ", ".join(self.kept_in_float[:8]) + (" ..." if len(self.kept_in_float) > 8 else "")
            what = "kept in float" if self.unit == "nodes" else "activations kept in float (W8A16)"
            lines.append(f"  {what} (most sensitive first): {shown}")
        if self.unresolved:
            lines.append(f"  {self.unresolved}")
        if self.held_out:
            h = self.held_out
            noise = f" ±{h['noise']:.2%}" if h.get("noise") else ""
            shown = "-" if h["ratio"] is None else f"{h['ratio']:.2%}{noise} of {self.baseline}"
            lines.append(
                f"  held out (every {EVERY}rd sample of the evaluation data, {h['samples']} samples, not used to "
                f"choose): {shown}" + (f"; {h['verdict']}" if h.get("verdict") else "")
            )
        lines.append(
            f"  ±: one standard error of the ratio, paired with {self.baseline}'s samples; gaps within {Z:g} of them "
            "keep no node in float"
        )
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
            "noise": {str(k): v for k, v in sorted(self.noise.items())},
            "samples": self.samples,
            "tokens": self.tokens,
            "unresolved": self.unresolved or None,
            "held_out": self.held_out,
            "report": self.report.to_json() if self.report else None,
        }


class TargetNotMet(Fp8OnnxError):
    """The target did not hold within the float-node budget; nothing was written. ``result`` says
    what was tried (its ``kept_in_float`` is the best count's nodes)."""

    def __init__(self, message: str, result: FallbackResult):
        super().__init__(message)
        self.result = result


def unresolved(result: FallbackResult, chosen: int) -> str:
    """The sentence for a chosen count whose ratio is below the target by less than ``Z`` standard
    errors (empty where it is at or above the target)."""
    ratio, se = result.tried.get(chosen), result.noise.get(chosen)
    if ratio is None or se is None or ratio * 100 >= result.accuracy_target:
        return ""
    gap = result.accuracy_target / 100 - ratio
    need = samples_needed(result.samples, se, gap, Z)
    more = ""
    if need is not None:
        tokens = f" (about {need * result.tokens // max(result.samples, 1):,} tokens)" if result.tokens else ""
        more = (
            f"; telling a gap of {gap:.2%} from noise needs about {need:,} samples{tokens} instead of {result.samples}"
        )
    what = "no node was kept in float for it" if chosen == 0 else f"no node beyond these {chosen} was kept for it"
    return (
        f"The tuning data cannot resolve the target: {ratio:.2%} ±{se:.2%} of {result.baseline} is within {Z:g} "
        "standard errors "
        f"of {result.accuracy_target:g}%, so {what}{more}."
    )


def _of(baseline: str) -> str:
    """What an accuracy target's percentages are of, said where it is not FP16."""
    return baseline if baseline == "FP16" else f"{baseline} (FP16 overflows on this model)"


def nearly_all(accuracy_target: float, metric: str, chosen: int, nodes: int, baseline: str = "FP16") -> str:
    return (
        f"Accuracy target {accuracy_target:g}% of {_of(baseline)} ({metric}) holds only with {chosen} of {nodes} "
        "nodes in float: "
        "that is hardly an FP8 model; nothing written (lower --accuracy-target, try a --preset, or allow it "
        f"with --max-float-nodes {chosen})."
    )


def not_met(
    accuracy_target, metric, tried, order, limit, eval_path, evaluations, nodes, unit, baseline: str = "FP16"
) -> TargetNotMet:
    """No count within ``limit`` met the target: the error, naming the best count tried."""
    best = max(tried, key=lambda k: (tried[k] or 0.0, -k))
    result = FallbackResult(accuracy_target, metric, tried, order[:best], False, None, evaluations, nodes, unit)
    shown = "no FP16 baseline" if tried[best] is None else f"{tried[best]:.2%} of {baseline}"
    if tried[best] is not None and tried[best] * 100 >= accuracy_target:
        shown += " (not confirmed: a count with more nodes in float missed the target)"
    return TargetNotMet(
        f"Accuracy target {accuracy_target:g}% of {_of(baseline)} ({metric}) not met on "
        f"{eval_path or 'the evaluation data'} "
        f"with up to {limit} of {len(order)} nodes in float: the best was {shown} with {best} in float; "
        + (
            "nothing written (raise --max-float-nodes or lower --accuracy-target)."
            if limit < len(order)
            else "nothing written: every node was allowed in float (what is not a node, such as float8 "
            "embedding tables, stays as the recipe has it; lower --accuracy-target or try --preset none)."
        ),
        result,
    )
