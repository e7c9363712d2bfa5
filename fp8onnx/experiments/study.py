"""The papers' experiments on the user's own model, in one run: which format and scaling to trust.

One calibration pass (amax and |x| histograms) serves every configuration; every quantized model
is then evaluated in one ``compare`` pass over the data (the FP32 reference runs once per batch):

* formats E4M3FN / E5M2 / E3M4 (emulated), amax scaling - the PTQ paper's format comparison;
* scaling amax / pow2 / mx (OCP MX) / percentile / mse, and ``constant`` over a sweep of powers of two across the
  range the calibration saw - the FP8 LLM paper's FP8-AMAX versus FP8-CSCALE comparison;
* static versus dynamic (per tensor, per token) activation scales, and weight-only FP8; per-tensor
  versus per-channel weight scales;
* with ``techniques``: smoothing (alpha 0.5), GPTQ rounding, bias correction, their combinations
  and the presets (:data:`~fp8onnx.settings.config.PRESETS`) - each needs its own pass over the calibration
  data (smoothing changes the activations; GPTQ needs X^T X), so they are opt-in;
* the accuracy-target fallback to 99.5% and 99% of FP16 (:mod:`fp8onnx.workflows.fallback`), searched on the
  first half of the evaluation batches (the calibration data rarely has the labels that make the
  headline metric) and reported, like every row, on all of them.

The result is ranked by the headline metric (task accuracy, else top-1 agreement, else cosine)
with the papers' pass/fail criteria against FP16, and can be written as JSON, CSV and PNG plots.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import pathlib

import numpy as np

from fp8onnx.accuracy import plots
from fp8onnx.accuracy.compare import compare
from fp8onnx.accuracy.sensitivity import measure_sensitivity
from fp8onnx.base.scratch import temporary_dir
from fp8onnx.data.datasource import Data, as_data
from fp8onnx.data.feeds import LABELS, input_specs
from fp8onnx.graph.model_io import load_model, write_text_atomic
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.settings.choices import DEFAULT_OP_TYPES
from fp8onnx.settings.config import PRESETS, QuantizeConfig
from fp8onnx.settings.report import QuantizeReport, describe_config
from fp8onnx.workflows.api import calibrate
from fp8onnx.workflows.candidates import Candidates
from fp8onnx.workflows.fallback import search
from fp8onnx.workflows.quantizer import quantize

__all__ = ["StudyResult", "study", "study_configs", "technique_configs"]

logger = logging.getLogger(__name__)


def technique_configs() -> list[tuple[str, str, QuantizeConfig]]:
    """(label, "techniques", config) for the accuracy techniques beyond plain amax (``--techniques``)."""
    configs = [
        ("e4m3fn amax + smooth 0.5", QuantizeConfig(smooth=0.5)),
        ("e4m3fn amax + gptq", QuantizeConfig(weight_rounding="gptq")),
        ("e4m3fn amax + bias correction", QuantizeConfig(bias_correction=True)),
        ("e4m3fn per-token + gptq", QuantizeConfig(weight_rounding="gptq", activations="dynamic-per-token")),
        (
            "e4m3fn per-token + smooth + gptq",
            QuantizeConfig(weight_rounding="gptq", smooth=0.5, activations="dynamic-per-token"),
        ),
        ("e4m3fn weight-only + gptq", QuantizeConfig(activations="none", weight_rounding="gptq")),
    ]
    configs += [(f"preset {name}", QuantizeConfig.for_preset(name)) for name in PRESETS]
    return [(label, "techniques", config) for label, config in configs]


def study_configs(constant_scales: list[float]) -> list[tuple[str, str, QuantizeConfig]]:
    """(label, group, config) for every configuration of the study (without the techniques)."""
    configs = [
        (f"{f.value} amax", "format", QuantizeConfig(format=f))
        for f in (Fp8Format.E4M3FN, Fp8Format.E5M2, Fp8Format.E3M4)
    ]
    # the PTQ paper's baseline: symmetric int8, the same amax calibration, per tensor and per channel
    configs += [
        ("int8 amax", "format", QuantizeConfig(format="int8")),
        ("int8 amax per-channel", "format", QuantizeConfig(format="int8", per_channel=True)),
    ]
    configs += [(f"e4m3fn {s}", "scaling", QuantizeConfig(scaling=s)) for s in ("pow2", "mx", "percentile", "mse")]
    configs += [
        ("e4m3fn amax dynamic", "activations", QuantizeConfig(activations="dynamic")),
        ("e4m3fn dynamic per-token", "activations", QuantizeConfig(activations="dynamic-per-token")),
        ("e4m3fn weight-only", "activations", QuantizeConfig(activations="none")),
    ]
    configs += [("e4m3fn amax per-channel", "weights", QuantizeConfig(per_channel=True))]
    configs += [("e4m3fn amax + fp8 embeddings", "weights", QuantizeConfig(embeddings="fp8"))]
    configs += [
        (f"e4m3fn constant 2^{int(math.log2(s))}", "constant", QuantizeConfig(scaling="constant", scale=s))
        for s in constant_scales
    ]
    return configs


def constant_sweep(amaxes: list[float], fmt: Fp8Format = Fp8Format.E4M3FN, step: int = 2) -> list[float]:
    """Powers of two from below the smallest amax scale seen (every tensor saturates) to well above
    the largest (small values underflow): wide enough to show both edges of the working window."""
    usable = [a for a in amaxes if math.isfinite(a) and a > 0]
    if not usable:
        return [1.0]
    lo = math.floor(math.log2(min(usable) / fmt.fmax)) - 2
    hi = math.ceil(math.log2(max(usable) / fmt.fmax)) + 10
    return [2.0**k for k in range(lo, hi + 1, step)]


@dataclasses.dataclass
class StudyRow:
    label: str
    group: str
    config: dict
    metric: str
    value: float | None
    ratio_to_fp16: float | None
    rel_loss_vs_fp16: float | None
    passes_llm: bool | None
    passes_ptq: bool | None
    cosine_mean: float | None
    emulated: bool
    ratio_noise: float | None = None  # one standard error of ratio_to_fp16, paired with FP16's samples


@dataclasses.dataclass
class StudyResult:
    model: str
    samples: int
    calibration_samples: int
    fp32: float | None
    fp16: float | None
    metric: str
    rows: list[StudyRow]  # ranked, best first
    scale_exponents: dict[str, list[float]]  # log2 of per-tensor scales (amax, e4m3fn): weights, activations
    provider: str = "cpu"  # the execution provider every number was measured on

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_csv(self) -> str:
        buf = io.StringIO()
        fields = [f.name for f in dataclasses.fields(StudyRow) if f.name != "config"]
        writer = csv.DictWriter(buf, fieldnames=["rank", *fields])
        writer.writeheader()
        for rank, row in enumerate(self.rows, 1):
            d = dataclasses.asdict(row)
            d.pop("config")
            writer.writerow({"rank": rank, **d})
        return buf.getvalue()

    def table(self) -> str:
        head = ["#", "configuration", "group", self.metric, "vs FP16", "99.5%", "1% rel", "cos mean"]
        rows = [
            [
                str(i),
                r.label + (" (emulated)" if r.emulated else ""),
                r.group,
                _f(r.value, ".4f"),
                _f(r.ratio_to_fp16, ".2%") + (f" ±{r.ratio_noise:.2%}" if r.ratio_noise else ""),
                _yes(r.passes_llm),
                _yes(r.passes_ptq),
                _f(r.cosine_mean, ".5f"),
            ]
            for i, r in enumerate(self.rows, 1)
        ]
        widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
        lines = [
            f"{self.model}: {len(self.rows)} configurations, calibrated on {self.calibration_samples} samples, "
            f"evaluated on {self.samples} ({self.provider}); FP32 {_f(self.fp32, '.4f')}, FP16 {_f(self.fp16, '.4f')} "
            f"({self.metric})",
            "  ".join(h.ljust(w) for h, w in zip(head, widths)),
            "  ".join("-" * w for w in widths),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        best = next((r for r in self.rows if not r.emulated), None)
        if best:
            lines.append(f"best deployable: {best.label} ({describe_config(best.config)})")
        if any(r.ratio_noise for r in self.rows):
            lines.append(
                f"±: one standard error of the ratio to FP16, paired over the {self.samples} evaluation samples "
                "(LM windows); configurations within twice it of each other are not told apart by this data"
            )
        return "\n".join(lines)


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _yes(v):
    return "-" if v is None else ("pass" if v else "FAIL")


def study(
    model: str | os.PathLike,
    calib: Data,
    data: Data,
    *,
    constant_scales: list[float] | None = None,
    max_samples: int | None = None,
    techniques: bool = False,
    metric: str = "auto",
    run: RunOptions | None = None,
    **run_options,
) -> StudyResult:
    """Quantize ``model`` in every study configuration (with ``techniques``, also
    :func:`technique_configs`) and rank them on ``data`` by ``metric`` (compare's headline)."""
    run = RunOptions.of(run, **run_options)
    stats = calibrate(model, calib, run=run)
    quiet = RunOptions.of(run, progress=False)  # one bar for calibration and one per evaluated model
    with temporary_dir("fp8onnx-study-") as tmp:
        reports: dict[str, tuple[str, QuantizeConfig, QuantizeReport]] = {}
        configs = study_configs([])
        # The constant sweep spans the scales amax scaling chose, so it needs one amax run first.
        first = _run_config(model, tmp, configs[0], stats, quiet, reports)
        amaxes = [a for n in first.quantized for t in n.tensors if t.amax is not None for a in np.ravel(t.amax)]
        sweep = constant_scales or constant_sweep([float(a) for a in amaxes])
        for item in study_configs(sweep)[1:]:
            _run_config(model, tmp, item, stats, quiet, reports)
        for item in technique_configs() if techniques else []:
            _run_config(model, tmp, item, stats, quiet, reports, calib)
        for item in _fallback_configs(model, data, stats, max_samples, quiet, metric):
            _run_config(model, tmp, item, stats, quiet, reports)
        paths = [pathlib.Path(tmp) / f"{i}.onnx" for i in range(len(reports))]
        unique, same_as = _distinct(paths)
        result = compare(model, unique, data, max_samples=max_samples, generate=0, memory=False, metric=metric, run=run)
    by_file = {r.name: r for r in result.rows}
    by_file.update({name: by_file[first] for name, first in same_as.items()})
    listed = enumerate(reports.items())
    rows = [_row(label, group, config, by_file[f"{i}.onnx"]) for i, (label, (group, config, _)) in listed]
    rows.sort(key=lambda r: -math.inf if r.value is None else r.value, reverse=True)
    tensors = {t.name: (t.kind, t.scale) for n in first.quantized for t in n.tensors if isinstance(t.scale, float)}
    scales: dict[str, list[float]] = {"weights": [], "activations": []}
    for kind, scale in tensors.values():
        scales["weights" if kind == "weight" else "activations"].append(math.log2(scale))
    fp16 = by_file.get("FP16") if result.baseline == "FP16" else None  # FP16 overflowed: ratios are to FP32's
    return StudyResult(
        str(model),
        result.samples,
        stats.num_samples,
        by_file["FP32 (reference)"].value,
        fp16.value if fp16 else None,
        rows[0].metric if rows else "",
        rows,
        scales,
        result.provider,
    )


def _row(label: str, group: str, config: QuantizeConfig, r) -> StudyRow:
    """A configuration's line of the study from its compare row ``r``."""
    cosine = next(iter(r.outputs.values()))["cosine_mean"]
    return StudyRow(
        label,
        group,
        config.to_json(),
        r.headline,
        r.value,
        r.ratio_to_fp16,
        r.rel_loss_vs_fp16,
        r.passes_llm,
        r.passes_ptq,
        cosine,
        config.emulated,
        r.ratio_noise,
    )


FALLBACK_TARGETS = (99.5, 99.0)  # the FP8 LLM paper's criterion, and the PTQ paper's 1% relative loss


def _fallback_configs(
    model, data, stats, max_samples, run: RunOptions, metric: str = "auto"
) -> list[tuple[str, str, QuantizeConfig]]:
    """The default configuration with the fewest most sensitive nodes in float such that each of
    ``FALLBACK_TARGETS`` holds on the first half of ``data`` (one sensitivity pass on it, candidates
    shared between the targets)."""

    feeds = []
    ir_model = load_model(model)
    for batch in as_data(data, input_specs(ir_model), ir_model).batches(run.batch):
        feeds.append(batch.feed if batch.labels is None else {**batch.feed, LABELS: batch.labels})
        if max_samples is not None and sum(len(next(iter(f.values()))) for f in feeds) >= max_samples:
            break
    half = feeds[: max(1, len(feeds) // 2)]
    config = QuantizeConfig()
    sens = measure_sensitivity(model, None, half, config=config, stats=stats, run=run)
    order = [n.name for n in sens.order()]
    configs = []
    with Candidates(model, config, stats, half, run, metric=metric) as candidates:
        for target in FALLBACK_TARGETS:
            _, chosen = search(sens, candidates, target, len(order))
            if chosen is None:
                logger.info("study: %g%% of FP16 not reached on half the data even with every node in float", target)
                continue
            label = f"e4m3fn amax fallback {target:g}% ({chosen} float)"
            configs.append((label, "fallback", dataclasses.replace(config, keep_float=tuple(order[:chosen]))))
    return configs


def _run_config(model, tmp, item, stats, run: RunOptions, reports, calib=None) -> QuantizeReport:
    """Quantize one configuration from the shared statistics, or from ``calib`` when it needs
    its own pass over the data (GPTQ, smoothing, bias correction; other op types than the stats')."""
    label, group, config = item
    out = pathlib.Path(tmp) / f"{len(reports)}.onnx"
    if calib is not None and (config.weights_need_data or set(config.op_types) != set(DEFAULT_OP_TYPES)):
        report = quantize(model, out, calib, config=config, run=run)
    else:
        use_stats = stats if config.activations == "static" else None
        report = quantize(model, out, config=config, stats=use_stats, run=run)
    logger.info("study: %s -> %s", label, out.name)
    reports[label] = (group, config, report)
    return report


def _distinct(paths: list[pathlib.Path]) -> tuple[list[pathlib.Path], dict[str, str]]:
    """The models to evaluate, and for each byte-identical repeat (e.g. a fallback that kept no node
    in float is the plain amax model) the name of the first: evaluated once, its row reused."""
    first: dict[bytes, str] = {}
    unique, same_as = [], {}
    for path in paths:
        digest = hashlib.sha256(path.read_bytes())
        side = path.with_name(path.name + ".data")
        if side.exists():
            with open(side, "rb") as fh:
                digest.update(hashlib.file_digest(fh, "sha256").digest())
        key = digest.digest()
        if key in first:
            same_as[path.name] = first[key]
        else:
            first[key] = path.name
            unique.append(path)
    if same_as:
        logger.info("study: %d configurations give byte-identical models, evaluated once", len(same_as))
    return unique, same_as


def write_outputs(result: StudyResult, json_path=None, csv_path=None) -> None:
    if json_path:
        write_text_atomic(json_path, json.dumps(result.to_json(), indent=1) + "\n")
    if csv_path:
        write_text_atomic(csv_path, result.to_csv())


PLOT_FILES = ("constant_scale_window.png", "scale_exponents.png")


def write_plots(result: StudyResult, folder: str | os.PathLike) -> list[pathlib.Path]:
    """Accuracy against constant scale (the paper's window) and the per-tensor scale exponents."""
    const = sorted((r.config["scale"], r.value) for r in result.rows if r.group == "constant" and r.value is not None)
    amax = next((r.value for r in result.rows if r.label == "e4m3fn amax"), None)
    return [
        plots.constant_window(const, amax, result.fp16, result.metric, pathlib.Path(folder) / PLOT_FILES[0]),
        plots.scale_exponents(result.scale_exponents, pathlib.Path(folder) / PLOT_FILES[1]),
    ]
