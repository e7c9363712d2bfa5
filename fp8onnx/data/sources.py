"""Data sources made from raw inputs: text windows or padded sentences (:class:`TextData`, tokenized
by :mod:`fp8onnx.data.text`), images and audio (:class:`MediaData`, :mod:`fp8onnx.data.media`), and ``fp8onnx
data`` (:func:`make_data`), which writes any of them to an ``.npz`` as the samples come (one
temporary raw file per array: memory stays flat in the corpus size)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
import zipfile
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.progress import progress_bar
from fp8onnx.base.scratch import make_dir, remove
from fp8onnx.data import media
from fp8onnx.data.feeds import LABELS, TEXT_SUFFIXES, Batch, InputSpec, input_specs
from fp8onnx.data.kv_cache import cache_sizes, model_folder
from fp8onnx.data.media import AudioOptions, ImageOptions
from fp8onnx.data.text import (
    PAST,
    TextOptions,
    _first_or_sampled,
    _ids_input,
    check_tokenizer,
    load_tokenizer,
    text_samples,
    vocabulary_size,
)
from fp8onnx.graph.guard import check_paths, model_reads
from fp8onnx.graph.model_io import SOURCE_META, load_model, model_file

__all__ = ["DataSummary", "MediaData", "TextData", "make_data", "write_text_data"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DataSummary:
    """What ``write_text_data`` made: sample count, each array's shape and dtype, and the inputs it
    filled in (input name -> why)."""

    source: str
    output: str
    samples: int
    documents: int | None  # text documents read (None for images and audio)
    tokens: int | None
    arrays: dict[str, tuple[list[int], str]]
    filled: dict[str, str]

    def lines(self) -> list[str]:
        read = "" if self.documents is None else f" from {self.documents} documents ({self.tokens} tokens)"
        out = [f"{self.source} -> {self.output}: {self.samples} samples{read}"]
        for name, (shape, dtype) in self.arrays.items():
            why = self.filled.get(name)
            out.append(f"  {name}: {dtype} {shape}" + (f" ({why})" if why else ""))
        return out


class _NpzWriter:
    """Arrays appended sample by sample to raw files, then written as one .npz (atomically)."""

    def __init__(self, out: pathlib.Path):
        self.out = out
        self.tmp = pathlib.Path(make_dir(f".{out.name}.", dir=out.resolve().parent))
        self.files: dict[str, BinaryIO] = {}
        self.meta: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.count = 0

    def add(self, arrays: dict[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            if name not in self.files:
                self.files[name] = open(self.tmp / f"{len(self.files)}.raw", "wb")
                self.meta[name] = (array.shape[1:], array.dtype)
            elif self.meta[name] != (array.shape[1:], array.dtype):
                raise Fp8OnnxError(
                    f"Sample {self.count} of {name!r} has shape {array.shape[1:]}, not {self.meta[name][0]}."
                )
            self.files[name].write(np.ascontiguousarray(array).tobytes())
        self.count += 1

    def close(self) -> dict[str, tuple[list[int], str]]:
        for fh in self.files.values():
            fh.close()
        part = self.tmp / "data.npz"
        with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for i, (name, (shape, dtype)) in enumerate(self.meta.items()):
                with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                    header = {
                        "descr": np.lib.format.dtype_to_descr(dtype),
                        "fortran_order": False,
                        "shape": (self.count, *shape),
                    }
                    np.lib.format.write_array_header_1_0(member, header)
                    with open(self.tmp / f"{i}.raw", "rb") as raw:
                        shutil.copyfileobj(raw, member, 1 << 20)
        os.replace(part, self.out)
        return {name: ([self.count, *shape], str(dtype)) for name, (shape, dtype) in self.meta.items()}

    def discard(self) -> None:
        for fh in self.files.values():
            fh.close()
        remove(self.tmp)


def write_samples(samples, out, source, empty: str, progress=None, counts=None) -> DataSummary:
    """Write (feed, labels, why) samples to the ``.npz`` ``out`` as they come; ``empty``: the message
    when there are none."""
    writer = _NpzWriter(pathlib.Path(out))
    filled: dict[str, str] = {}
    try:
        for feed, labels, why in progress(samples) if progress else samples:
            filled.update(why)
            writer.add({**feed, **({LABELS: labels} if labels is not None else {})})
        if writer.count == 0:
            raise Fp8OnnxError(empty)
        arrays = writer.close()
    except BaseException:
        writer.discard()
        raise
    writer.discard()
    counts = counts or {}
    return DataSummary(
        str(source), str(out), writer.count, counts.get("documents"), counts.get("tokens"), arrays, filled
    )


def write_text_data(model: ir.Model, source, out, options: TextOptions, progress=None) -> DataSummary:
    """Tokenize ``source`` for ``model``'s inputs and write the samples to the ``.npz`` ``out``."""
    tokenizer = load_tokenizer(options.tokenizer)
    check_tokenizer(model, tokenizer, options.tokenizer)
    counts = {"documents": 0, "tokens": 0}
    sizes = cache_sizes(model_folder(model))
    samples = text_samples(source, input_specs(model), options, tokenizer, counts, sizes)
    short = "" if options.pad else f" (fewer than {options.seq_len + 1} tokens; lower --seq-len or use --pad)"
    summary = write_samples(samples, out, source, f"Text file {str(source)!r} gave no sample{short}.", progress, counts)
    if LABELS in summary.arrays:
        summary.filled[LABELS] = "the next token of each position (for next-token accuracy and perplexity)"
    return summary


