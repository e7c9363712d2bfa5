"""Zero-shot tasks as data: a ``.jsonl`` task file scored the way LLM evaluation harnesses score it.

Two kinds of record, told apart by their keys:

* **completion** ``{"context": ..., "target": ...}`` (LAMBADA): the model reads the context and must
  predict every token of ``" " + target`` greedily (argmax at each of its positions); an item is right
  only if all of them are. Its perplexity is per item: the exponential of the mean over items of the
  target's summed cross-entropy.
* **choice** ``{"context": ..., "endings": [...], "label": k}`` (HellaSwag): each ending is scored by
  its summed log-likelihood after the context, divided by its length in characters (``acc_norm``); the
  item is right if ending ``label`` scores best.

Each continuation is one sample: the tokenizer's leading special tokens (Gemma's ``<bos>``), the
context and the continuation, tokenized as one text (the continuation's tokens are those after the
context's own, as lm-evaluation-harness takes them), cut from the left to ``seq_len`` tokens, right-padded
(attention mask 0) to the longest sample of its batch; ``labels`` mark the positions that predict the
continuation (``-1`` elsewhere). The batches take the items longest first (an item's samples side by side),
so that a batch pads little (LAMBADA in file order, 4 a batch: 14% of the positions are padding; by length:
under 0.1%); ``compare`` then scores the items, in file order again, from its per-sample sums
(:meth:`Task.rescore`), each item one unit of the noise.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import pathlib
from collections.abc import Iterator

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.feeds import Batch, InputSpec
from fp8onnx.data.text import fill_inputs, leading_special_tokens, load_tokenizer

__all__ = ["Task", "TaskData", "is_task_file"]

logger = logging.getLogger(__name__)

TASK_SEQ_LEN = 1024  # the longest sample of a task (tokens); longer ones lose context from the left


def is_task_file(path: str | os.PathLike) -> bool:
    """A ``.jsonl`` file whose first record has ``context`` and ``target`` or ``endings``."""
    path = pathlib.Path(path)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    with open(path, encoding="utf-8") as fh:
        first = next((line for line in fh if line.strip()), "")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and "context" in record and ("target" in record or "endings" in record)


@dataclasses.dataclass
class Task:
    """A task's items: per item its samples (continuations), the right one, and each one's length in
    characters (choice items are normalised by it)."""

    path: str
    kind: str  # "completion" or "choice"
    sizes: list[int]  # samples per item
    gold: list[int]  # the right continuation of each item
    chars: list[list[int]]  # each continuation's length in characters
    order: np.ndarray | None = None  # the file-order index of each sample as the batches give them; None: file order

    def describe(self) -> str:
        if self.kind == "completion":
            return (
                f"Task {self.path}: {len(self.sizes)} completions (LAMBADA-style); accuracy: every token of the "
                "target predicted greedily; perplexity per item (exp of the mean target cross-entropy)."
            )
        return (
            f"Task {self.path}: {len(self.sizes)} multiple-choice items (HellaSwag-style); accuracy: the right "
            "ending has the best log-likelihood per character (acc_norm); no perplexity."
        )

    def rescore(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-item columns (``correct``, ``labelled`` = 1, ``nll`` of the right continuation), in file order,
        from a model's per-sample ones in the batches' order; only items whose samples were all scored count.

        ``requires``: ``columns`` hold the first samples of the batches, all of them where ``order`` is set.
        ``ensures``: item ``i`` of the result is the file's item ``i``."""
        if self.order is not None and len(columns["correct"]) > 0:
            if len(columns["correct"]) != len(self.order):
                raise Fp8OnnxError(
                    f"Task {self.path!r}: {len(columns['correct'])} samples scored of {len(self.order)} batched; "
                    "a task's items are scored whole."
                )
            unsorted = {}
            for key, values in columns.items():
                unsorted[key] = np.empty_like(np.asarray(values))
                unsorted[key][self.order] = values
            columns = unsorted
        correct, nll = columns["correct"], columns["nll"]
        right, total, start = [], [], 0
        for size, gold, chars in zip(self.sizes, self.gold, self.chars):
            if start + size > len(correct):
                break
            item = slice(start, start + size)
            if self.kind == "completion":
                right.append(float(correct[start] == columns["labelled"][start]))
            else:
                right.append(float(np.argmin(nll[item] / np.maximum(chars, 1)) == gold))
            total.append(float(nll[start + gold]))
            start += size
        ones = np.ones(len(right))
        return {"correct": np.array(right), "labelled": ones, "nll": np.array(total)}


