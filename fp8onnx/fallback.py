"""Quantize to a stated accuracy: keep the fewest, most sensitive nodes in float until the headline
metric on held-out data is at least ``target`` percent of the FP16 model's.

The order comes from :mod:`fp8onnx.sensitivity` (one pass), the statistics from one calibration
pass shared by every candidate. Candidates keeping the top 0, 1, 2, 4, 8, ... nodes in float are
evaluated together in one ``compare`` run (one FP32 reference pass for all); the smallest count that
meets the target is then narrowed down between the last failing and the first passing count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import tempfile

from .api import calibrate
from .compare import compare
from .config import QuantizeConfig
from .errors import Fp8OnnxError
from .guard import as_path, check_paths, model_reads, model_writes
from .model_io import write_text_atomic
from .quantize import quantize
from .report import QuantizeReport
from .runtime import RunOptions
from .sensitivity import sensitivity

__all__ = ["FallbackResult", "quantize_to_target"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FallbackResult:
    target: float  # percent of FP16's headline metric
    metric: str
    tried: dict[int, float | None]  # nodes kept in float -> headline relative to FP16 (fraction)
    kept_in_float: list[str]  # the chosen nodes, most sensitive first
    met: bool
    report: QuantizeReport
    sensitivity: list[dict] = dataclasses.field(default_factory=list)  # per node, as SensitivityResult.to_json()

    def summary(self) -> str:
        lines = [self.report.summary()]
        verdict = "met" if self.met else "NOT met (the closest is written)"
        lines.append(f"  accuracy target {self.target:g}% of FP16 ({self.metric}): {verdict}")
        for k, ratio in sorted(self.tried.items()):
            shown = "-" if ratio is None else f"{ratio:.2%}"
            mark = "  <- written" if k == len(self.kept_in_float) else ""
            lines.append(f"    {k:>4} nodes in float: {shown}{mark}")
        if self.kept_in_float:
            shown = ", ".join(self.kept_in_float[:8]) + (" ..." if len(self.kept_in_float) > 8 else "")
            lines.append(f"  kept in float (most sensitive first): {shown}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "target_pct_of_fp16": self.target,
            "metric": self.metric,
            "tried": {str(k): v for k, v in sorted(self.tried.items())},
            "kept_in_float": self.kept_in_float,
            "met": self.met,
            "report": self.report.to_json(),
        }


def _counts(limit: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``limit`` (always included)."""
    counts, k = [0], 1
    while k < limit:
        counts.append(k)
        k *= 2
    return sorted(set(counts + [limit]))


def quantize_to_target(
    model: str | os.PathLike,
    output: str | os.PathLike,
    calib,
    eval_data,
    *,
    target: float = 99.5,
    max_float_nodes: int | None = None,
    config: QuantizeConfig | None = None,
    report: str | os.PathLike | None = None,
    run: RunOptions | None = None,
    **options,
) -> FallbackResult:
    """Quantize ``model`` keeping the fewest most sensitive nodes in float (at most
    ``max_float_nodes``) such that its headline metric on ``eval_data`` is >= ``target``% of FP16's."""
    run_kw, options = RunOptions.split(options)
    run = RunOptions.of(run, **run_kw)
    config = config or QuantizeConfig(**options)
    if not 0 < target <= 100:
        raise Fp8OnnxError(f"--accuracy-target must be a percentage in (0, 100], got {target!r}.")
    if max_float_nodes is not None and max_float_nodes < 0:
        raise Fp8OnnxError(f"--max-float-nodes must be >= 0, got {max_float_nodes!r}.")
    if calib is None:
        raise Fp8OnnxError("--accuracy-target needs --calib DATA (the sensitivity and the scales come from it).")
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", as_path(calib)), ("the evaluation data", as_path(eval_data))],
        model_writes("the output model", output) + [("the report", report)],
    )
    quiet = RunOptions.of(run, progress=False)
    sens = sensitivity(model, calib, config=config, run=run)
    order = [n.name for n in sens.ranked()]
    limit = len(order) if max_float_nodes is None else min(max_float_nodes, len(order))
    stats = None if config.activations == "dynamic" else calibrate(model, calib, precision=config.precision, run=quiet)

    def variant(k: int) -> QuantizeConfig:
        return dataclasses.replace(config, keep_float=tuple(order[:k]))

    tried: dict[int, float | None] = {}
    metric = ""
    with tempfile.TemporaryDirectory(prefix="fp8onnx-fallback-") as tmp:

        def evaluate(counts: list[int]) -> None:
            nonlocal metric
            paths = []
            for k in counts:
                path = pathlib.Path(tmp) / f"keep{k}.onnx"
                quantize(model, path, config=variant(k), stats=stats, run=quiet)
                paths.append(path)
            result = compare(model, paths, eval_data, run=run)
            by_name = {r.name: r for r in result.rows}
            for k, path in zip(counts, paths):
                row = by_name[path.name]
                tried[k] = row.ratio_to_fp16
                metric = row.headline
            if all(tried[k] is None for k in counts):
                raise Fp8OnnxError(f"No FP16 baseline to hold the target against: {'; '.join(result.notes)}")

        def passing() -> list[int]:
            return sorted(k for k, r in tried.items() if r is not None and r * 100 >= target)

        evaluate(_counts(limit))
        while passing():
            best = passing()[0]
            below = max((k for k in tried if k < best), default=None)
            if below is None or best - below <= 1:
                break
            evaluate([(below + best) // 2])  # narrow down between the last failing and the first passing
    met = bool(passing())
    chosen = passing()[0] if met else max(tried, key=lambda k: (tried[k] or 0.0, -k))
    final = quantize(model, output, config=variant(chosen), stats=stats, run=run)
    logger.info("kept %d nodes in float for %g%% of FP16 (%s)", chosen, target, "met" if met else "not met")
    result = FallbackResult(target, metric, tried, order[:chosen], met, final, sens.to_json()["nodes"])
    if report is not None:  # the usual report, plus how the target was met and the sensitivity it used
        doc = {**final.to_json(), "accuracy_target": result.to_json(), "sensitivity": result.sensitivity}
        del doc["accuracy_target"]["report"]
        write_text_atomic(report, json.dumps(doc, indent=1) + "\n")
    return result
