"""Variants of one quantized model that differ only in which nodes stay in float, scored together.

The sensitivity refinement and the accuracy-target search both ask the same question many times:
what is the headline metric (relative to FP16's) when these nodes are left in float? Every variant
is quantized with the same statistics (no new calibration) into a private temporary folder, and a
round of variants is evaluated in one ``compare`` run, so the FP32 reference runs once per round,
not once per variant, and the FP16 baseline only in the first round (its headline value is kept).
Results are cached: a variant is never quantized or evaluated twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

from fp8onnx.accuracy.compare import compare
from fp8onnx.accuracy.compare_results import RowResult, ratio_to
from fp8onnx.accuracy.evaluation import ReferenceRun
from fp8onnx.accuracy.metrics import gain_se
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.scratch import make_dir, remove
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.pipeline.calibration import Stats
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.workflows.quantizer import quantize_with

__all__ = ["Candidates"]

logger = logging.getLogger(__name__)


class Candidates:
    """``with Candidates(model, config, stats, eval_data, run) as c: c.ratios([(), ("lm_head",)])``

    requires: ``stats`` are the statistics ``config`` needs (None for dynamic activations);
    ensures: ``ratios`` returns, per variant, its headline metric / FP16's (None where there is no
    FP16 baseline) and counts each distinct variant once in ``evaluated``; ``noise`` the standard error of
    each such ratio, paired with FP16's samples (None with fewer than 2 samples).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        config: QuantizeConfig,
        stats: Stats | None,
        eval_data,
        run: RunOptions,
        calib=None,
        metric: str = "auto",
        needs_data: bool = False,
    ):
        self.model, self.config, self.stats, self.eval_data, self.run = model, config, stats, eval_data, run
        self.headline = metric  # compare's --metric: which headline the variants are scored on
        self.calib = calib  # for configs whose weights read the data (GPTQ, smoothing, bias correction)
        self.needs_data = needs_data  # the recipe --preset auto resolves to reads it (config alone cannot say)
        self.metric = ""
        self.evaluated = 0  # distinct variants quantized and evaluated
        self.rounds = 0  # compare runs
        self._cache: dict[frozenset[str], RowResult] = {}  # each variant's compare row (per-sample sums too)
        self._fp16: RowResult | None = None  # FP16's row (headline value, per-sample sums), from the first round
        self.baseline = "FP16"  # or "FP32" where FP16 overflows (compare's baseline, its note says so)
        self.samples = 0  # samples of the evaluation data (the unit of the noise)
        self.labelled = 0  # labelled positions among them (a language model's tokens)
        self._tmp: str | None = None

    def __enter__(self) -> Candidates:
        self._tmp = make_dir("fp8onnx-candidates-")
        self._reference = ReferenceRun()  # FP32's outputs, run once for every round
        return self

    def __exit__(self, *exc) -> None:
        self._reference.close()
        if self._tmp is not None:
            remove(self._tmp)

    def config_keeping(self, keep) -> QuantizeConfig:
        return dataclasses.replace(self.config, keep_float=tuple(keep))

    def write(self, keep, path, run: RunOptions):
        """Quantize the variant keeping ``keep`` in float to ``path``; its QuantizeReport. Configs
        whose weights read the calibration data re-read it (the statistics alone do not suffice)."""
        config = self.config_keeping(keep)
        if config.weights_need_data or self.needs_data:
            if self.calib is None:
                raise Fp8OnnxError("GPTQ, --smooth and --bias-correction need the calibration data here, not --stats.")
            return quantize_with(self.model, path, self.calib, config, run)
        return quantize_with(self.model, path, None, config, run, stats=self.stats)

    def _folder(self) -> pathlib.Path:
        if self._tmp is None:
            raise Fp8OnnxError("Candidates are written inside its with block only (its scratch folder).")
        return pathlib.Path(self._tmp)

    def ratios(self, keeps: list[tuple[str, ...]]) -> list[float | None]:
        """Headline metric relative to FP16's for each variant (nodes kept in float)."""
        todo = list(dict.fromkeys(frozenset(k) for k in keeps if frozenset(k) not in self._cache))
        if todo:
            quiet = RunOptions.of(self.run, progress=False)
            paths: list[pathlib.Path] = []
            for keep in todo:
                path = self._folder() / f"variant{self.evaluated + len(paths)}.onnx"
                self.write(sorted(keep), path, quiet)
                paths.append(path)
            first = self.rounds == 0
            result = compare(
                self.model,
                paths,
                self.eval_data,
                fp16=first,
                generate=0,
                memory=False,
                metric=self.headline,
                reference_run=self._reference,
                run=self.run,
            )
            by_name = {r.name: r for r in result.rows}
            if first and "FP16" in by_name:
                self._fp16 = by_name[result.baseline]  # FP32's row where FP16 overflows
                self.baseline = "FP16" if result.baseline == "FP16" else "FP32"
                columns = self._fp16.columns
                self.samples = len(next(iter(columns.values()))) if columns else result.samples
                self.labelled = int(sum(columns.get("labelled", ())))
            for keep, path in zip(todo, paths):
                row = by_name[path.name]
                self._cache[keep] = row
                self.metric = row.headline
                path.unlink()
            self.evaluated += len(todo)
            self.rounds += 1
            logger.info("evaluated %d variants (%d so far, %d rounds)", len(todo), self.evaluated, self.rounds)
            if all(self._ratio(k)[0] is None for k in todo):
                raise Fp8OnnxError(f"No FP16 baseline to measure against: {'; '.join(result.notes)}")
        return [self._ratio(frozenset(k))[0] for k in keeps]

    def _ratio(self, keep: frozenset[str]) -> tuple[float | None, float | None]:
        row = self._cache.get(keep)
        return (None, None) if row is None or self._fp16 is None else ratio_to(row, self._fp16)

    def noise(self, keep: tuple[str, ...]) -> float | None:
        """One standard error of a variant's ratio to FP16 (scored already by :meth:`ratios`)."""
        return self._ratio(frozenset(keep))[1]

    def gain_noise(self, keep: tuple[str, ...], base: tuple[str, ...]) -> float | None:
        """One standard error of ratio(keep) - ratio(base), paired over the samples (both scored already)."""
        a, b = self._cache.get(frozenset(keep)), self._cache.get(frozenset(base))
        if a is None or b is None or self._fp16 is None:
            return None
        return gain_se(self._fp16.headline_key, a.columns, b.columns, self._fp16.columns)