class TaskData:
    """A task file as a data source (``as_data``): one sample per continuation, in item order."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[InputSpec],
        tokenizer: str | os.PathLike,
        seq_len: int | None = None,
    ):
        self.path, self.specs = pathlib.Path(path), specs
        self.seq_len = seq_len or TASK_SEQ_LEN
        self.tokenizer = load_tokenizer(tokenizer)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.records = list(_records(self.path))
        kinds = {"choice" if "endings" in r else "completion" for r in self.records}
        if len(kinds) > 1:
            raise Fp8OnnxError(f"Task file {str(self.path)!r} mixes completion and multiple-choice records.")
        kind = kinds.pop()
        continuations = [[r["target"]] if kind == "completion" else list(r["endings"]) for r in self.records]
        self.task = Task(
            str(self.path),
            kind,
            [len(c) for c in continuations],
            [0 if kind == "completion" else int(r["label"]) for r in self.records],
            [[len(c) for c in item] for item in continuations],
        )
        self._continuations = continuations
        self._samples: list[tuple[np.ndarray, int]] | None = None
        logger.info("%s", self.task.describe())

    def count_batches(self, batch_size: int) -> int:
        return -(-sum(self.task.sizes) // batch_size)

    def limit(self, max_samples: int | None) -> None:
        """Keep the file's first items whose samples number at most ``max_samples``: a subset is whole items,
        taken before the batches sort them by length.

        ``ensures``: ``task.sizes`` sums to at most ``max_samples``; an :class:`Fp8OnnxError` where not even the
        first item fits."""
        if max_samples is None:
            return
        kept = int(np.searchsorted(np.cumsum(self.task.sizes), max_samples, side="right"))
        if kept == 0:
            raise Fp8OnnxError(
                f"Task file {str(self.path)!r}: its first item has {self.task.sizes[0]} samples (one per "
                f"continuation), more than the {max_samples} asked for; a task's items are scored whole."
            )
        if kept < len(self.records):
            self.records, self._continuations = self.records[:kept], self._continuations[:kept]
            task = self.task
            self.task = dataclasses.replace(
                task, sizes=task.sizes[:kept], gold=task.gold[:kept], chars=task.chars[:kept]
            )
            self._samples = None

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """The samples ``batch_size`` at a time, items longest first (ties in file order), each item's samples
        side by side; ``task.order`` says where each came from."""
        samples = self._tokenized()
        starts = np.cumsum([0, *self.task.sizes])
        longest = [max(len(ids) for ids, _ in samples[a:b]) for a, b in itertools.pairwise(starts)]
        items = sorted(range(len(longest)), key=lambda i: -longest[i])  # stable: ties keep file order
        order = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in items]) if items else np.zeros(0, int)
        self.task.order = order
        for at in range(0, len(order), batch_size):
            yield self._padded([samples[s] for s in order[at : at + batch_size]])

    def _tokenized(self) -> list[tuple[np.ndarray, int]]:
        """Every sample's (token ids, continuation length), in file order, tokenized once (int32: HellaSwag's
        40,168 samples hold 13 MB so, 102 MB as lists of ints)."""
        if self._samples is None:
            prefix = leading_special_tokens(self.tokenizer).tolist()
            self._samples = [
                (np.asarray(ids, np.int32), tail)
                for ids, tail in (
                    self._sample(prefix, record["context"], continuation)
                    for record, continuations in zip(self.records, self._continuations)
                    for continuation in continuations
                )
            ]
        return self._samples

    def _sample(self, prefix: list[int], context: str, continuation: str) -> tuple[list[int], int]:
        """(token ids, how many of the last ones are the continuation's)."""
        encode = self.tokenizer.encode
        context = context.rstrip(" ")  # a trailing space belongs to the continuation (lm-evaluation-harness)
        head = encode(context, add_special_tokens=False).ids
        whole = encode(context + " " + continuation, add_special_tokens=False).ids
        if whole[: len(head)] != head:  # the tokenizer merged across the boundary: tokenize the two apart
            whole = head + encode(" " + continuation, add_special_tokens=False).ids
        ids = (prefix + whole)[-self.seq_len :]
        return ids, min(len(whole) - len(head), len(ids) - 1)

    def _padded(self, samples: list[tuple[np.ndarray, int]]) -> Batch:
        width = max(len(ids) for ids, _ in samples)
        ids = np.zeros((len(samples), width), np.int64)
        mask = np.zeros_like(ids)
        labels = np.full_like(ids, -1)
        for row, (tokens, tail) in enumerate(samples):
            n = len(tokens)
            ids[row, :n], mask[row, :n] = tokens, 1
            labels[row, n - 1 - tail : n - 1] = tokens[n - tail :]  # positions that predict the continuation
        feed, _ = fill_inputs(self.specs, ids, mask, np.zeros_like(ids))
        return Batch(feed, labels)


def _records(path: pathlib.Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise Fp8OnnxError(f"Task file {str(path)!r}, line {number}: not JSON ({exc.msg}).") from exc
            if not isinstance(record, dict) or "context" not in record:
                raise Fp8OnnxError(f"Task file {str(path)!r}, line {number}: no 'context'.")
            if "endings" in record:
                endings, label = record["endings"], record.get("label")
                if not isinstance(endings, list) or not endings or not all(isinstance(e, str) for e in endings):
                    raise Fp8OnnxError(f"Task file {str(path)!r}, line {number}: 'endings' is not a list of texts.")
                if isinstance(label, bool) or not isinstance(label, (int, str)) or not str(label).isdigit():
                    raise Fp8OnnxError(f"Task file {str(path)!r}, line {number}: 'label' is not an ending's index.")
                if int(label) >= len(endings):
                    raise Fp8OnnxError(
                        f"Task file {str(path)!r}, line {number}: 'label' {label} but {len(endings)} endings."
                    )
            elif not isinstance(record.get("target"), str) or not record["target"].strip():
                raise Fp8OnnxError(f"Task file {str(path)!r}, line {number}: no 'target' text and no 'endings'.")
            yield record
