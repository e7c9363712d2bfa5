"""Export folders in, runnable FP8 folders out.

``quantize_folder(EXPORT_DIR, OUT_DIR, calib)`` writes a folder that the runtime which loaded the
original loads unchanged: every ONNX model of the export quantized (external data beside it), every
other file copied (configs, tokenizer, chat template, generation config), so the file names that
``genai_config.json`` or Optimum's configs reference stay valid.

The layouts it knows (:func:`describe_export`):

- onnxruntime-genai: ``genai_config.json`` names the decoder (with a KV cache);
- Optimum causal LM: ``model.onnx`` (with or without past), or ``decoder_model.onnx`` +
  ``decoder_with_past_model.onnx`` and/or ``decoder_model_merged.onnx``;
- Optimum encoder-decoder (T5, BART, Marian, ...): ``encoder_model.onnx`` and those decoders;
- any folder with one model (a classifier, an encoder): quantized with the data as given.

For the generative layouts, the calibration data of every model comes from running the export as
it runs in deployment (:class:`fp8onnx.accuracy.generation.Generator`, FP32, greedy): the token ids of the
given data are the prompts; a decode model (a decoder with past, a merged decoder's cache branch)
sees ``decode_steps`` greedy steps on the KV caches its own prefill wrote (for the first
``DECODE_PROMPTS`` prompts); the decoder of an encoder-decoder sees the encoder's real outputs
(teacher-forced on the prompt, then decoding). A single decoder with a KV cache (onnxruntime-genai's,
Optimum's ``model.onnx`` with past) decodes with the nodes its prefill ran: it gets the prompts,
with empty caches.

The folder is built beside OUT_DIR under a temporary name and renamed into place when every model
has been written: a failure leaves nothing half-written. OUT_DIR may be new, empty, or a folder this
function wrote before (it has ``fp8onnx.json``), never the export folder or a folder inside it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil

import numpy as np
import onnx

from fp8onnx.accuracy.generation import Generator, start_token
from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.base.scratch import make_dir, remove
from fp8onnx.data.datasource import Data, as_data
from fp8onnx.data.feeds import InputSpec, TextSource, is_text
from fp8onnx.data.kv_cache import cache_sizes
from fp8onnx.data.text_sample import python_text_sample
from fp8onnx.graph.guard import external_locations
from fp8onnx.graph.model_io import new_folder_mode, write_text_atomic
from fp8onnx.graph.run_settings import RunOptions, entry_settings
from fp8onnx.graph.runtime import make_session
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.report import FolderReport
from fp8onnx.workflows.quantizer import quantize_with

__all__ = ["MANIFEST", "Export", "describe_export", "quantize_folder"]

logger = logging.getLogger(__name__)
MANIFEST = "fp8onnx.json"
DECODE_STEPS = 8
DECODE_PROMPTS = 64  # prompts whose decode steps are recorded (each step's feed holds every KV cache)
_OPTIMUM = {
    "encoder": "encoder_model.onnx",
    "decoder": "decoder_model.onnx",
    "decoder_with_past": "decoder_with_past_model.onnx",
    "decoder_merged": "decoder_model_merged.onnx",
}


@dataclasses.dataclass
class Export:
    folder: pathlib.Path
    layout: str  # "onnxruntime-genai", "optimum decoder", "optimum encoder-decoder", "decoder", "one model"
    models: list[pathlib.Path]  # every ONNX model, each quantized
    roles: dict[str, pathlib.Path]  # generation role -> model (empty for "one model")

    def plans(self) -> list[dict[str, pathlib.Path]]:
        """Role sets to generate with, together covering every model: split decoders and a merged
        one are each run by a pass of their own."""
        if not self.roles:
            return []
        encoder = {k: v for k, v in self.roles.items() if k == "encoder"}
        split = {k: v for k, v in self.roles.items() if k in ("decoder", "decoder_with_past")}
        merged = {k: v for k, v in self.roles.items() if k == "decoder_merged"}
        return [{**encoder, **part} for part in (split, merged) if part]


def _models(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".onnx" and p.is_file())


def describe_export(folder: str | os.PathLike) -> Export:
    """Which models an export folder holds and the role each plays in generation."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise Fp8OnnxError(f"Export folder {str(folder)!r} does not exist or is not a folder.")
    models = _models(folder)
    if not models:
        raise Fp8OnnxError(f"Export folder {str(folder)!r} has no .onnx model.")
    genai = folder / "genai_config.json"
    if genai.is_file():
        try:
            cfg = json.loads(genai.read_text(encoding="utf-8"))["model"]
            decoder = folder / cfg["decoder"]["filename"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise Fp8OnnxError(f"{str(genai)!r} does not name its decoder (model.decoder.filename): {exc}.") from exc
        others = [m.name for m in models if m != decoder]
        if not decoder.is_file():
            raise Fp8OnnxError(f"{str(genai)!r} names the decoder {decoder.name!r}, which is not in the folder.")
        if others:
            raise Fp8OnnxError(
                f"onnxruntime-genai folder {str(folder)!r} has models beyond its decoder ({', '.join(others)}); "
                "only a decoder-only export is supported as a folder: quantize those models one by one."
            )
        return Export(folder, "onnxruntime-genai", models, {"decoder": decoder})
    named = {role: folder / name for role, name in _OPTIMUM.items() if (folder / name).is_file()}
    if named:
        if "encoder" in named and len(named) == 1:
            raise Fp8OnnxError(f"Export folder {str(folder)!r} has an encoder_model.onnx but no decoder model.")
        if "decoder_with_past" in named and "decoder" not in named:
            raise Fp8OnnxError(
                f"Export folder {str(folder)!r} has decoder_with_past_model.onnx without decoder_model.onnx for "
                "the prefill."
            )
        others = [m.name for m in models if m not in named.values()]
        if others:
            raise Fp8OnnxError(
                f"Export folder {str(folder)!r} has models in no role fp8onnx knows ({', '.join(others)}) beside "
                "Optimum's encoder/decoder models; quantize them one by one."
            )
        layout = "optimum encoder-decoder" if "encoder" in named else "optimum decoder"
        return Export(folder, layout, models, named)
    if len(models) > 1:
        raise Fp8OnnxError(
            f"Export folder {str(folder)!r} has {len(models)} models ({', '.join(m.name for m in models)}) in no "
            "layout fp8onnx knows (onnxruntime-genai, Optimum decoder or encoder-decoder); quantize them one by one."
        )
    (model,) = models
    try:  # the graph's inputs and outputs only: external weights stay on disk
        graph = onnx.load(str(model), load_external_data=False).graph
    except Exception as exc:
        raise Fp8OnnxError(f"Model file {str(model)!r} is not a readable ONNX model ({first_line(exc)}).") from exc
    weights = {t.name for t in graph.initializer}
    inputs = {v.name for v in graph.input if v.name not in weights}
    if "input_ids" in inputs and any(v.name == "logits" for v in graph.output):
        return Export(folder, "decoder", models, {"decoder": model})
    return Export(folder, "one model", models, {})


def _check_output(export: Export, out: pathlib.Path) -> None:
    src, dst = export.folder.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise Fp8OnnxError(f"Output folder {str(out)!r} is the export folder or inside it; choose another folder.")
    if dst in src.parents:
        raise Fp8OnnxError(
            f"Output folder {str(out)!r} holds the export folder {str(export.folder)!r}; choose another folder."
        )
    if out.exists():
        if not out.is_dir():
            raise Fp8OnnxError(f"Output {str(out)!r} is a file; an export folder in gives a folder out.")
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise Fp8OnnxError(
                f"Output folder {str(out)!r} is not empty and was not written by fp8onnx; choose a new or empty folder."
            )
    elif not out.absolute().parent.is_dir():
        raise Fp8OnnxError(f"Output folder {str(out)!r} cannot be made: its parent does not exist.")


def _prompts(export: Export, calib, run: RunOptions):
    """Batches of token ids [batch, seq] from ``calib`` (text, .npz with input_ids, feed dicts)."""
    ids = InputSpec("input_ids", np.dtype(np.int64), (None, None))
    if isinstance(calib, (str, os.PathLike)) and (isinstance(calib, TextSource) or is_text(calib)):
        text = calib if isinstance(calib, TextSource) else TextSource(calib)
        tokenizer = text.tokenizer
        if tokenizer is None:
            tokenizer = export.folder / "tokenizer.json"
            if not tokenizer.is_file():
                raise Fp8OnnxError(
                    f"Export folder {str(export.folder)!r} has no tokenizer.json for the text {str(calib)!r}: "
                    "pass --tokenizer."
                )
        calib = TextSource(text.path, tokenizer, text.seq_len)
    # Text: unpadded windows (no model is given, so no padded sentences), as generation's prompts are
    for batch in as_data(calib, [ids], None).batches(run.batch):
        prompt = np.asarray(batch.feed["input_ids"], np.int64)
        if prompt.ndim == 2 and prompt.shape[1]:
            yield prompt


class _Recorder:
    """Feeds seen by each role, one feed-layout .npz per run (a folder of them is a data source)."""

    def __init__(self, root: pathlib.Path, roles):
        self.dirs = {role: root / role for role in roles}
        for path in self.dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        self.counts = dict.fromkeys(self.dirs, 0)

    def __call__(self, role: str, feed: dict) -> None:
        if role not in self.dirs:
            return
        arrays = {k: np.asarray(v)[None] for k, v in feed.items()}
        np.savez(self.dirs[role] / f"{self.counts[role]:06d}.npz", allow_pickle=True, **arrays)  # numpy's default
        self.counts[role] += 1


def _calibration_feeds(export: Export, calib, run: RunOptions, root: pathlib.Path, decode_steps: int) -> dict:
    """role-in-plan -> folder of feeds, for every model of the export."""

    plans = export.plans()
    data: dict[pathlib.Path, pathlib.Path] = {}
    sizes = cache_sizes(export.folder)
    start = start_token(export.folder)
    generators = []
    for i, plan in enumerate(plans):
        todo = {role: path for role, path in plan.items() if path not in data}
        recorder = _Recorder(root / f"plan{i}", todo)
        for role, path in todo.items():
            data[path] = recorder.dirs[role]
        sessions = {
            role: make_session(path, run.provider, f"The {role} model {path.name!r}") for role, path in plan.items()
        }
        generators.append(
            Generator(sessions, start_token=start, cache_sizes=sizes, record=recorder, where=str(export.folder))
        )
    prompts = 0
    for prompt in _prompts(export, calib, run):
        for generator in generators:
            teacher = prompt[:, :-1] if generator.encoder_decoder else None
            # Decode steps only where they run nodes of their own (a decoder with past, a merged decoder's
            # cache branch), for the first DECODE_PROMPTS prompts: a single decoder decodes with the nodes
            # its prefill ran, and each step's feed holds every KV cache (SmolLM2, 16 prompts: 95 MB).
            steps = decode_steps if generator.decodes_apart and prompts < DECODE_PROMPTS else 0
            generator.greedy(prompt, steps, teacher=teacher)
        prompts += prompt.shape[0]
    if prompts == 0:
        raise Fp8OnnxError(f"The calibration data {str(calib)!r} gave no token ids to run the export on.")
    logger.info("ran %s on %d prompts for calibration (decode models: %d steps)", export.folder, prompts, decode_steps)
    return data


def _copy_other_files(export: Export, out: pathlib.Path) -> list[str]:
    """Everything but the models and their external data, with its relative path."""
    skip = {m.resolve() for m in export.models}
    for model in export.models:
        skip |= {(model.parent / loc).resolve() for loc in external_locations(model)}
    copied = []
    for path in sorted(export.folder.rglob("*")):
        if path.resolve() in skip or not path.is_file():
            continue
        rel = path.relative_to(export.folder)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, out / rel)
        copied.append(str(rel))
    return copied


