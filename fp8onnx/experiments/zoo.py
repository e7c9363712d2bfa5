"""``fp8onnx zoo``: formats and scaling methods across a whole zoo of models, as the PTQ paper reports
them - per configuration, the share of models that pass.

requires: a list of models (a text file, one path per line, or a folder), each with calibration and
evaluation data beside it (:func:`find_models`). ensures: every (model, configuration) cell is
quantized from the model's own calibration statistics and evaluated on its own data against FP32
and FP16; a finished cell is saved (atomically) under ``OUT/cells`` and never rerun, so an
interrupted zoo resumes where it stopped; the summary is rebuilt from the saved cells.

Sidecar convention, for a model ``DIR/NAME.onnx`` (or an export folder ``DIR/NAME/``):
calibration data ``DIR/NAME.calib.npz`` (or ``.txt``/``.jsonl``, or a folder ``DIR/NAME.calib/``),
else ``calib.npz`` (or ``.txt``/``.jsonl``/a folder ``calib/``) in the model's own folder;
evaluation data the same with ``eval``. So a folder of export folders works as it is when each
holds ``model.onnx``, ``calib.npz`` and ``eval.npz``.

A model may also have ``NAME.zoo.json`` beside it (or ``zoo.json`` in its folder): ``{"family":
"segmentation", "metric": "pixel accuracy", "options": {"op_types": ["MatMul", "Gemm", "Conv",
"ConvTranspose"]}}``: its task family (the pass rates are also counted per family) and
:class:`~fp8onnx.settings.config.QuantizeConfig` fields applied to every configuration of that model (e.g.
Conv and ConvTranspose opted in for a convolutional model).

Each model is one unit of work: one calibration pass, its configurations quantized, and one
``compare`` pass over all of them (the FP32 reference runs once). With ``workers`` > 1 or an
``address``, models are independent Ray tasks (retried when a worker dies); otherwise they run in
this process, one after another.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re

from fp8onnx.accuracy.compare import compare
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.progress import progress_bar
from fp8onnx.base.scratch import temporary_dir
from fp8onnx.experiments.study import _distinct, _run_config, study_configs
from fp8onnx.experiments.zoo_results import ZooResult
from fp8onnx.graph.model_io import write_text_atomic
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.pipeline.distributed import remote_tasks
from fp8onnx.settings.config import PRESETS, QuantizeConfig
from fp8onnx.workflows.api import calibrate

__all__ = ["ZooModel", "find_models", "zoo", "zoo_configs"]

logger = logging.getLogger(__name__)
_DATA = (".npz", ".txt", ".jsonl", "")  # "" : a folder (of .npz files, images, audio)
CELLS = "cells"


def zoo_configs() -> list[tuple[str, str, QuantizeConfig]]:
    """(label, group, config): the PTQ paper's formats, the scaling methods, static against dynamic
    activations, weight-only, and the presets."""

    configs = [c for c in study_configs([]) if c[1] in ("format", "scaling", "activations")]
    configs += [(f"preset {name}", "preset", QuantizeConfig.for_preset(name)) for name in PRESETS]
    return configs


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    model: str
    calib: str
    data: str
    family: str = ""  # the task family (zoo.json), "" when not given
    options: dict = dataclasses.field(default_factory=dict)  # QuantizeConfig fields for every configuration

    def configured(self, config: QuantizeConfig) -> QuantizeConfig:
        """``config`` with this model's options applied."""
        return dataclasses.replace(config, **self.options) if self.options else config


def _sidecar_json(path: pathlib.Path | None) -> tuple[str, dict]:
    """(family, options) of a zoo.json sidecar; options checked against QuantizeConfig."""
    if path is None:
        return "", {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise Fp8OnnxError(f"Zoo sidecar {str(path)!r} is not readable JSON ({exc}).") from exc
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("family", ""), str)
        or not isinstance(doc.get("options", {}), dict)
    ):
        raise Fp8OnnxError(
            f"Zoo sidecar {str(path)!r} must be an object with a 'family' string and an 'options' object."
        )
    options = doc.get("options", {})
    fields = {f.name for f in dataclasses.fields(QuantizeConfig)}
    unknown = sorted(set(options) - fields) + (["preset"] if "preset" in options else [])
    if unknown:
        raise Fp8OnnxError(
            f"Zoo sidecar {str(path)!r}: {unknown[0]!r} is not a quantize option (a QuantizeConfig field; a "
            "preset is a zoo configuration, not a model's option)."
        )
    try:
        QuantizeConfig(**options)
    except (TypeError, ValueError, Fp8OnnxError) as exc:
        raise Fp8OnnxError(f"Zoo sidecar {str(path)!r}: {exc}") from exc
    return doc.get("family", ""), options


def _sidecar(folder: pathlib.Path, stem: str | None, kind: str, suffixes=_DATA) -> pathlib.Path | None:
    names = ([f"{stem}.{kind}"] if stem else []) + [kind]
    for name in names:
        for suffix in suffixes:
            path = folder / f"{name}{suffix}"
            if path.is_dir() if suffix == "" else path.is_file():
                return path
    return None


