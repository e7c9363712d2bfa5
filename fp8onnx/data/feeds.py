"""Calibration and evaluation data: ``.npz`` files (or folders of them) keyed by model input names.

Two layouts, told apart by each array's rank against the model input's declared rank (SPEC §4):

* **batch layout** - the array has the input's rank, samples on axis 0; batches of ``batch_size``
  are cut from it, the last one may be short;
* **feed layout** - the array has one extra leading axis; each slice along it is one complete feed.
  Where every input's first axis is dynamic, ``batch_size`` feeds are concatenated along it
  for speed; otherwise feeds run one by one.

``labels`` travels with the batches (for task accuracy in compare); keys starting with ``_`` are
free metadata; any other key that is not a model input is ignored with a log note.
A plain ``.npy`` file is accepted for a model with one input: it is that input's array.
Files are opened with ``allow_pickle=False``: object arrays are refused, never unpickled. Every
member's header is checked against the bytes the member really holds before anything is read, so a
corrupt or hostile file is one sentence, not an allocation of the size it claims.

Casts are lossless or refused: float data may narrow to the input's float type (float64 to
float32); integer data is cast to a narrower integer or to a float input only when every value is
representable there, and a note says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sized

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError, printable

__all__ = ["LABELS", "Batch", "FeedData", "InputSpec", "NpzData", "input_specs"]

logger = logging.getLogger(__name__)
LABELS = "labels"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]  # None for a dynamic dimension (named, unknown, 0 or -1)
    # the declared names of the dynamic dimensions, where named (not part of what a spec is)
    dim_names: tuple[str | None, ...] = dataclasses.field(default=(), compare=False)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype} [{dims}]"


@dataclasses.dataclass
class Batch:
    feed: dict[str, np.ndarray]
    labels: np.ndarray | None = None

    @property
    def size(self) -> int:
        first = next(iter(self.feed.values()))
        return int(first.shape[0]) if first.ndim else 1


def input_specs(model: ir.Model) -> list[InputSpec]:
    """The model's real inputs (graph inputs that are not initializers) with NumPy dtypes."""
    specs = []
    for value in model.graph.inputs:
        if value.const_value is not None:
            continue
        if value.dtype is None or value.shape is None:
            raise Fp8OnnxError(f"Model input {value.name!r} has no declared type or shape.")
        # dim_param, empty, 0 and -1 (paddle2onnx writes -1 for dynamic axes) are all dynamic
        dims = tuple(d if isinstance(d, int) and d > 0 else None for d in value.shape)
        names = tuple(d if isinstance(d, str) else getattr(d, "value", None) for d in value.shape)
        specs.append(InputSpec(value.name or "", np.dtype(value.dtype.numpy()), dims, names))
    return specs


class FeedData:
    """Data given as any iterable of feed dicts (the Python API); each dict is run as is."""

    def __init__(self, feeds: Iterable[Mapping[str, np.ndarray]], specs: list[InputSpec]):
        self._feeds = feeds
        self._specs = specs

    def count_batches(self, batch_size: int) -> int | None:
        return len(self._feeds) if isinstance(self._feeds, Sized) else None

    @property
    def one_shot(self) -> bool:
        """The feeds were given as an iterator (a generator): they can be read once."""
        return iter(self._feeds) is self._feeds

    def readable_again(self) -> FeedData:
        """This source, readable more than once: feeds given as an iterator (a generator) can be read
        only once, so a recipe that reads the data several times keeps them in memory."""
        if self.one_shot:
            self._feeds = list(self._feeds)
            logger.info(
                "%d feeds given as an iterator are kept in memory: the recipe reads them more than once",
                len(self._feeds),
            )
        return self

    def batches(self, batch_size: int) -> Iterator[Batch]:
        for i, feed in enumerate(self._feeds):
            feed = dict(feed)
            labels = feed.pop(LABELS, None)
            yield Batch(_check_feed(feed, self._specs, f"feed #{i}"), labels)