def quantize_folder(
    export_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    calib: Data | None = None,
    *,
    config: QuantizeConfig | None = None,
    run: RunOptions | None = None,
    decode_steps: int = DECODE_STEPS,
    fold_at_load: bool | None = None,
    **options,
) -> FolderReport:
    """Quantize every model of the export folder ``export_dir`` into ``out_dir`` (see the module
    docstring). ``calib``: text (a .txt/.jsonl path or :class:`~fp8onnx.data.feeds.TextSource`; the
    folder's tokenizer.json by default), an .npz with ``input_ids``, or feed dicts; for a one-model
    folder anything ``quantize`` takes. ``config``/``options`` and ``run`` as for
    :func:`fp8onnx.quantize`. ``fold_at_load`` (onnxruntime-genai folders): the decoder's session
    options get ``session.disable_quant_qdq = "1"``, so onnxruntime dequantizes the float8 weights
    once at load instead of at every token (CPU: the speed and memory of FP32, the file of FP8); None
    (the default): so for an onnxruntime-genai folder, unless it is for the CUDA EP. With ``--target
    onnxruntime-cuda`` an onnxruntime-genai folder's decoder names the CUDA provider, as the runtime's
    own builder writes it."""
    config, run = entry_settings(config, run, options)  # as quantize's: the family's recipe by default
    export = describe_export(export_dir)
    genai, cuda = export.layout == "onnxruntime-genai", config.target == "onnxruntime-cuda"
    fold_at_load = _fold_at_load(export, genai, cuda, fold_at_load)
    out = pathlib.Path(out_dir)
    _check_output(export, out)
    parent = out.absolute().parent
    build = pathlib.Path(make_dir(f".{out.name}.partial-", dir=parent))
    scratch = pathlib.Path(make_dir("fp8onnx-feeds-"))
    try:
        os.chmod(build, new_folder_mode())  # mkdtemp's 0700 would hide the output from other accounts
        optional = False  # no data given: the bundled text sample, for the models whose recipe needs data
        if calib is None and export.roles and (export.folder / "tokenizer.json").is_file():
            calib, optional = python_text_sample(export.folder / "tokenizer.json"), True
            logger.warning("no --calib: calibrating on %s", calib)
        data = (
            _calibration_feeds(export, calib, run, scratch, decode_steps) if export.roles and calib is not None else {}
        )
        reports = {}
        for model in export.models:
            logger.info("quantizing %s", model.name)
            report = reports[model.name] = quantize_with(
                model, build / model.name, data.get(model, calib), config, run, calib_optional=optional
            )
            report.output = str(out / model.name)
            if model in data and report.calibration:  # not the feeds' temporary folder
                report.calibration["source"] = f"{calib}, run through the export"
        copied = _copy_other_files(export, build)
        deploy = _deployment(build, genai, cuda, fold_at_load)
        given = None if calib is None else str(calib)
        result = FolderReport(str(export.folder), str(out), export.layout, reports, copied, given, decode_steps, deploy)
        write_text_atomic(build / MANIFEST, json.dumps(result.to_json(full=False), indent=1) + "\n")
        _swap_into_place(build, out)
    finally:
        remove(build)
        remove(scratch)
    return result


