"""Images and audio into model feeds (``fp8onnx data``): the preprocessing a vision or speech model's
users would otherwise write by hand.

**Images** (Pillow, extra ``[image]``): a folder (searched recursively, files in name order) or one
image file. Each image is converted to RGB (or grey for a one-channel input), its shorter side
resized to ``size`` (bilinear), center-cropped to ``crop`` x ``crop``, scaled to [0, 1], normalised
with ``mean``/``std`` (per channel, in [0, 1] units), put in ``channels`` order (rgb or bgr) and
``layout`` (nchw or nhwc, by default read from the model input's declared shape) and cast to the
input's type. The crop defaults to the input's declared height/width, ``size`` to the crop. When
every image sits in a subfolder, the subfolders (in name order) are the classes and ``labels``
holds each image's class index, so ``compare`` reports task accuracy. An export folder's
``preprocessor_config.json`` (Hugging Face image processors: ``image_mean``, ``image_std``, ``size``,
``crop_size``) supplies the defaults.

**Audio** (soundfile, extra ``[audio]``): ``.wav``/``.flac``/``.ogg`` files, a folder of them or one
file. Each file is mixed down to mono, resampled to ``sample_rate`` (polyphase, scipy when installed,
else linear interpolation) and cut into ``chunk`` samples per feed (the last, shorter chunk is
padded with zeros and its ``attention_mask`` says so, where the model has one). The model's audio
input is its one float input of rank 2 ([batch, samples]) or 3 ([batch, 1, samples]).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError, printable
from fp8onnx.data.feeds import InputSpec

__all__ = ["AUDIO_SUFFIXES", "IMAGE_SUFFIXES", "AudioOptions", "ImageOptions", "audio_samples", "image_samples"]

logger = logging.getLogger(__name__)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
RATES = (1000, 384000)  # sample rates read (Hz); outside this range a file is refused


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    size: int | None = None
    crop: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    layout: str | None = None  # nchw | nhwc; None: from the model input
    channels: str = "rgb"


@dataclasses.dataclass(frozen=True)
class AudioOptions:
    sample_rate: int | None = None
    chunk: int | None = None


def files(source: str | os.PathLike, suffixes: tuple[str, ...]) -> list[pathlib.Path]:
    path = pathlib.Path(source)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise Fp8OnnxError(f"Data source {str(path)!r} does not exist.")
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    if not found:
        raise Fp8OnnxError(f"Folder {str(path)!r} has no {'/'.join(suffixes[:4])}... files.")
    return found


def kind_of(source: str | os.PathLike) -> str | None:
    """'image' or 'audio' for a file of that kind, or a folder whose first such file is; else None."""
    path = pathlib.Path(source)
    candidates = (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    )
    for p in candidates:
        if p.suffix.lower() in IMAGE_SUFFIXES:
            return "image"
        if p.suffix.lower() in AUDIO_SUFFIXES:
            return "audio"
    return None


def _float_input(specs: list[InputSpec], ranks: tuple[int, ...], what: str) -> InputSpec:
    found = [s for s in specs if np.issubdtype(s.dtype, np.floating) and s.rank in ranks]
    if len(found) != 1:
        names = ", ".join(f"{s.name} {s.describe()}" for s in specs)
        raise Fp8OnnxError(
            f"The model needs one float input of rank {' or '.join(map(str, ranks))} for {what}; it has {names}."
        )
    return found[0]


def _preprocessor(folder: pathlib.Path | None) -> dict:
    path = folder / "preprocessor_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Fp8OnnxError(f"{str(path)!r} is not readable JSON ({printable(exc)}).") from exc


def _edge(value) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return value.get("shortest_edge") or value.get("height")
    return None


def image_samples(source, specs: list[InputSpec], options: ImageOptions, folder: pathlib.Path | None = None):
    """Per image (feed of [1, ...] arrays, labels [1] or None, what was filled in)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise Fp8OnnxError("Reading images needs Pillow: pip install 'fp8onnx[image]'.") from None
    spec = _float_input(specs, (4,), "images")
    others = [s.name for s in specs if s is not spec]
    if others:
        raise Fp8OnnxError(f"Model inputs {', '.join(others)} cannot be made from images; give them in an .npz.")
    layout = options.layout or ("nchw" if spec.shape[1] in (1, 3) else "nhwc" if spec.shape[3] in (1, 3) else None)
    if layout not in ("nchw", "nhwc"):
        raise Fp8OnnxError(
            f"Cannot tell the layout of input {spec.name!r} ({spec.describe()}): pass --layout nchw|nhwc."
        )
    channels = spec.shape[1] if layout == "nchw" else spec.shape[3]
    channels = channels or 3
    height, width = (spec.shape[2], spec.shape[3]) if layout == "nchw" else (spec.shape[1], spec.shape[2])
    pre = _preprocessor(folder)
    crop = options.crop or height or _edge(pre.get("crop_size")) or _edge(pre.get("size")) or 224
    size = options.size or _edge(pre.get("size")) or crop
    if height and width and (height, width) != (crop, crop):
        raise Fp8OnnxError(f"Input {spec.name!r} is {spec.describe()}; --crop {crop} gives {crop}x{crop} images.")
    mean = np.asarray(options.mean or pre.get("image_mean") or [0.0] * channels, np.float32)
    std = np.asarray(options.std or pre.get("image_std") or [1.0] * channels, np.float32)
    for name, v in (("--mean", mean), ("--std", std)):
        if v.size not in (1, channels):
            raise Fp8OnnxError(f"{name} has {v.size} values; input {spec.name!r} has {channels} channels.")
    if (std == 0).any():
        raise Fp8OnnxError("--std must not be 0.")
    paths = files(source, IMAGE_SUFFIXES)
    root = pathlib.Path(source)
    labelled = root.is_dir() and all(len(p.relative_to(root).parts) > 1 for p in paths)
    classes = sorted({p.relative_to(root).parts[0] for p in paths}) if labelled else []
    why = {
        spec.name: f"{layout}, {'grey' if channels == 1 else options.channels}, resized to {size}, cropped to {crop}"
    }
    for path in paths:
        try:
            with Image.open(path) as opened:
                im = opened.convert("L" if channels == 1 else "RGB")
                scale = size / min(im.size)
                wide = (max(crop, round(im.size[0] * scale)), max(crop, round(im.size[1] * scale)))
                im = im.resize(wide, Image.Resampling.BILINEAR)
                left, top = (im.size[0] - crop) // 2, (im.size[1] - crop) // 2
                pixels = np.asarray(im.crop((left, top, left + crop, top + crop)), np.float32) / 255.0
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise Fp8OnnxError(f"Image file {str(path)!r} cannot be decoded ({printable(exc)}).") from exc
        if pixels.ndim == 2:
            pixels = pixels[..., None]
        if channels == 3 and options.channels == "bgr":
            pixels = pixels[..., ::-1]
        pixels = (pixels - mean) / std
        if layout == "nchw":
            pixels = pixels.transpose(2, 0, 1)
        label = np.array([classes.index(path.relative_to(root).parts[0])], np.int64) if labelled else None
        yield {spec.name: np.ascontiguousarray(pixels[None], dtype=spec.dtype)}, label, why
    if labelled:
        logger.info("image classes (labels 0..%d): %s", len(classes) - 1, ", ".join(classes))


