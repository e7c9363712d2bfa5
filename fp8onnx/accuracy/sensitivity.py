"""Per-node sensitivity to FP8: the error each quantizable node contributes when only it is quantized.

One instrumented pass over the data, not one evaluation per node. Every node the plan would
quantize gets a *shadow*: the same op on the same inputs, but reading them through the Q/DQ that
``quantize`` would insert (same scales, from the same calibration). The float node keeps feeding
the rest of the graph, so each shadow sees exactly the inputs of the float model and measures that
node alone. Per node, the graph reduces ``sum((y_fp8 - y)^2)`` and ``sum(y^2)`` to two float32
scalars per batch; only those leave onnxruntime. The result is the SQNR of each node's output in dB
(low = sensitive), ranked.

SQNR is a proxy: what a user cares about is the end metric, and a node's error can be amplified or
absorbed downstream. :func:`fp8onnx.workflows.fallback.sensitivity` (``fp8onnx sensitivity --eval``) checks
the ``refine`` lowest-SQNR nodes against held-out data, a layer above this one: one ``compare`` run
scores the all-FP8 model and, per node, the model with only that node left in float
(:class:`fp8onnx.workflows.candidates.Candidates`); the gain in the headline metric (percentage points of
FP16's) then orders those nodes first (:meth:`SensitivityResult.order`), the rest by SQNR.

Weights of a vocabulary-sized projection (an ``lm_head``: as many output channels as an embedding
table has rows, or at least ``VOCAB_SIZE`` of them) are flagged as high-risk: FP8 recipes for LLMs
leave them in float by default, and on SmolLM2 it is the most sensitive node by far.

Nodes inside If/Loop/Scan bodies are not measured (onnxruntime cannot return tensors from inside a
body); they are listed with that reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

from fp8onnx.accuracy.budget import Budget, budget_rows
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import FeedData, input_specs
from fp8onnx.graph import known
from fp8onnx.graph.guard import check_calibration_source
from fp8onnx.graph.model_io import write_text_atomic
from fp8onnx.graph.plan import activation_tensors, plan, vocabulary_projections
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.graph.run_settings import RunOptions, entry_settings
from fp8onnx.pipeline.calibration import Stats
from fp8onnx.pipeline.statistics import measure
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.techniques.scales import activation_stats, assign_scales

__all__ = ["NodeSensitivity", "SensitivityResult", "measure_sensitivity", "measure_with"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class NodeSensitivity:
    name: str
    op_type: str
    sqnr_db: float | None  # None: not measured (see reason)
    rank: int | None = None  # 1 = the most sensitive (lowest SQNR)
    reason: str | None = None
    risk: str | None = None  # why this node is high-risk whatever its SQNR (a vocabulary projection)
    metric_ratio: float | None = None  # with refinement: headline / FP16's with only this node in float
    metric_gain: float | None = None  # ... minus that of the all-FP8 model (a fraction of FP16's metric)
    gain_noise: float | None = None  # one standard error of metric_gain, paired over the evaluation samples


@dataclasses.dataclass
class SensitivityResult:
    model: str
    config: dict
    samples: int
    batches: int
    nodes: list[NodeSensitivity]  # graph order
    metric: str = ""  # with refinement: the headline metric compared
    base_ratio: float | None = None  # with refinement: the all-FP8 model's headline / FP16's
    evaluations: int = 0  # models scored on the end metric
    stats: Stats | None = dataclasses.field(default=None, repr=False)  # the statistics the scales came from
    budget: list | None = None  # with budget=True: fp8onnx.accuracy.budget.NodeBudget per measured node

    def ranked(self) -> list[NodeSensitivity]:
        """Measured nodes by SQNR, lowest first."""
        measured = [(n.rank, n) for n in self.nodes if n.rank is not None]
        return [n for _, n in sorted(measured, key=lambda pair: pair[0])]

    def order(self) -> list[NodeSensitivity]:
        """The order to leave nodes in float: refined nodes by end-metric gain (largest first), then
        the rest by SQNR. Without refinement, :meth:`ranked`."""
        ranked = self.ranked()
        gains = [(n.metric_gain, n.rank, n) for n in ranked if n.metric_gain is not None and n.rank is not None]
        refined = [n for _, _, n in sorted(gains, key=lambda item: (-item[0], item[1]))]
        return refined + [n for n in ranked if n.metric_gain is None]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "config": self.config,
            "samples": self.samples,
            "batches": self.batches,
            "metric": "SQNR in dB of the node's output with only that node quantized (lower = more sensitive)"
            if self.config.get("fallback", "nodes") == "nodes"
            else "SQNR in dB of the node's output with only its activation quantized (lower = more sensitive)",
            "end_metric": self.metric or None,
            "base_ratio_to_fp16": self.base_ratio,
            "evaluations": self.evaluations,
            "order": [n.name for n in self.order()],
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            **({"budget": [_budget_json(b) for b in self.budget]} if self.budget is not None else {}),
        }

    def table(self, top: int | None = None) -> str:
        rows = self.ranked()[:top] if top else self.ranked()
        width = max([len("node"), *(len(n.name) for n in rows)])
        refined = self.base_ratio is not None
        what = "it" if self.config.get("fallback", "nodes") == "nodes" else "its activation"
        lines = [
            f"{self.model}: {len(self.ranked())} nodes measured on {self.samples} samples; SQNR of each node's "
            f"output with only {what} in FP8 (lowest first)",
            f"{'rank':>4}  {'node':<{width}}  {'op':<13}  {'SQNR dB':>7}" + ("  gain if float" if refined else ""),
        ]
        for n in rows:
            shown = "-" if n.sqnr_db is None else "inf" if math.isinf(n.sqnr_db) else f"{n.sqnr_db:.2f}"
            line = f"{n.rank:>4}  {n.name:<{width}}  {n.op_type:<13}  {shown:>7}"
            if refined:
                noise = f" ±{n.gain_noise * 100:.2f}" if n.gain_noise else ""
                line += f"  {n.metric_gain * 100:+12.2f}{noise}" if n.metric_gain is not None else f"  {'-':>12}"
            lines.append(line + (f"  HIGH RISK: {n.risk}" if n.risk else ""))
        if refined:
            lines.append(
                f"  gain if float: {self.metric} in points of FP16's when only that node stays in float (± one "
                f"standard error, paired over the samples); all in FP8: {self.base_ratio:.2%} of FP16 "
                f"({self.evaluations} models evaluated)"
            )
        reasons: dict[str, list[str]] = {}
        for n in self.nodes:
            if n.rank is None:
                reasons.setdefault(n.reason or "", []).append(n.name)
        for reason, names in reasons.items():
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} nodes)" if len(names) > 3 else "")
            lines.append(f"  not measured: {shown}: {reason}")
        if self.budget is not None:
            lines.append(budget_rows(self.budget, top))
        return "\n".join(lines)


def _budget_json(b) -> dict:
    return {**dataclasses.asdict(b), "range_share": b.range_share, "mostly": b.verdict()}


def measure_sensitivity(
    model: str | os.PathLike,
    calib=None,
    data=None,
    *,
    config: QuantizeConfig | None = None,
    stats: str | os.PathLike | Stats | None = None,
    run: RunOptions | None = None,
    budget: bool = False,
    **options,
) -> SensitivityResult:
    """Rank the nodes ``quantize`` would quantize (with ``config``, or ``options`` that build one) by
    the SQNR of their output when only they are in FP8: one pass over the data. Scales come from
    ``calib`` (or ``stats``); the measurement runs on ``data`` (default: the calibration data).
    Scoring the lowest-SQNR nodes on an end metric is :func:`fp8onnx.workflows.fallback.sensitivity`'s (it
    quantizes and evaluates whole models, a layer above this one). ``budget``: also the FP8 error budget of
    each node (:mod:`fp8onnx.accuracy.budget`: weight vs activation, range vs mantissa) in the same pass."""
    config, run = entry_settings(config, run, options, preset=None)
    check_calibration_source(calib, stats)
    return measure_with(model, calib, data, config, run, stats=stats, budget=budget)


def measure_with(
    model: str | os.PathLike,
    calib,
    data,
    config: QuantizeConfig,
    run: RunOptions,
    *,
    stats: str | os.PathLike | Stats | None = None,
    budget: bool = False,
) -> SensitivityResult:
    """:func:`measure_sensitivity` for a caller that has built its settings and checked its sources at its own
    entry (``quantize``'s report, the accuracy search): nothing is built or checked again.

    requires: ``run.provider`` resolved; at most one of ``calib`` and ``stats``. ensures: as
    :func:`measure_sensitivity`."""
    ir_model, _, _ = prepare_model(model, config.precision)
    calib, data = _sources(calib, data, ir_model)
    decisions, skipped = plan(ir_model, config)
    risks = vocabulary_projections(ir_model, [d.node for d in decisions])
    calibration = activation_stats(ir_model, activation_tensors(decisions, ir_model), config, calib, stats, run)
    quant, _ = assign_scales(decisions, ir_model, config, calibration)

    measured, rows = [], []
    for d in decisions:
        if d.node.graph is not ir_model.graph:
            rows.append(NodeSensitivity(known.name(d.node), d.node.op_type, None, reason="inside a subgraph"))
            continue
        rows.append(NodeSensitivity(known.name(d.node), d.node.op_type, None))
        measured.append(d)
    source = data
    if source is None:
        raise Fp8OnnxError("Sensitivity needs data to run on: pass --calib DATA (and optionally --data DATA).")
    # every measured node's shadow with all its inputs quantized (for --fallback activations: its activation
    # alone, the part the accuracy search can take back); with budget, also the split shadows
    kind = "activation" if config.fallback == "activations" else "all"
    split = Budget(measured, quant, kinds=None if budget else (kind,))
    done = measure(ir_model, [split], source, run, "sensitivity")
    samples, batches = done.num_samples, done.num_batches
    _rank(rows, _sqnr_db(measured, split, kind))
    rows += [NodeSensitivity(n.name, n.op_type, None, reason=n.reason) for n in skipped]
    for row in rows:
        row.risk = risks.get(row.name)
    result = SensitivityResult(str(model), config.to_json(), samples, batches, rows, stats=calibration)
    result.budget = split.rows() if budget else None
    return result


def _sources(calib, data, ir_model) -> tuple:
    """(calib, data) as the data sources every step reads, converted once; ``calib`` readable twice where
    it serves as ``data`` too (feeds given as an iterator)."""
    specs = input_specs(ir_model)
    calib = None if calib is None else as_data(calib, specs, ir_model)
    if data is None:
        return calib, calib.readable_again() if isinstance(calib, FeedData) else calib
    return calib, as_data(data, specs, ir_model)


def _sqnr_db(measured, split: Budget, kind: str) -> dict[str, float]:
    """Each measured node's SQNR in dB: its output's energy over the squared error of its ``kind``
    shadow (inf where the shadow is exact)."""
    by_name = {}
    for d, names in zip(measured, split.sensitivity_outputs(kind)):
        if names is None:
            continue
        err, energy = (split.sums.get(o, 0.0) for o in names)
        by_name[d.node.name] = math.inf if err == 0 else (10 * math.log10(energy / err) if energy > 0 else -math.inf)
    return by_name


def _rank(rows: list[NodeSensitivity], sqnr_db: dict[str, float]) -> None:
    """Fills each row's SQNR and rank (1: the lowest SQNR, the most sensitive); a row without one says why."""
    for row in rows:
        if row.name in sqnr_db:
            row.sqnr_db = sqnr_db[row.name]
        elif row.reason is None:
            row.reason = "its activation is not quantized (nothing to keep in float with --fallback activations)"
    scored = [(r.sqnr_db, r) for r in rows if r.sqnr_db is not None]
    for rank, (_, row) in enumerate(sorted(scored, key=lambda pair: pair[0]), 1):
        row.rank = rank


def write_json(result: SensitivityResult, path) -> None:
    write_text_atomic(path, json.dumps(result.to_json(), indent=1) + "\n")
