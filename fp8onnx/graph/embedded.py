"""A single-file model's embedded weights moved to a side file before the model is parsed.

``torch.onnx.export`` writes models below protobuf's 2 GB limit as one file with every weight inside.
Parsing such a file holds it twice (the bytes read and the parsed message), and onnx.checker on it a
third time: a 652 MB LLM peaked at 3.1x its file while loading. :func:`externalize` instead walks the
file's protobuf encoding and copies each large main-graph initializer's ``raw_data`` to a data file
beside a rewritten copy of the model, in chunks; the copy is then loaded like any external-data model
(weights memory-mapped on use). Memory holds one chunk and the graph without its weights.

requires: a ModelProto file whose initializers are all inside it. ensures: the copy, loaded with its
external data, has the same graph, initializers (names, types, shapes, bytes) and metadata.
"""

from __future__ import annotations

import io
import logging
import os
import pathlib

from fp8onnx.base.phases import phase
from fp8onnx.base.scratch import scratch_folder

__all__ = ["EMBEDDED_BYTES", "externalize", "externalized"]

logger = logging.getLogger(__name__)

EMBEDDED_BYTES = 256 << 20  # files larger than this are externalized before loading
MIN_TENSOR = 1024  # raw_data of at least this many bytes goes to the data file (onnx's default threshold)
_ALIGN = 4096  # page-aligned offsets: each tensor can be memory-mapped
_CHUNK = 16 << 20
_LEN = 2  # protobuf's length-delimited wire type
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION = 9, 13, 14


class _External(Exception):
    """The file already refers to external data: it is loaded as it is."""


def _read_varint(f: io.BufferedReader) -> int:
    shift = result = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise ValueError("truncated protobuf varint")
        result |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return result
        shift += 7


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def _fields(f: io.BufferedReader, end: int):
    """(field number, wire type, the field's encoding when not length-delimited, payload start,
    payload length) of each field up to ``end``; after each, the reader is at the next field."""
    while f.tell() < end:
        start = f.tell()
        key = _read_varint(f)
        number, wire = key >> 3, key & 7
        if wire == _LEN:
            length = _read_varint(f)
            at = f.tell()
            yield number, wire, b"", at, length
            f.seek(at + length)
            continue
        if wire == 0:
            _read_varint(f)
        elif wire in (1, 5):
            f.seek(8 if wire == 1 else 4, os.SEEK_CUR)
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        end_of_field = f.tell()
        f.seek(start)
        yield number, wire, f.read(end_of_field - start), end_of_field, 0


def _copy(f: io.BufferedReader, start: int, length: int, data: io.BufferedWriter) -> None:
    f.seek(start)
    while length:
        chunk = f.read(min(_CHUNK, length))
        data.write(chunk)
        length -= len(chunk)


def _tensor(f, start: int, length: int, data, location: str) -> bytes:
    """One TensorProto, its raw_data moved to ``data`` when large enough."""
    kept, raw = bytearray(), None
    for number, wire, encoded, at, size in _fields(f, start + length):
        if number == _DATA_LOCATION and encoded[-1:] != b"\x00":
            raise _External
        if number == _RAW_DATA and wire == _LEN and size >= MIN_TENSOR:
            raw = (at, size)
        elif number != _DATA_LOCATION:
            if wire == _LEN:
                f.seek(at)
                kept += _varint(number << 3 | _LEN) + _varint(size) + f.read(size)
            else:
                kept += encoded
    if raw is None:
        return bytes(kept)
    offset = data.tell()
    data.write(b"\0" * (-offset % _ALIGN))
    offset = data.tell()
    _copy(f, raw[0], raw[1], data)
    f.seek(start + length)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(raw[1]))):
        kept += _field(_EXTERNAL_DATA, _field(1, key.encode()) + _field(2, value.encode()))
    kept += _varint(_DATA_LOCATION << 3) + _varint(1)  # data_location: EXTERNAL
    return bytes(kept)


def _rewrite(f, start: int, end: int, data, location: str, depth: int) -> bytes:
    """The model (``depth`` 0) or its main graph (1), with the initializers' weights moved out."""
    out = bytearray()
    for number, wire, encoded, at, size in _fields(f, end):
        if wire != _LEN:
            out += encoded
        elif depth == 0 and number == _MODEL_GRAPH:
            out += _field(number, _rewrite(f, at, at + size, data, location, 1))
            f.seek(at + size)
        elif depth == 1 and number == _GRAPH_INITIALIZER:
            out += _field(number, _tensor(f, at, size, data, location))
        else:
            f.seek(at)
            out += _field(number, f.read(size))
    return bytes(out)


def externalize(path: str | os.PathLike, folder: str | os.PathLike) -> pathlib.Path | None:
    """Write ``folder/<name>`` and ``folder/<name>.data``: ``path`` with its large main-graph
    initializers in the data file. Returns the new model's path, or None (nothing written) where
    ``path`` already refers to external data."""
    path, folder = pathlib.Path(path), pathlib.Path(folder)
    target = folder / path.name
    location = path.name + ".data"
    try:
        with open(path, "rb") as f, open(folder / location, "wb") as data:
            model = _rewrite(f, 0, os.fstat(f.fileno()).st_size, data, location, 0)
    except _External:
        (folder / location).unlink(missing_ok=True)
        return None
    target.write_bytes(model)
    return target


def externalized(path: pathlib.Path) -> pathlib.Path | None:
    """A copy of a single-file model larger than ``EMBEDDED_BYTES`` with its weights in a side file
    (:func:`externalize`), in a temporary folder removed when the job ends (:mod:`fp8onnx.base.scratch`);
    None to load it as it is (small, already with external data, or not a model this can walk)."""
    if path.stat().st_size <= EMBEDDED_BYTES:
        return None
    folder = scratch_folder("fp8onnx-embedded-")
    try:
        with phase("move embedded weights to a side file"):
            copy = externalize(path, folder)
    except (OSError, ValueError) as exc:  # no room in TMPDIR, or not protobuf: parsed as it is (and explained)
        logger.warning(
            "loading %s whole, which takes about 3x its size in memory: its weights could not be moved to a "
            "side file in %s (%s); point TMPDIR at a folder with room for them",
            path,
            folder,
            exc,
        )
        return None
    if copy is not None:
        logger.info("%s: embedded weights moved to %s (memory-mapped from there)", path, folder)
    return copy