def _resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return x
    g = math.gcd(rate, target)
    try:
        from scipy.signal import resample_poly

        return resample_poly(x, target // g, rate // g).astype(np.float32)
    except ImportError:
        n = round(len(x) * target / rate)
        return np.interp(np.arange(n) * (rate / target), np.arange(len(x)), x).astype(np.float32)


def audio_samples(source, specs: list[InputSpec], options: AudioOptions, folder: pathlib.Path | None = None):
    """Per chunk (feed of [1, ...] arrays, None, what was filled in)."""
    try:
        import soundfile
    except ImportError:
        raise Fp8OnnxError("Reading audio needs soundfile: pip install 'fp8onnx[audio]'.") from None
    spec = _float_input(specs, (2, 3), "audio")
    mask = next((s for s in specs if s.name.lower().endswith("attention_mask")), None)
    others = [s.name for s in specs if s is not spec and s is not mask]
    if others:
        raise Fp8OnnxError(f"Model inputs {', '.join(others)} cannot be made from audio; give them in an .npz.")
    pre = _preprocessor(folder)
    target = options.sample_rate or pre.get("sampling_rate") or 16000
    fixed = spec.shape[-1]
    chunk = options.chunk or fixed or target  # one second by default
    if fixed and chunk != fixed:
        raise Fp8OnnxError(f"Input {spec.name!r} is {spec.describe()}: --chunk must be {fixed}.")
    why = {spec.name: f"mono, {target} Hz, {chunk} samples per feed"}
    if mask is not None:
        why[mask.name] = "1 for audio, 0 for the zero padding of a last chunk"
    for path in files(source, AUDIO_SUFFIXES):
        try:
            wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        except Exception as exc:
            raise Fp8OnnxError(f"Audio file {str(path)!r} cannot be decoded ({printable(exc)}).") from exc
        if not RATES[0] <= rate <= RATES[1]:
            raise Fp8OnnxError(
                f"Audio file {str(path)!r} is at {rate} Hz; rates from {RATES[0]} to {RATES[1]} Hz are read."
            )
        wave = _resample(wave.mean(axis=1), rate, target)
        for start in range(0, max(len(wave), 1), chunk):
            piece = wave[start : start + chunk]
            valid = len(piece)
            piece = np.pad(piece, (0, chunk - valid))
            values = piece[None] if spec.rank == 2 else piece[None, None]
            feed = {spec.name: values.astype(spec.dtype)}
            if mask is not None:
                feed[mask.name] = (np.arange(chunk) < valid)[None].astype(mask.dtype)
            yield feed, None, why