def _fold_at_load(export, genai: bool, cuda: bool, fold_at_load: bool | None) -> bool:
    """--fold-at-load as asked, or by default (an onnxruntime-genai folder not for the CUDA EP); refused
    where it cannot apply."""
    if fold_at_load is None:
        fold_at_load = genai and not cuda
    if fold_at_load and cuda:
        raise Fp8OnnxError(
            "--fold-at-load is for the CPU EP (float8 weights dequantized once at load); --target onnxruntime-cuda "
            "keeps them float8 on the GPU: drop one."
        )
    if fold_at_load and not genai:
        raise Fp8OnnxError(
            f"--fold-at-load writes onnxruntime-genai's genai_config.json; {str(export.folder)!r} is not an "
            f"onnxruntime-genai export ({export.layout}): set session.disable_quant_qdq=1 in your own SessionOptions."
        )
    return fold_at_load


def _deployment(build: pathlib.Path, genai: bool, cuda: bool, fold_at_load: bool) -> list[str]:
    """genai_config.json's decoder options for the deployment chosen, and a line for each."""
    deployment: list[str] = []
    if fold_at_load:
        _genai_decoder_options(build / "genai_config.json", {"session.disable_quant_qdq": "1"})
        deployment.append(
            "genai_config.json: the decoder's float8 weights are dequantized once at load "
            "(session.disable_quant_qdq=1): FP32's speed and session memory on the CPU, FP8's files "
            "(--no-fold-at-load: FP8's memory, each token dequantizes every weight)"
        )
    if genai and cuda:
        _genai_decoder_options(build / "genai_config.json", provider={"cuda": {"enable_cuda_graph": "0"}})
        deployment.append(
            "genai_config.json: the decoder runs on the CUDA provider (onnxruntime-genai's CUDA build; the "
            "fast-form op has no CPU kernel)"
        )
    elif cuda:
        deployment.append("load it with provider='CUDAExecutionProvider' (the fast-form op has no CPU kernel)")
    return deployment