class _Npy:
    """A plain ``.npy`` file seen as an npz with one member: the model's only input."""

    def __init__(self, file: pathlib.Path, key: str):
        self.file, self.key, self.files = file, key, [key]

    def header(self):
        with open(self.file, "rb") as fh:
            shape, dtype, offset = _read_header(fh)
        return shape, dtype, self.file.stat().st_size - offset

    def __getitem__(self, key: str) -> np.ndarray:
        return np.load(self.file, allow_pickle=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class NpzData:
    """One ``.npz`` file or a folder of them, validated against the model's inputs on opening."""

    def __init__(self, path: str | os.PathLike, specs: list[InputSpec]):
        self.path = pathlib.Path(path)
        self._specs = specs
        if self.path.is_dir():
            self.files = sorted(p for p in self.path.iterdir() if p.suffix == ".npz" and p.is_file())
            if not self.files:
                raise Fp8OnnxError(f"Data folder {str(self.path)!r} contains no .npz file.")
        elif self.path.is_file():
            self.files = [self.path]
        elif self.path.exists():  # a FIFO or device would block or never end
            raise Fp8OnnxError(f"Data path {str(self.path)!r} is not a regular file or folder.")
        else:
            raise Fp8OnnxError(f"Data file {str(self.path)!r} does not exist.")
        # Validate every file's keys, ranks and counts up front (reads headers, not the data).
        self._layouts = {f: self._layout(f) for f in self.files}
        self.num_samples = sum(count for _, count in self._layouts.values())

    def _step(self, layout: str, batch_size: int) -> int:
        if layout == "batch" or all(s.rank > 0 and s.shape[0] is None for s in self._specs):
            return batch_size
        return 1

    def count_batches(self, batch_size: int) -> int:
        return sum(-(-count // self._step(layout, batch_size)) for layout, count in self._layouts.values())

    def _open(self, file: pathlib.Path):
        if file.suffix == ".npy":
            if len(self._specs) != 1:
                names = ", ".join(s.name for s in self._specs)
                raise Fp8OnnxError(
                    f"Data file {str(file)!r} is a plain .npy (one array); the model has {len(self._specs)} inputs "
                    f"({names}): give an .npz keyed by input name."
                )
            return _Npy(file, self._specs[0].name)
        if not zipfile.is_zipfile(file):
            raise Fp8OnnxError(f"Data file {str(file)!r} is not an npz (zip) file, or it is truncated.")
        try:
            return np.load(file, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise Fp8OnnxError(f"Data file {str(file)!r} is not a readable .npz archive ({printable(exc)}).") from exc

    def _layout(self, file: pathlib.Path) -> tuple[str, int]:
        """Returns ('batch'|'feed', number of samples or feeds) after checking keys and ranks."""
        with self._open(file) as npz:
            keys = set(npz.files)
            missing = [s.name for s in self._specs if s.name not in keys]
            if missing:
                expected = ", ".join(f"{s.name} {s.describe()}" for s in self._specs)
                raise Fp8OnnxError(
                    f"Data file {str(file)!r} has no array for input {missing[0]!r}; the model expects {expected}."
                )
            for key in sorted(keys - {s.name for s in self._specs} - {LABELS}):
                if not key.startswith("_"):
                    logger.info("%s: key %r is not a model input; ignored", file, key)
            layouts, counts = set(), {}
            for spec in self._specs:
                shape = _npz_shape(npz, spec.name, file)
                if len(shape) == spec.rank:
                    layouts.add("batch")
                elif len(shape) == spec.rank + 1:
                    layouts.add("feed")
                else:
                    raise Fp8OnnxError(
                        f"Data key {spec.name!r} in {str(file)!r} has rank {len(shape)}; the model input is "
                        f"{spec.describe()} (rank {spec.rank}, or {spec.rank + 1} for one feed per slice)."
                    )
                if spec.rank == 0 and len(shape) == 0:
                    raise Fp8OnnxError(
                        f"Data key {spec.name!r} in {str(file)!r} is a scalar; give one value per feed (rank 1)."
                    )
                if shape[0] == 0:
                    raise Fp8OnnxError(f"Data key {spec.name!r} in {str(file)!r} is empty.")
                counts[spec.name] = shape[0]
            if len(layouts) > 1:
                raise Fp8OnnxError(
                    f"Data file {str(file)!r} mixes layouts: some keys have the input's rank, others one more."
                )
            if LABELS in keys:
                counts[LABELS] = _npz_shape(npz, LABELS, file)[0]
            if len(set(counts.values())) > 1:
                detail = ", ".join(f"{k}: {v}" for k, v in counts.items())
                raise Fp8OnnxError(f"Data file {str(file)!r} has arrays with different sample counts ({detail}).")
            return layouts.pop(), next(iter(counts.values()))

    def batches(self, batch_size: int) -> Iterator[Batch]:
        if batch_size < 1:
            raise Fp8OnnxError(f"--batch-size must be at least 1, got {batch_size}.")
        for file in self.files:
            layout, count = self._layouts[file]
            with self._open(file) as npz:
                arrays = {s.name: _checked_array(npz, s, file, layout) for s in self._specs}
                labels = npz[LABELS] if LABELS in npz.files else None
            step = self._step(layout, batch_size)
            for start in range(0, count, step):
                sl = slice(start, start + step)
                if layout == "batch":
                    feed = {k: v[sl] for k, v in arrays.items()}
                    lab = labels[sl] if labels is not None else None
                elif step == 1:
                    feed = {k: np.asarray(v[start]) for k, v in arrays.items()}  # 0-d arrays, not scalars
                    lab = labels[start] if labels is not None else None
                else:  # concatenate whole feeds along their (dynamic) batch axis
                    feed = {k: _joined(v[sl]) for k, v in arrays.items()}
                    lab = None if labels is None else _joined(labels[sl])
                yield Batch(feed, lab)


def _joined(feeds: np.ndarray) -> np.ndarray:
    """Feeds (F, B, ...) as one batch (F*B, ...). The size is explicit: a 0-length axis (a prefill's
    empty KV cache) leaves nothing for ``reshape(-1, ...)`` to infer from."""
    return feeds.reshape((feeds.shape[0] * feeds.shape[1],) + feeds.shape[2:])


def _read_header(fh) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset of the data) from an open .npy stream."""
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(fh, max_header_size=1 << 20)
    else:
        shape, _, dtype = np.lib.format.read_array_header_2_0(fh, max_header_size=1 << 20)
    return tuple(shape), dtype, fh.tell()


def _npz_shape(npz, key: str, file: pathlib.Path) -> tuple[int, ...]:
    """The member's shape from its header only; refused when its data could not be what it declares."""
    where = f"Data key {key!r} in {str(file)!r}"
    try:
        if isinstance(npz, _Npy):
            shape, dtype, held = npz.header()
        else:
            with npz.zip.open(key + ".npy") as fh:
                shape, dtype, offset = _read_header(fh)
            held = npz.zip.getinfo(key + ".npy").file_size - offset
    except Exception as exc:
        raise Fp8OnnxError(f"{where} cannot be read ({printable(exc)}); is the file corrupt?") from exc
    if dtype.hasobject:
        raise Fp8OnnxError(f"{where} holds Python objects; refused (no unpickling).")
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if declared > held:
        raise Fp8OnnxError(
            f"{where} declares shape {shape} ({declared} bytes of {dtype}) but holds only {held} bytes; "
            "the file is corrupt or truncated."
        )
    return shape


def _checked_array(npz, spec: InputSpec, file: pathlib.Path, layout: str) -> np.ndarray:
    try:
        arr = npz[spec.name]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise Fp8OnnxError(
            f"Data key {spec.name!r} in {str(file)!r} cannot be read ({printable(exc)}); is the file corrupt?"
        ) from exc
    return _conform(arr, spec, f"Data key {spec.name!r} in {str(file)!r}", leading=1 if layout == "feed" else -1)


def _conform(arr: np.ndarray, spec: InputSpec, where: str, leading: int) -> np.ndarray:
    """Cast to the input's dtype when that is lossless in kind; check fixed dims and finiteness.

    ``leading`` is the number of axes in front of one feed: 0 for a whole feed, 1 for the feed
    layout. In batch layout (``leading=-1``) axis 0 is the sample axis and is not checked.
    """
    if arr.dtype != spec.dtype:
        arr = _cast(arr, spec, where)
    offset = max(leading, 0)
    for axis in range(1 if leading < 0 else 0, spec.rank):
        want = spec.shape[axis]
        if want is not None and arr.shape[offset + axis] != want:
            raise Fp8OnnxError(
                f"{where} has shape {tuple(arr.shape)}, which contradicts the model input {spec.describe()} "
                f"at axis {axis}."
            )
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise Fp8OnnxError(f"{where} contains NaN or Inf values.")
    return arr


def _cast(arr: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    """``arr`` in the input's dtype, or one sentence: float narrows within floats (float64 to float32);
    integers (and booleans) go to a narrower integer or to a float only when every value survives."""
    src, dst = arr.dtype, spec.dtype
    refused = f"{where} has dtype {src}; the model input expects {spec.describe()}"
    if src.kind == "f" and dst.kind == "f":
        return arr.astype(dst)
    if src.kind not in "iub" or dst.kind not in "iubf":
        raise Fp8OnnxError(refused + ".")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = arr.astype(dst)
        lost = ~np.isfinite(cast) if dst.kind == "f" else np.zeros(arr.shape, bool)
        lost |= np.where(lost, False, cast.astype(src) != arr)
    if lost.any():
        bad = arr.ravel()[np.flatnonzero(lost.ravel())[0]]
        raise Fp8OnnxError(f"{refused}, and value {bad} is not representable there; refused (no lossy casts).")
    if dst.kind == "f" or not np.can_cast(src, dst, casting="safe"):
        logger.warning("%s: cast %s to %s (every value is exact)", where, src, dst)
    return cast


def _check_feed(feed: dict[str, np.ndarray], specs: list[InputSpec], where: str) -> dict[str, np.ndarray]:
    out = {}
    for spec in specs:
        if spec.name not in feed:
            expected = ", ".join(s.name for s in specs)
            raise Fp8OnnxError(f"{where} has no array for input {spec.name!r}; the model expects {expected}.")
        arr = np.asarray(feed[spec.name])
        if arr.ndim != spec.rank:
            raise Fp8OnnxError(f"{where}: input {spec.name!r} has rank {arr.ndim}; expected {spec.describe()}.")
        out[spec.name] = _conform(arr, spec, f"{where}: input {spec.name!r}", leading=0)
    return out


TEXT_SUFFIXES = (".txt", ".jsonl")


def is_text(path: str | os.PathLike) -> bool:
    return pathlib.Path(path).suffix.lower() in TEXT_SUFFIXES


@dataclasses.dataclass(frozen=True)
class TextSource(os.PathLike):
    """A text file with how to tokenize it (``--tokenizer``, ``--seq-len``, ``--stride``). It is path-like,
    so it goes wherever a data path goes (path checks, reports); :func:`fp8onnx.data.datasource.as_data`
    reads its options. ``tokenizer`` None: the ``tokenizer.json`` beside the model or the text; ``seq_len``
    None: 128; ``stride`` None: windows side by side (see :mod:`fp8onnx.data.text`)."""

    path: str | os.PathLike
    tokenizer: str | os.PathLike | None = None
    seq_len: int | None = None
    label: str | None = None  # how reports name it (the default sample: not its temporary path)
    stride: int | None = None

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return self.label or os.fspath(self.path)
