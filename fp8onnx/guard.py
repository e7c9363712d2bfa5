"""One guard for every path a run writes: no output may land on a file the run reads, or on another
output of the same run.

A command lists what it reads (models with their external-data files, calibration and evaluation
data, statistics) and what it writes (the model and its ``<name>.data`` side file, report, stats,
JSON, CSV, plots) and calls :func:`check_paths` before any work. Two paths are the same file when
they resolve to one path (symlinks followed) or, both existing, are one inode (hard links). A
folder of data counts as every ``.npz`` in it, present or to come.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

import onnx

from .errors import Fp8OnnxError
from .passes._common import proto_graphs

__all__ = ["as_path", "check_output_path", "check_paths", "model_reads", "model_writes", "side_file"]

Entry = tuple[str, "str | os.PathLike | None"]


def as_path(source):
    """``source`` when it names a file or folder (data and statistics may also be given in memory)."""
    return source if isinstance(source, (str, os.PathLike)) else None


def side_file(out: str | os.PathLike) -> pathlib.Path:
    """Where the weights of an output model go when it is written with external data."""
    out = pathlib.Path(out)
    return out.with_name(out.name + ".data")


def model_reads(label: str, path: str | os.PathLike | None) -> list[Entry]:
    """The model file and every external-data file it references (read from its header only).
    An unreadable model yields just its path: loading it reports the problem later."""
    if path is None:
        return []
    entries: list[Entry] = [(label, path)]
    if not os.path.isfile(path):  # missing, a folder or a FIFO (which would block): load_model says so
        return entries
    try:
        proto = onnx.load(os.fspath(path), load_external_data=False)
    except Exception:
        return entries
    folder = pathlib.Path(path).parent
    seen = set()
    for graph in proto_graphs(proto.graph):
        for tensor in graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                location = next((e.value for e in tensor.external_data if e.key == "location"), None)
                if location and location not in seen:
                    seen.add(location)
                    entries.append((f"the external data of {label}", folder / location))
    return entries


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


def check_paths(reads: Iterable[Entry], writes: Iterable[Entry]) -> None:
    """Refuse, in one sentence, a write target that is a file this run reads or another output."""
    reads = [(label, pathlib.Path(p)) for label, p in reads if p is not None]
    writes = [(label, pathlib.Path(p)) for label, p in writes if p is not None]
    for i, (label, out) in enumerate(writes):
        if not label.startswith("the weights file"):
            check_output_path(out, _cap(label))
        for src_label, src in reads:
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
        for other_label, other in writes[:i]:
            if _same(out, other):
                raise Fp8OnnxError(f"{_cap(label)} {str(out)!r} is also {other_label}; give each output its own path.")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]