def _genai_decoder_options(config: pathlib.Path, entries: dict | None = None, provider: dict | None = None) -> None:
    """genai_config.json: session options of the decoder. ``entries``: onnxruntime config entries
    (onnxruntime-genai passes unknown session_options keys on; values must be strings); ``provider``:
    the one entry of ``provider_options`` (e.g. ``{"cuda": {...}}``, as onnxruntime-genai's builder
    writes it), replacing any other."""
    doc = json.loads(config.read_text(encoding="utf-8"))
    options = doc["model"]["decoder"].setdefault("session_options", {})
    options.update(entries or {})
    if provider is not None:
        options["provider_options"] = [provider]
    write_text_atomic(config, json.dumps(doc, indent=4) + "\n")


def _swap_into_place(build: pathlib.Path, out: pathlib.Path) -> None:
    """Rename the finished folder to ``out``; a previous fp8onnx output there is replaced."""
    if not out.exists():
        os.replace(build, out)
        return
    old = pathlib.Path(make_dir(f".{out.name}.old-", dir=out.absolute().parent))
    try:
        os.replace(out, old / "previous")
        try:
            os.replace(build, out)
        except BaseException:  # a failure or a signal right here: the previous output goes back
            os.replace(old / "previous", out)
            raise
    finally:
        remove(old)
