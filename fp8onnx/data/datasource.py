"""The one entry that turns what the user gave as data (a path: ``.npz``/``.npy`` file or folder, text,
images or audio; a :class:`~fp8onnx.data.feeds.TextSource`; or an iterable of feed dicts) into a data
source with ``batches()`` and ``count_batches()``. It sits above the kinds it picks from:
:mod:`fp8onnx.data.feeds` (npz layouts, feeds), :mod:`fp8onnx.data.sources` (text) and :mod:`fp8onnx.data.media`
(images, audio)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, TypeAlias, Union

import numpy as np
import onnx_ir as ir

from fp8onnx.data.feeds import Batch, FeedData, InputSpec, NpzData, TextSource, is_text
from fp8onnx.data.media import kind_of
from fp8onnx.data.sources import MediaData, TextData, find_tokenizer
from fp8onnx.data.tasks import TaskData, is_task_file

__all__ = ["Data", "DataSource", "as_data"]


class DataSource(Protocol):
    """Data fp8onnx reads as it is: its batches (feeds, input name -> array, and labels if any), and
    how many there are (None: not known before reading them)."""

    def batches(self, batch_size: int) -> Iterator[Batch]: ...

    def count_batches(self, batch_size: int) -> int | None: ...


# What the public functions take as data (calib, data, eval_data): a path (an .npz/.npy file or a folder
# of them, .txt/.jsonl text, images, audio), a TextSource, a DataSource, or feed dicts (one sample or a
# batch each).
Data: TypeAlias = Union[str, os.PathLike, DataSource, Iterable[Mapping[str, np.ndarray]]]


def as_data(data, specs: list[InputSpec], model: ir.Model | None = None):
    """A path (file or folder) or an iterable of feed dicts, as a data source with ``batches()``. A
    ``.txt``/``.jsonl`` path (or a :class:`TextSource`) is tokenized for ``model`` (see
    :class:`fp8onnx.data.sources.TextData`)."""
    if hasattr(data, "batches") and hasattr(data, "count_batches"):  # a data source already: read as it is
        return data
    if isinstance(data, (str, os.PathLike)):
        path = pathlib.Path(data)
        if isinstance(data, TextSource) or is_text(path):
            text = data if isinstance(data, TextSource) else TextSource(data)
            if is_task_file(path):  # zero-shot task items (LAMBADA, HellaSwag), not running text
                return TaskData(path, specs, text.tokenizer or find_tokenizer(path, model), text.seq_len)
            return TextData(text.path, specs, model, tokenizer=text.tokenizer, seq_len=text.seq_len, stride=text.stride)
        if path.suffix.lower() not in (".npz", ".npy") and not (path.is_dir() and any(path.glob("*.npz"))):
            kind = kind_of(path)  # images or audio (a folder of them, or one file)
            if kind is not None:
                return MediaData(data, specs, model, kind)
        return NpzData(data, specs)
    return FeedData(data, specs)
