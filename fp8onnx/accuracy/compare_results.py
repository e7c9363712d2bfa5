"""``compare``'s results: a row per model (:class:`RowResult`), the table, the JSON, and the headline
metric each row is put against FP16 with."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from fp8onnx.accuracy.metrics import (
    LLM_RATIO,
    PTQ_REL_LOSS,
    _accuracy,
    _perplexity,
    _Score,
    _to_json,
    difference_se,
)
from fp8onnx.base.errors import Fp8OnnxError

logger = logging.getLogger(__name__)

_REFERENCE = "FP32 (reference)"


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
    generation: dict | None = None  # greedy generation vs FP32 (fp8onnx.accuracy.generation.agreement)
    # one standard error, paired over the samples, of each figure's difference from FP32's (NOISE_OF), and
    # of ratio_to_fp16 (paired with FP16's samples)
    noise: dict[str, float | None] = dataclasses.field(default_factory=dict)
    headline_key: str = ""  # the headline's key in fp8onnx.accuracy.metrics.STATISTICS
    columns: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)  # per-sample sums

    @property
    def accuracy_noise(self) -> float | None:
        return self.noise.get("accuracy")

    @property
    def ratio_noise(self) -> float | None:
        return self.noise.get("ratio_to_fp16")

    @property
    def passes_llm(self) -> bool | None:
        return None if self.ratio_to_fp16 is None else self.ratio_to_fp16 >= LLM_RATIO

    @property
    def passes_ptq(self) -> bool | None:
        return None if self.rel_loss_vs_fp16 is None else self.rel_loss_vs_fp16 <= PTQ_REL_LOSS

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "columns"}
        d["samples"] = len(next(iter(self.columns.values()))) if self.columns else 0
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
    baseline: str = "FP16"  # the row "vs FP16" is measured against: _REFERENCE where FP16 overflows

    def to_json(self) -> dict:
        return {
            "reference": self.reference,
            "data": self.data,
            "samples": self.samples,
            "batches": self.batches,
            "provider": self.provider,
            "generation": self.generation,
            "baseline": self.baseline,
            "criteria": {"llm_ratio_to_fp16": LLM_RATIO, "ptq_rel_loss_vs_fp16": PTQ_REL_LOSS},
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
        }

    def table(self) -> str:
        first = next(iter(self.rows[0].outputs)) if self.rows and self.rows[0].outputs else None
        head = _COLUMNS
        lines = [_cells(r, r.outputs.get(first, {}) if first is not None else {}) for r in self.rows]
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        out = [f"{self.samples} samples from {self.data}, output {first!r} vs the FP32 reference ({self.provider})"]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.append("  ".join("-" * w for w in widths))
        out.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)
        out.extend(f"note: {n}" for n in self.notes)
        if any(r.noise for r in self.rows):
            columns = self.rows[0].columns
            units = len(columns.get("correct", columns.get("cos", ())))
            what = "items" if any(n.startswith("Task ") for n in self.notes) else "samples"
            out.append(
                f"±: one standard error of the figure's difference from FP32's (for vs FP16: of the ratio), paired "
                f"over the {units} {what} (jackknife; a sample is one index of the outputs' first axis, a language "
                "model's window; a task's unit is its item); a difference within twice it is within chance"
            )
        headline = next((r.headline for r in self.rows if r.headline), "")
        if headline:
            base = "the FP16 model's" if self.baseline == "FP16" else "the FP32 reference's (FP16 overflows: note)"
            out.append(
                f"vs FP16: {headline} relative to {base}; pass at >= 99.5% (FP8 LLM paper) "
                "and within 1% relative loss (PTQ paper)"
            )
        if any(r.latency_ms is not None for r in self.rows):
            out.append(
                f"ms/batch: median onnxruntime time per batch after a warm-up one; MiB: heap the session holds "
                f"({self.provider}). On the CPU EP FP8 buys file size, not speed or memory: it has no FP8 GEMM; "
                "these sessions set session.disable_quant_qdq=1, which dequantizes each float8 weight once at load "
                "(at onnxruntime's defaults, again at every run; here too where once at load would not fit the memory "
                "available: a note names the model)."
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


def _row(name, path, score: _Score, labelled: int) -> RowResult:
    row = RowResult(
        name, path, _to_json(score.outputs), _accuracy(score.correct, labelled), _perplexity(score.nll, labelled)
    )
    first = next(iter(score.outputs), None)
    row.columns = score.columns(first) if first is not None else {}
    return row


# compare's figures with a noise: their key in RowResult.noise -> the statistic (metrics.STATISTICS)
NOISE_OF = {"accuracy": "accuracy", "perplexity": "perplexity", "top1_agreement": "top1", "cosine_mean": "cosine"}


def _noise(rows: list[RowResult], fp16: RowResult | None) -> None:
    """Each row's paired standard errors: of each figure minus FP32's, and of its headline ratio to FP16."""
    reference = rows[0].columns
    for r in rows[1:]:
        r.noise = {key: difference_se(kind, r.columns, reference) for key, kind in NOISE_OF.items()}
        if fp16 is not None and r is not fp16 and r.headline_key:
            r.noise["ratio_to_fp16"] = difference_se(r.headline_key, r.columns, fp16.columns, ratio=True)
        r.noise = {k: v for k, v in r.noise.items() if v is not None}


def ratio_to(row: RowResult, base: RowResult) -> tuple[float | None, float | None]:
    """``row``'s headline over ``base``'s (FP16's, scored in an earlier run on the same data), with the
    ratio's paired standard error."""
    if row.value is None or not base.value:
        return None, None
    return row.value / base.value, difference_se(row.headline_key, row.columns, base.columns, ratio=True)


def _headline(rows: list[RowResult], first: str, fp16: bool, metric: str = "auto") -> str | None:
    """Each row's headline figure and its ratio to FP16's (with its noise). Where the FP16 row's ``first``
    output holds an inf or a NaN (float16 overflowed: Gemma 3's residual stream passes 65,504), the ratios
    are to the FP32 reference's instead; then the sentence that says so is returned, else None."""
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
    fp16_row = next((r for r in rows if r.name == "FP16"), None) if fp16 else None
    overflow = None
    if fp16_row is not None and fp16_row.outputs[first].get("nonfinite_rows"):
        bad, total = fp16_row.outputs[first]["nonfinite_rows"], _rows_scored(fp16_row)
        overflow = (
            f"FP16 overflows on this model: its {first!r} holds an inf or a NaN in {bad} of {total} rows (float16 "
            "holds at most 65,504 and an activation passed it), so its figures mean nothing; 'vs FP16' and the "
            "pass marks are against the FP32 reference instead."
        )
        logger.warning("%s", overflow)
        fp16_row = rows[0]
    base = key(fp16_row) if fp16_row is not None else None
    for r in rows:
        r.headline, r.value, r.headline_key = label, key(r), metric
        if base and r.value is not None and r.name not in (_REFERENCE, "FP16"):
            r.ratio_to_fp16 = r.value / base
            r.rel_loss_vs_fp16 = (base - r.value) / base
    _noise(rows, fp16_row if base else None)
    return overflow


def _rows_scored(row: RowResult) -> int:
    """How many rows of its headline output a row's statistics counted (its per-sample row weights summed)."""
    columns = row.columns
    return int(sum(columns["rows"])) if "rows" in columns else 0


_COLUMNS = (
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
)


def _pm(value, noise, spec: str, noise_spec: str = "") -> str:
    """A figure and its standard error: ``0.6217 ±0.0008``."""
    return _fmt(value, spec) + (f" ±{noise:{noise_spec or spec}}" if value is not None and noise else "")


def _cells(r, o: dict) -> list[str]:
    """A compare row's cells under _COLUMNS; ``o``: its first output's statistics."""
    n = r.noise
    return [
        r.name,
        _pm(o.get("cosine_mean"), n.get("cosine_mean"), ".5f"),
        _fmt(o.get("cosine_min"), ".4f"),
        _fmt(o.get("rel_l2"), ".4f"),
        _fmt(o.get("max_abs_err"), ".3g"),
        _pm(o.get("top1_agreement"), n.get("top1_agreement"), ".4f"),
        _pm(r.accuracy, n.get("accuracy"), ".4f"),
        _pm(r.perplexity, n.get("perplexity"), ".2f", ".3f"),
        _pm(r.ratio_to_fp16, r.ratio_noise, ".2%"),
        _yes(r.passes_llm),
        _yes(r.passes_ptq),
        _fmt(r.latency_ms, ".1f"),
        _fmt(r.session_mib, ".0f"),
    ]