def make_data(
    model: str | os.PathLike,
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    text: TextOptions | None = None,
    image: ImageOptions | None = None,
    audio: AudioOptions | None = None,
    max_samples: int | None = None,
    seed: int | None = None,
    progress: bool = False,
) -> DataSummary:
    """``fp8onnx data``: feeds for ``model`` (a file, or an export folder: its ``tokenizer.json`` and
    ``preprocessor_config.json`` give the defaults) from ``source``: a text file, images or audio
    (see :mod:`fp8onnx.data.media`), written to ``output``. ``text``, ``image``, ``audio``: how each kind is
    read (defaults: the tokenizer beside the model, windows of 128 tokens); ``max_samples`` (drawn at random
    with ``seed``, else the first) of any kind."""
    text = text or TextOptions()

    folder = pathlib.Path(model) if pathlib.Path(model).is_dir() else None
    path = model_file(model)
    out = pathlib.Path(output)
    kind, tokenizer = _checked_sources(path, source, out, text.tokenizer, max_samples)
    bar = (
        (lambda it: progress_bar(it, total=max_samples, desc="samples", unit="sample", enable=True))
        if progress
        else None
    )
    ir_model = load_model(path)
    if kind == "text":
        if tokenizer is None:  # _checked_sources gives text one, or says why not
            raise Fp8OnnxError(f"Text source {str(source)!r} needs a tokenizer (--tokenizer).")
        options = dataclasses.replace(text, tokenizer=tokenizer, max_samples=max_samples, seed=seed)
        summary = write_text_data(ir_model, source, out, options, progress=bar)
    else:
        specs = input_specs(ir_model)
        if kind == "image":
            samples = media.image_samples(source, specs, image or media.ImageOptions(), folder)
        else:
            samples = media.audio_samples(source, specs, audio or media.AudioOptions(), folder)
        if max_samples is not None:
            samples = _first_or_sampled(samples, max_samples, seed)
        summary = write_samples(samples, out, source, f"Data source {str(source)!r} gave no sample.", bar)
        if LABELS in summary.arrays:
            summary.filled[LABELS] = "the index of each image's subfolder (its class), in name order"
    logger.info("%s", "; ".join(summary.lines()))
    return summary


def _checked_sources(
    path: pathlib.Path, source, out: pathlib.Path, tokenizer, max_samples
) -> tuple[str, str | os.PathLike | None]:
    """(the source's kind: text, image or audio; the tokenizer for text, by default the one beside the
    model) once every input exists, the output is an .npz in an existing folder and no output lands on
    a file the run reads."""
    if not path.is_file():
        raise Fp8OnnxError(f"Model file {str(path)!r} does not exist.")
    if not pathlib.Path(source).exists():
        raise Fp8OnnxError(f"Data source {str(source)!r} does not exist.")
    if out.suffix != ".npz":
        raise Fp8OnnxError(f"Output {str(out)!r} must end in .npz.")
    reads = model_reads("the model", path) + [("the data source", source)]
    check_paths(reads + ([("the tokenizer", tokenizer)] if tokenizer else []), [("the data file", out)])
    kind = "text" if pathlib.Path(source).suffix.lower() in TEXT_SUFFIXES else media.kind_of(source)
    if kind is None:
        raise Fp8OnnxError(
            f"Data source {str(source)!r} is not a text file (.txt, .jsonl), images "
            f"({', '.join(media.IMAGE_SUFFIXES[:4])}, ...) or audio ({', '.join(media.AUDIO_SUFFIXES)}), "
            "nor a folder of them."
        )
    if kind == "text" and tokenizer is None:  # like quantize: the one beside the model (in its folder)
        if not (path.parent / "tokenizer.json").is_file():
            raise Fp8OnnxError(
                f"No tokenizer for {str(source)!r}: pass --tokenizer tokenizer.json "
                "(or keep the model's tokenizer.json beside it)."
            )
        tokenizer = path.parent / "tokenizer.json"
    if not out.resolve().parent.is_dir():
        raise Fp8OnnxError(f"Output folder {str(out.resolve().parent)!r} does not exist.")
    if max_samples is not None and (isinstance(max_samples, bool) or max_samples < 1):
        raise Fp8OnnxError(f"--max-samples must be a positive integer, got {max_samples!r}.")
    return kind, tokenizer


