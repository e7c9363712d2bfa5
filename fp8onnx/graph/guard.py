"""One guard for every path a run writes: no output may land on a file the run reads, or on another
output of the same run.

A command lists what it reads (models with their external-data files, calibration and evaluation
data, statistics) and what it writes (the model and its ``<name>.data`` side file, report, stats,
JSON, CSV, plots) and calls :func:`check_paths` before any work. Two paths are the same file when
they resolve to one path (symlinks followed) or, both existing, are one inode (hard links). A
folder of data counts as every ``.npz`` in it, present or to come.
"""

from __future__ import annotations

import mmap
import os
import pathlib
from collections.abc import Iterable

from fp8onnx.base.errors import Fp8OnnxError

__all__ = [
    "as_path",
    "check_calibration_source",
    "check_output_path",
    "check_paths",
    "external_locations",
    "model_reads",
    "model_writes",
    "side_file",
]

Entry = tuple[str, "str | os.PathLike | None"]


def as_path(source):
    """``source`` when it names a file or folder (data and statistics may also be given in memory)."""
    return source if isinstance(source, (str, os.PathLike)) else None


def side_file(out: str | os.PathLike) -> pathlib.Path:
    """Where the weights of an output model go when it is written with external data."""
    out = pathlib.Path(out)
    return out.with_name(out.name + ".data")


def model_reads(label: str, path: str | os.PathLike | None) -> list[Entry]:
    """The model file and every external-data file its graphs' initializers reference (found by a
    scan of the protobuf that skips the weights' bytes, see ``external_locations``). An unreadable
    model yields just its path: loading it reports the problem later."""
    if path is None:
        return []
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.onnx")):  # an export folder
        path = os.path.join(path, "model.onnx")
    entries: list[Entry] = [(label, path)]
    if not os.path.isfile(path):  # missing, a folder or a FIFO (which would block): load_model says so
        return entries
    try:
        locations = external_locations(path)
    except (OSError, ValueError, IndexError):
        return entries
    folder = pathlib.Path(path).parent
    entries += [(f"the external data of {label}", folder / location) for location in locations]
    return entries


# Field numbers of onnx.proto3 that lead from a ModelProto to its initializers' external data.
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER, _NODE_ATTRIBUTE = 7, 1, 5, 5
_ATTR_G, _ATTR_GRAPHS, _TENSOR_EXTERNAL_DATA, _ENTRY_KEY, _ENTRY_VALUE = 6, 11, 13, 1, 2


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, start, end) of each length-delimited field of the message in buf[start:end];
    other wire types are skipped. Raises ValueError on what is not protobuf."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ValueError("truncated field")
            yield key >> 3, pos, pos + size
            pos += size
        else:
            raise ValueError(f"wire type {wire}")