def _entry(path: pathlib.Path) -> ZooModel:
    if path.is_dir():  # an export folder: model.onnx inside, data inside or beside
        if not (path / "model.onnx").is_file():
            raise Fp8OnnxError(f"Zoo entry {str(path)!r} is a folder without model.onnx.")
        found = {k: _sidecar(path, None, k) or _sidecar(path.parent, path.name, k) for k in ("calib", "eval")}
        about = _sidecar(path, None, "zoo", (".json",)) or _sidecar(path.parent, path.name, "zoo", (".json",))
        name = path.name
    elif path.is_file():
        found = {k: _sidecar(path.parent, path.stem, k) for k in ("calib", "eval")}
        about = _sidecar(path.parent, path.stem, "zoo", (".json",))
        name = path.stem if path.stem != "model" else path.parent.name
    else:
        raise Fp8OnnxError(f"Zoo model {str(path)!r} does not exist.")
    for kind, where in found.items():
        if where is None:
            stem = path.name if path.is_dir() else path.stem
            raise Fp8OnnxError(
                f"Zoo model {str(path)!r} has no {kind} data: expected {stem}.{kind}.npz (or .txt/.jsonl) beside it "
                f"or {kind}.npz in its folder."
            )
    family, options = _sidecar_json(about)
    return ZooModel(name, str(path), str(found["calib"]), str(found["eval"]), family, options)


