"""Text into model feeds: text files tokenized for the model's own inputs (``fp8onnx data``, text
calibration), and the text sample a token model calibrates on when no data is given.

A text source is a ``.txt`` file (one document per line; or, when the file has blank lines,
documents separated by blank lines) or a ``.jsonl`` file (one JSON object per line, the document
under ``field``). It is read lazily, tokenized with a Hugging Face ``tokenizer.json`` (the
``tokenizers`` package, extra ``[text]``) and cut in one of two ways:

* **windows** (default, for language models): the documents' tokens, in order, as one stream cut
  into windows of ``seq_len`` tokens; each window's ``labels`` are the next tokens (what
  ``compare`` scores next-token accuracy and perplexity against). Every window starts with the
  tokenizer's own leading special tokens where it adds some (Gemma's ``<bos>``: without it Gemma 3's
  perplexity is 170 instead of 26). With ``stride`` S below the window's text length, windows overlap
  as in the sliding-window perplexity of LLM quantization papers: each window moves S tokens on and
  scores only its last S labels (the first window scores all), so every token is counted once, each
  with at least ``seq_len - S`` tokens of context (``-1`` labels: not scored);
* **padded** (``pad=True``, for encoders): one document per sample, truncated or padded to
  ``seq_len`` with the tokenizer's own special tokens, padding token and attention mask.

Every model input is then filled in from its declared name, type and shape:

  input_ids / *input_ids*           the tokens
  attention_mask                    the tokenizer's mask (windows: all ones)
  token_type_ids                    the tokenizer's type ids (windows: zeros)
  position_ids                      0, 1, 2, ... over the unpadded tokens (padding repeats the last)
  past_key_values.* / past.* / past_* / *.past_*   empty prefill caches: the batch axis, the declared
                                    fixed axes, and 0 for the past-length axis (the one other
                                    dynamic axis)
  anything else                     refused with one sentence naming the input

With ``max_samples`` and a ``seed`` the samples are a uniform random choice of the whole stream
(reservoir sampling), without a seed the first ``max_samples``; :mod:`fp8onnx.data.sources` writes them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError, printable
from fp8onnx.data.feeds import TEXT_SUFFIXES, InputSpec, input_specs
from fp8onnx.data.kv_cache import past_shape

__all__ = [
    "PAST",
    "TEXT_SUFFIXES",
    "TextOptions",
    "check_tokenizer",
    "documents",
    "fill_inputs",
    "leading_special_tokens",
    "load_tokenizer",
    "text_samples",
    "vocabulary_size",
]

logger = logging.getLogger(__name__)

_PROBE = 1 << 20  # bytes read to tell a blank-line-separated corpus from one document per line


_CHUNK = 256  # documents tokenized per call (tokenizers encodes a batch in parallel)


PAST = re.compile(r"(^|[./_])past($|[./_])|past_key_values|^cache", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class TextOptions:
    tokenizer: str | os.PathLike | None = None  # None: fp8onnx.make_data takes the one beside the model
    seq_len: int = 128
    pad: bool = False
    field: str = "text"
    max_samples: int | None = None
    seed: int | None = None
    stride: int | None = None  # windows: tokens each window moves on and scores (None: its whole text)

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise Fp8OnnxError(f"--seq-len must be a positive integer, got {self.seq_len!r}.")
        if self.stride is not None and (isinstance(self.stride, bool) or not isinstance(self.stride, int)):
            raise Fp8OnnxError(f"--stride must be a positive integer, got {self.stride!r}.")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            raise Fp8OnnxError(f"--stride must be between 1 and --seq-len ({self.seq_len}), got {self.stride}.")
        if self.stride is not None and self.pad:
            raise Fp8OnnxError("--stride applies to windows of text; --pad makes one padded sample per document.")
        if self.max_samples is not None and (not isinstance(self.max_samples, int) or self.max_samples < 1):
            raise Fp8OnnxError(f"--max-samples must be a positive integer, got {self.max_samples!r}.")


def load_tokenizer(path: str | os.PathLike | None):
    if path is None:
        raise Fp8OnnxError("Reading text needs a tokenizer.json (--tokenizer).")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise Fp8OnnxError("Reading text needs the tokenizers package: pip install 'fp8onnx[text]'.") from None
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise Fp8OnnxError(f"Tokenizer file {str(path)!r} does not exist (a Hugging Face tokenizer.json).")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise Fp8OnnxError(f"Tokenizer file {str(path)!r} is not a tokenizer.json ({printable(exc)}).") from exc


def documents(path: str | os.PathLike, field: str = "text") -> Iterator[str]:
    """The documents of a ``.txt`` or ``.jsonl`` file, read lazily (see the module docstring)."""
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise Fp8OnnxError(f"Text file {str(path)!r} must end in .txt or .jsonl.")
    if not path.is_file():
        raise Fp8OnnxError(f"Text file {str(path)!r} does not exist.")
    try:
        with open(path, encoding="utf-8") as fh:
            if suffix == ".jsonl":
                yield from _json_lines(fh, path, field)
                return
            head = fh.read(_PROBE)
            fh.seek(0)
            if re.search(r"\n[ \t]*\r?\n", head.strip("\n")):
                yield from _paragraphs(fh)
            else:
                yield from (line.rstrip("\r\n") for line in fh if line.strip())
    except UnicodeDecodeError as exc:
        raise Fp8OnnxError(f"Text file {str(path)!r} is not UTF-8 (byte {exc.start} of a chunk).") from exc


def _paragraphs(fh) -> Iterator[str]:
    lines: list[str] = []
    for line in fh:
        if line.strip():
            lines.append(line.rstrip("\r\n"))
        elif lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def _json_lines(fh, path: pathlib.Path, field: str) -> Iterator[str]:
    for number, line in enumerate(fh, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Fp8OnnxError(f"Line {number} of {str(path)!r} is not JSON ({exc.msg}).") from exc
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise Fp8OnnxError(f"Line {number} of {str(path)!r} has no text field {field!r} (use --field).")
        if text.strip():
            yield text


def vocabulary_size(model: ir.Model, ids_input: str) -> int | None:
    """Rows of the embedding table (a Gather's initializer, on its axis) the token ids index, through
    Reshape/Flatten/Squeeze/Unsqueeze/Cast (GPT-2 flattens its ids); None without one."""
    value = next((v for v in model.graph.inputs if v.name == ids_input), None)
    frontier = [value] if value is not None else []
    for _ in range(4):  # a few reshaping steps at most between the ids and their Gather
        following: list[ir.Value] = []
        for v in frontier:
            for use in v.uses():
                node = use.node
                if node.op_type == "Gather" and use.idx == 1 and node.inputs[0] is not None:
                    table = node.inputs[0].const_value
                    axis = node.attributes.get_int("axis", 0)  # a tied table Gathers lm_head's [hidden, vocab]
                    if table is not None and -len(table.shape) <= axis < len(table.shape):
                        return table.shape.numpy()[axis]
                elif node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast") and use.idx == 0:
                    following.extend(node.outputs)
        frontier = following
    return None


def _ids_input(specs: list[InputSpec]) -> InputSpec:
    named = [s for s in specs if s.name == "input_ids"] or [s for s in specs if "input_ids" in s.name]
    if not named:
        names = ", ".join(s.name for s in specs)
        raise Fp8OnnxError(f"The model has no token-id input (input_ids) to feed text to; its inputs are {names}.")
    return named[0]


def fill_inputs(
    specs: list[InputSpec], ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray, sizes: dict | None = None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Feeds for every model input from [batch, seq] token ids, attention mask and type ids, and
    per filled-in input the reason (see the module docstring for the rules)."""
    ids_spec = _ids_input(specs)
    feed, why = {}, {}
    for spec in specs:
        name = spec.name.lower()
        if spec is ids_spec:
            feed[spec.name] = _typed(ids, spec)
        elif name.endswith("attention_mask"):
            feed[spec.name], why[spec.name] = _typed(mask, spec), "the tokenizer's attention mask"
        elif name.endswith("token_type_ids"):
            feed[spec.name], why[spec.name] = _typed(type_ids, spec), "the tokenizer's token type ids"
        elif name.endswith("position_ids"):
            feed[spec.name] = _typed(np.maximum(np.cumsum(mask, axis=1) - 1, 0), spec)
            why[spec.name] = "0, 1, 2, ... over the unpadded tokens"
        elif PAST.search(name):
            feed[spec.name] = np.zeros(past_shape(spec, ids.shape[0], sizes), dtype=spec.dtype)
            why[spec.name] = "empty cache for prefill (past length 0)"
        else:
            raise Fp8OnnxError(
                f"Model input {spec.name!r} ({spec.describe()}) cannot be made from text; "
                'give it in an .npz (docs/usage.md, "Data from text").'
            )
    return feed, why


def _typed(array: np.ndarray, spec: InputSpec) -> np.ndarray:
    if spec.rank != array.ndim:
        raise Fp8OnnxError(f"Model input {spec.name!r} is {spec.describe()}; text gives [batch, sequence].")
    for axis, dim in enumerate(spec.shape):
        if dim is not None and dim != array.shape[axis]:
            raise Fp8OnnxError(
                f"Model input {spec.name!r} is {spec.describe()}: axis {axis} is fixed at {dim}, the text gives "
                f"{array.shape[axis]} (set --seq-len {dim}?)."
            )
    if not np.issubdtype(spec.dtype, np.number) and spec.dtype != np.bool_:
        raise Fp8OnnxError(f"Model input {spec.name!r} is {spec.describe()}; text gives integers.")
    return array.astype(spec.dtype)


def _encoded(tokenizer, docs: Iterator[str], options: TextOptions, counts: dict) -> Iterator[tuple]:
    """(ids, mask, type_ids, labels or None) per sample, each [seq_len]."""
    seq = options.seq_len
    if options.pad:
        tokenizer.enable_truncation(max_length=seq)
        pad_id = tokenizer.padding["pad_id"] if tokenizer.padding else (tokenizer.token_to_id("[PAD]") or 0)
        tokenizer.enable_padding(length=seq, pad_id=pad_id)
    else:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        prefix = leading_special_tokens(tokenizer)
        body = seq - len(prefix)  # a window's text
        if body < 1:
            raise Fp8OnnxError(
                f"--seq-len {seq} leaves no room for text after the tokenizer's {len(prefix)} leading tokens."
            )
        stride = options.stride or body
        if stride > body:
            raise Fp8OnnxError(
                f"--stride {stride} is more than a window's {body} tokens of text (--seq-len {seq} less the "
                f"tokenizer's {len(prefix)} leading tokens): tokens would be skipped."
            )
    # without character offsets, which nothing here needs: 25% faster (5.5 vs 4.4 MB/s, MiniLM's tokenizer)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    stream, first = np.zeros(0, np.int64), True
    for chunk in _chunks(docs, _CHUNK):
        counts["documents"] += len(chunk)
        if options.pad:
            for e in encode(chunk):
                counts["tokens"] += int(sum(e.attention_mask))
                yield (
                    np.array(e.ids, np.int64),
                    np.array(e.attention_mask, np.int64),
                    np.array(e.type_ids, np.int64),
                    None,
                )
            continue
        encoded = encode([d + "\n" for d in chunk], add_special_tokens=False)
        stream = np.concatenate([stream, *(np.array(e.ids, np.int64) for e in encoded)])
        counts["tokens"] += sum(len(e.ids) for e in encoded)
        while len(stream) > body:  # a window's text and the token after it (its last label)
            ids = np.concatenate([prefix, stream[:body]])
            labels = np.concatenate([ids[1:], stream[body : body + 1]])
            if not first:
                labels[: seq - stride] = -1  # scored by an earlier window
            first, stream = False, stream[stride:]
            yield ids, np.ones(seq, np.int64), np.zeros(seq, np.int64), labels


def leading_special_tokens(tokenizer) -> np.ndarray:
    """The tokens a decoder's tokenizer puts before a text of its own accord (Gemma's and Llama's
    ``<bos>``), which every window of text starts with; none where it adds nothing (GPT-2, SmolLM2, Qwen)
    or also adds tokens after the text (an encoder's ``[CLS] ... [SEP]``)."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    leading = len(full) - len(plain)
    if leading > 0 and full[leading:] == plain:
        return np.array(full[:leading], np.int64)
    return np.zeros(0, np.int64)


def _chunks(items: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def text_samples(path, specs: list[InputSpec], options: TextOptions, tokenizer=None, counts=None, sizes=None):
    """Per sample (feed of [1, ...] arrays, labels [1, seq] or None), from the text file ``path``."""
    tokenizer = tokenizer or load_tokenizer(options.tokenizer)
    counts = counts if counts is not None else {"documents": 0, "tokens": 0}
    encoded = _encoded(tokenizer, documents(path, options.field), options, counts)
    if options.max_samples is not None:
        encoded = _first_or_sampled(encoded, options.max_samples, options.seed)
    for ids, mask, type_ids, labels in encoded:
        feed, why = fill_inputs(specs, ids[None], mask[None], type_ids[None], sizes)
        yield feed, (None if labels is None else labels[None]), why


def _first_or_sampled(items: Iterator, k: int, seed: int | None) -> Iterator:
    if seed is None:
        for i, item in enumerate(items):
            if i == k:
                return
            yield item
        return
    rng = np.random.default_rng(seed)
    reservoir = []
    for i, item in enumerate(items):  # Algorithm R: each item kept with probability k / (i + 1)
        if i < k:
            reservoir.append(item)
        else:
            j = int(rng.integers(0, i + 1))
            if j < k:
                reservoir[j] = item
    yield from reservoir


def check_tokenizer(model: ir.Model, tokenizer, path) -> None:
    """Refuse a tokenizer with more tokens than the model's embedding table has rows."""
    rows = vocabulary_size(model, _ids_input(input_specs(model)).name)
    if rows is not None and tokenizer.get_vocab_size() > rows:
        raise Fp8OnnxError(
            f"Tokenizer {str(path)!r} has {tokenizer.get_vocab_size()} tokens but the model's embedding "
            f"table has {rows} rows: it is not this model's tokenizer."
        )