class MediaData:
    """A folder (or file) of images or audio as a data source (``as_data``), with the defaults of
    ``fp8onnx data`` (and the export folder's ``preprocessor_config.json``), batched."""

    def __init__(self, path: str | os.PathLike, specs: list[InputSpec], model: ir.Model | None, kind: str):
        self.path, self.specs, self.kind = pathlib.Path(path), specs, kind
        self.folder = model_folder(model)

    def count_batches(self, batch_size: int) -> None:
        return None

    def batches(self, batch_size: int):
        if self.kind == "image":
            samples = media.image_samples(self.path, self.specs, media.ImageOptions(), self.folder)
        else:
            samples = media.audio_samples(self.path, self.specs, media.AudioOptions(), self.folder)
        yield from _batched(samples, batch_size)


class TextData:
    """A text file as a data source (``as_data``): samples made as ``fp8onnx data`` makes them, with
    its defaults (128 tokens; windows for a language model, padded sentences otherwise), batched."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[InputSpec],
        model: ir.Model | None,
        *,
        tokenizer: str | os.PathLike | None = None,
        seq_len: int | None = None,
        stride: int | None = None,
    ):
        self.path = pathlib.Path(path)
        self.specs = specs
        self.model = model
        pad = model is not None and not is_language_model(model, specs)
        if tokenizer is None:
            tokenizer = find_tokenizer(path, model)
        elif not self.path.is_file():
            raise Fp8OnnxError(f"Text file {str(path)!r} does not exist.")
        self.options = TextOptions(tokenizer, 128 if seq_len is None else seq_len, pad, stride=stride)
        self.tokenizer = load_tokenizer(self.options.tokenizer)
        if model is not None:
            check_tokenizer(model, self.tokenizer, self.options.tokenizer)
        logger.info(
            "text data %s: %s of %d tokens, tokenizer %s",
            self.path,
            "padded sentences" if pad else "windows",
            self.options.seq_len,
            self.options.tokenizer,
        )

    def count_batches(self, batch_size: int) -> None:
        return None  # known only once the text is read

    def batches(self, batch_size: int):
        sizes = cache_sizes(model_folder(self.model))
        yield from _batched(text_samples(self.path, self.specs, self.options, self.tokenizer, sizes=sizes), batch_size)


def _batched(samples, batch_size: int):
    """Batches of ``batch_size`` (feed, labels, why) samples, stacked along the batch axis."""
    pending = []
    for feed, labels, _ in samples:
        pending.append((feed, labels))
        if len(pending) == batch_size:
            yield _stacked(pending)
            pending = []
    if pending:
        yield _stacked(pending)


def _stacked(samples) -> Batch:
    feed = {k: np.concatenate([f[k] for f, _ in samples]) for k in samples[0][0]}
    labels = None if samples[0][1] is None else np.concatenate([lab for _, lab in samples])
    return Batch(feed, labels)


def find_tokenizer(text: str | os.PathLike, model: ir.Model | None = None) -> pathlib.Path:
    """The ``tokenizer.json`` for a text source given straight to --calib/--data: the one beside the
    model file (an export folder), else the one beside the text."""

    if not pathlib.Path(text).is_file():
        raise Fp8OnnxError(f"Text file {str(text)!r} does not exist.")
    places = []
    if model is not None and model.meta.get(SOURCE_META):
        places.append(pathlib.Path(model.meta[SOURCE_META]).parent)
    places.append(pathlib.Path(text).parent)
    for folder in places:
        if (folder / "tokenizer.json").is_file():
            return folder / "tokenizer.json"
    raise Fp8OnnxError(
        f"Text data {str(text)!r} needs a tokenizer.json beside the model or the text; or make an .npz with "
        "`fp8onnx data MODEL TEXT --tokenizer tokenizer.json -o data.npz`."
    )


def is_language_model(model: ir.Model, specs: list[InputSpec]) -> bool:
    """A KV-cache input, or an output as wide as the embedding table (logits): text is cut into windows
    with next-token labels for it; any other model gets one padded sentence per sample."""
    if any(PAST.search(s.name) for s in specs):
        return True
    rows = vocabulary_size(model, _ids_input(specs).name)
    return any(
        v.name == "logits" or (rows and v.shape is not None and len(v.shape) and v.shape[-1] == rows)
        for v in model.graph.outputs
    )