def find_models(source: str | os.PathLike) -> list[ZooModel]:
    """The zoo's models with their data. ``source``: a text file listing model files or export
    folders (one per line, relative to the file; blank lines and ``#`` comments skipped), or a
    folder whose ``*.onnx`` files and subfolders holding ``model.onnx`` are the models."""
    source = pathlib.Path(source)
    if source.is_dir():
        paths = sorted(
            p for p in source.iterdir() if (p.suffix == ".onnx" and p.is_file()) or (p / "model.onnx").is_file()
        )
    elif source.is_file():
        try:
            lines = source.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise Fp8OnnxError(f"Zoo list {str(source)!r} is not readable text ({exc}).") from exc
        paths = [source.parent / line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    else:
        raise Fp8OnnxError(f"Zoo {str(source)!r} does not exist.")
    models = [_entry(p) for p in paths]
    if not models:
        raise Fp8OnnxError(f"Zoo {str(source)!r} lists no models (*.onnx files or folders with model.onnx).")
    seen: dict[str, str] = {}
    for m in models:
        if m.name in seen:
            raise Fp8OnnxError(f"Zoo models {seen[m.name]!r} and {m.model!r} have the same name {m.name!r}.")
        seen[m.name] = m.model
    return models


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", label).strip("_")


def run_model(model: ZooModel, configs: list[tuple[str, str, QuantizeConfig]], run: RunOptions) -> dict:
    """One model's cells: calibrate once, quantize each configuration, evaluate all in one compare.
    Returns {"fp32", "fp16", "metric", "cells": {label: cell}}; a configuration that cannot be built
    for this model gets a cell with its ``error``."""

    quiet = RunOptions.of(run, progress=False)
    stats = calibrate(model.model, model.calib, run=quiet)
    cells: dict[str, dict] = {}
    with temporary_dir("fp8onnx-zoo-") as tmp:
        reports: dict = {}
        built = []
        for label, group, config in configs:
            try:
                config = model.configured(config)
                _run_config(model.model, tmp, (label, group, config), stats, quiet, reports, model.calib)
                built.append(label)
            except Fp8OnnxError as exc:
                cells[label] = {"group": group, "config": config.to_json(), "error": str(exc)}
        paths = [pathlib.Path(tmp) / f"{i}.onnx" for i in range(len(reports))]
        unique, same_as = _distinct(paths)
        result = compare(model.model, unique, model.data, generate=0, memory=False, run=quiet)
    by_file = {r.name: r for r in result.rows}
    by_file.update({name: by_file[first] for name, first in same_as.items()})
    for i, label in enumerate(reports):
        group, config, _ = reports[label]
        r = by_file[f"{i}.onnx"]
        cells[label] = {
            "group": group,
            "config": config.to_json(),
            "metric": r.headline,
            "value": r.value,
            "ratio_to_fp16": r.ratio_to_fp16,
            "rel_loss_vs_fp16": r.rel_loss_vs_fp16,
            "passes_llm": r.passes_llm,
            "passes_ptq": r.passes_ptq,
            "emulated": config.emulated,
        }
    fp16 = by_file.get("FP16")
    return {
        "fp32": by_file["FP32 (reference)"].value,
        "fp16": fp16.value if fp16 else None,
        "metric": result.rows[0].headline,
        "samples": result.samples,
        "calibration_samples": stats.num_samples,
        "cells": cells,
    }


def _run_model_task(model: ZooModel, configs, run: RunOptions) -> dict:
    """A Ray task's body: errors of the user's model come back as data, not as a failed task (a
    failed task is retried only when its worker died)."""
    try:
        return run_model(model, configs, run)
    except Fp8OnnxError as exc:
        return {"error": str(exc)}


def _model_dir(out: pathlib.Path, name: str) -> pathlib.Path:
    return out / CELLS / _slug(name)


def _load_done(out: pathlib.Path, model: ZooModel) -> tuple[dict | None, dict[str, dict]]:
    """(the model's saved summary or None, its saved cells by label)."""
    folder = _model_dir(out, model.name)
    head, cells = _read(folder / "model.json"), {}
    if head is None or head.get("model") != model.model or head.get("options", {}) != model.options:
        return None, {}  # none yet, another model of that name, or other options (its cells are stale)
    for path in folder.glob("*.cell.json"):
        cell = _read(path)
        if cell is not None and isinstance(cell.get("label"), str):
            cells[cell["label"]] = cell
    return head, cells


def _read(path: pathlib.Path) -> dict | None:
    """A saved JSON document, or None when it is missing or unreadable (that cell is computed again)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("zoo: %s is unreadable (%s); computing it again", path, exc)
        return None
    return doc if isinstance(doc, dict) else None


def _save(out: pathlib.Path, model: ZooModel, result: dict) -> None:
    folder = _model_dir(out, model.name)
    folder.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in result.items() if k != "cells"}
    doc = {"model": model.model, "options": model.options, **head}
    write_text_atomic(folder / "model.json", json.dumps(doc, indent=1) + "\n")
    for label, cell in result["cells"].items():
        if not cell.get("error"):  # an error is not a result: the next run tries the cell again
            write_text_atomic(
                folder / f"{_slug(label)}.cell.json", json.dumps({"label": label, **cell}, indent=1) + "\n"
            )


def zoo(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    configs: list[tuple[str, str, QuantizeConfig]] | None = None,
    run: RunOptions | None = None,
    **run_options,
) -> ZooResult:
    """Every model of ``source`` (:func:`find_models`) in every configuration (default
    :func:`zoo_configs`); cells saved under ``out``, finished ones reused."""
    run = RunOptions.of(run, **run_options)
    configs = configs or zoo_configs()
    models = find_models(source)
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise Fp8OnnxError(f"Zoo output {str(out)!r} is not a folder.")
    out.mkdir(parents=True, exist_ok=True)
    done = {m.name: _load_done(out, m) for m in models}
    todo = []
    for m in models:
        head, cells = done[m.name]
        missing = [c for c in configs if c[0] not in cells]
        if head is None or missing:
            todo.append((m, missing if head is not None else configs))
    logger.info("zoo: %d of %d models have cells to compute", len(todo), len(models))
    errors: dict[str, str] = {}
    for m, result in _execute(todo, run):
        if "error" in result:
            errors[m.name] = result["error"]
            logger.warning("zoo: %s: %s", m.name, result["error"])
            continue
        _save(out, m, result)
    return _summary(models, configs, out, errors, ran=len(todo) - len(errors))


def _execute(todo, run: RunOptions):
    """(model, result) for each (model, configurations) to compute: here, or as Ray tasks."""

    if not run.distributed:
        inner = RunOptions.of(run, progress=False)
        for m, configs in progress_bar(todo, total=len(todo), desc="zoo", unit="model", enable=run.progress):
            yield m, _run_model_task(m, configs, inner)
        return

    inner = RunOptions.of(run, progress=False, workers=1, ray_address=None)  # each task runs in its own process
    calls = [(m, configs, inner) for m, configs in todo]
    results = remote_tasks(
        _run_model_task, calls, workers=run.workers, address=run.ray_address, timeout=run.ray_timeout
    )
    bar = progress_bar(results, total=len(todo), desc="zoo", unit="model", enable=run.progress)
    for (m, _, _), result in zip(calls, bar):
        yield m, result


def _summary(models, configs, out, errors, ran: int) -> ZooResult:
    rows = []
    for m in models:
        head, cells = _load_done(out, m)
        if head is None:
            error = errors.get(m.name, "not run")
            rows.append({"name": m.name, "path": m.model, "family": m.family, "error": error, "cells": {}})
            continue
        rows.append(
            {
                "name": m.name,
                "path": m.model,
                "family": m.family,
                "options": m.options,
                "fp32": head.get("fp32"),
                "fp16": head.get("fp16"),
                "metric": head.get("metric"),
                "error": errors.get(m.name),
                "cells": {label: cells[label] for label, _, _ in configs if label in cells},
            }
        )
    summary = []
    for label, group, _ in configs:
        evaluated = [r["cells"][label] for r in rows if label in r["cells"]]
        families: dict[str, list[int]] = {}  # family -> [models, passes within 1%]
        for r in rows:
            if label in r["cells"]:
                counts = families.setdefault(r["family"] or "-", [0, 0])
                counts[0] += 1
                counts[1] += bool(r["cells"][label].get("passes_ptq"))
        summary.append(
            {
                "label": label,
                "group": group,
                "models": len(evaluated),
                "passes_ptq": sum(1 for c in evaluated if c.get("passes_ptq")),
                "passes_llm": sum(1 for c in evaluated if c.get("passes_llm")),
                "families": {f: {"models": n, "passes_ptq": p} for f, (n, p) in sorted(families.items())},
            }
        )
    return ZooResult(rows, summary, ran)