def external_locations(path: str | os.PathLike) -> list[str]:
    """The distinct ``location`` entries of the external data of the initializers of the main graph
    and of every If/Loop/Scan body, in order of appearance, read without parsing the weights: the
    file is memory-mapped and each tensor's bytes are skipped by their length. On all-MiniLM-L6-v2
    (90 MB) this takes about 1 ms where ``onnx.load(..., load_external_data=False)`` took 0.1 s."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return []
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            view = memoryview(buf)
            try:
                return _locations(view, len(buf))
            finally:
                view.release()


def _locations(buf, size: int) -> list[str]:
    graphs = [(s, e) for field, s, e in _fields(buf, 0, size) if field == _MODEL_GRAPH]
    found: dict[str, None] = {}
    while graphs:
        start, end = graphs.pop()
        for field, s, e in _fields(buf, start, end):
            if field == _GRAPH_INITIALIZER:
                for f, es, ee in _fields(buf, s, e):
                    if f == _TENSOR_EXTERNAL_DATA:
                        entry = {k: bytes(buf[vs:ve]) for k, vs, ve in _fields(buf, es, ee)}
                        if entry.get(_ENTRY_KEY) == b"location" and entry.get(_ENTRY_VALUE):
                            found.setdefault(entry[_ENTRY_VALUE].decode("utf-8", "replace"))
            elif field == _GRAPH_NODE:
                for f, as_, ae in _fields(buf, s, e):
                    if f == _NODE_ATTRIBUTE:
                        graphs += [(gs, ge) for g, gs, ge in _fields(buf, as_, ae) if g in (_ATTR_G, _ATTR_GRAPHS)]
    return list(found)


def model_writes(label: str, path: str | os.PathLike | None) -> list[Entry]:
    """An output model and the side file its weights may go to."""
    if path is None:
        return []
    return [(label, path), (f"the weights file of {label}", side_file(path))]


def _same(a: pathlib.Path, b: pathlib.Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: pathlib.Path, folder: pathlib.Path) -> bool:
    return path.suffix == ".npz" and folder.resolve() in path.resolve().parents


def output_folder(path: str | os.PathLike, label: str = "Output folder") -> pathlib.Path:
    """``path`` as a folder for outputs: created when it does not exist yet and its parent does (as
    ``mkdir``, not ``mkdir -p``: a mistyped parent is reported, not built)."""
    path = pathlib.Path(path)
    if path.is_dir():
        return path
    if path.exists():
        raise Fp8OnnxError(f"{label} {str(path)!r} is a file; give a folder.")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise Fp8OnnxError(f"{label} {str(path)!r} cannot be made: its parent {str(parent)!r} does not exist.")
    try:
        path.mkdir()
    except OSError as exc:
        raise Fp8OnnxError(f"{label} {str(path)!r} cannot be made: {exc.strerror}.") from exc
    return path


def check_output_path(out: str | os.PathLike, label: str = "Output path") -> pathlib.Path:
    """Refuse an output path whose folder is missing or not writable, or that is a folder."""
    out = pathlib.Path(out)
    parent = out.resolve().parent
    if not parent.is_dir():
        raise Fp8OnnxError(f"Output folder {str(parent)!r} does not exist.")
    if not os.access(parent, os.W_OK):
        raise Fp8OnnxError(f"Output folder {str(parent)!r} is not writable.")
    if out.is_dir():
        raise Fp8OnnxError(f"{label} {str(out)!r} is a directory; give a file name.")
    return out


def check_calibration_source(calib: object, stats: object) -> None:
    """The one rule of a run's sources: statistics come from calibration data or from a statistics file,
    not both (checked with the paths, before any work)."""
    if calib is not None and stats is not None:
        raise Fp8OnnxError("Give either --calib or --stats, not both.")


def check_paths(reads: Iterable[Entry], writes: Iterable[Entry]) -> None:
    """Refuse, in one sentence, a write target that is a file this run reads or another output. A text
    source given with its tokenizer (:class:`fp8onnx.data.feeds.TextSource`) reads that tokenizer too."""
    given = list(reads)
    given += [(f"the tokenizer of {label}", t) for label, p in given if (t := getattr(p, "tokenizer", None))]
    read = [(label, pathlib.Path(p)) for label, p in given if p is not None]
    written = [(label, pathlib.Path(p)) for label, p in writes if p is not None]
    for i, (label, out) in enumerate(written):
        if not label.startswith("the weights file"):
            check_output_path(out, _cap(label))
        for src_label, src in read:
            if _same(out, src):
                raise Fp8OnnxError(
                    f"{_cap(label)} {str(out)!r} would overwrite {src_label}, which this run reads; "
                    "choose another path."
                )
            if src.is_dir() and _inside(out, src):
                raise Fp8OnnxError(
                    f"{_cap(label)} {str(out)!r} is inside {src_label} {str(src)!r}, whose .npz files this run reads; "
                    "choose another path."
                )
        for other_label, other in written[:i]:
            if _same(out, other):
                raise Fp8OnnxError(f"{_cap(label)} {str(out)!r} is also {other_label}; give each output its own path.")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]
