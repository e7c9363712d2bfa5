"""The text a token model calibrates on when the user gives no data: about 136 kB of CPython's own
documentation (``pydoc_data.topics``) and as many tokens of CPython's own standard library code (both ship
with Python), tokenized by the model's tokenizer; for a model too wide for that (GPTQ's rows a channel), more
code until it is enough.

Why code beside the documentation (SmolLM2-135M, 2026-12-06, ``docs/benchmarks.md``, "Calibration that spans
domains"): calibrated on 128 windows of each instead of 256 of documentation, the defaults' perplexity on
PTB's test set fell 0.64% (one standard error 0.12%) and on code 0.22% (0.10%), ``llm-w8a8``'s on PTB 0.61%
(0.15%), C4 unchanged, LAMBADA's targets within the noise."""

from __future__ import annotations

import logging
import os
import pathlib
import sysconfig

from fp8onnx.base.scratch import make_dir
from fp8onnx.data.feeds import TextSource
from fp8onnx.data.text import load_tokenizer
from fp8onnx.graph.model_io import model_file

__all__ = ["default_text_sample", "python_text_sample"]

logger = logging.getLogger(__name__)

# GPTQ wants 16 rows of X a channel (fp8onnx.techniques.gptq.MIN_ROWS_PER_CHANNEL): SmolLM2-135M's widest
# input has 1,536 channels, 24.6k tokens; its tokenizer reads these 136 kB as 33,505 tokens (the 48 kB of
# before gave 12,498: GPTQ then fitted the sample more than new text).
SAMPLE_BYTES = 136_000
CODE_BYTES = 8_000_000  # at most this much standard-library code is read to reach a wide model's tokens


SAMPLE_LABEL = (
    "a text sample of CPython's documentation and standard library code (shipped with Python, {kb} kB); "
    "domain data calibrates better: --calib"
)


_SAMPLES: dict[tuple[str, int], tuple[str, pathlib.Path, str]] = {}  # the process's samples, written once each


def python_text_sample(tokenizer: str | os.PathLike, tokens: int = 0) -> TextSource:
    """Text to calibrate a token model on when no data is given: the even-indexed topics of CPython's
    bundled documentation (``pydoc_data.topics``), about ``SAMPLE_BYTES``, then the top-level modules of
    CPython's standard library, whole, until ``tokenizer`` counts as many tokens of code as of documentation,
    and ``tokens`` in all (a wide model's GPTQ rows); where all of them are not enough, a warning says how
    many there are."""
    key = (os.fspath(tokenizer), tokens)
    cached = _SAMPLES.get(key)
    if cached is not None and not cached[1].is_file():  # removed since (an interrupted command drains scratch)
        del _SAMPLES[key]
    if key not in _SAMPLES:
        text = _docs()
        code, counted = _code_until(tokenizer, text, tokens)
        if counted < tokens:
            logger.warning(
                "the bundled text sample (CPython's documentation and standard library) gives %d tokens, "
                "%d wanted for the model's widest GEMM input: pass --calib DATA with more text",
                counted,
                tokens,
            )
        folder = make_dir("fp8onnx-sample-")  # for the process's life: drained when it exits
        path = pathlib.Path(folder) / "python-docs.txt"
        path.write_text(text + code + "\n", encoding="utf-8")
        label = SAMPLE_LABEL.format(code=", and standard library code", kb=round(len(text + code) / 1000))
        _SAMPLES[key] = (folder, path, label)
    _, path, label = _SAMPLES[key]
    return TextSource(path, tokenizer, label=label)


def _docs() -> str:
    """About SAMPLE_BYTES of the even-indexed documentation topics, cut at a paragraph."""
    import pydoc_data.topics as topics

    docs, size = [], 0
    for name in sorted(topics.topics)[::2]:
        docs.append(topics.topics[name].strip())
        size += len(docs[-1]) + 2
        if size >= SAMPLE_BYTES:
            break
    # whole topics overshoot (a long last one took 136 kB to 184 kB): cut at a paragraph near the size
    text = "\n\n".join(docs)[:SAMPLE_BYTES]
    return text[: text.rfind("\n\n")] if "\n\n" in text else text


def _code_until(tokenizer: str | os.PathLike, docs: str, tokens: int) -> tuple[str, int]:
    """(standard-library modules to add to ``docs``, the tokens both give): whole top-level modules, in name
    order, until ``tokenizer`` counts as many tokens of code as of documentation and ``tokens`` in all (at
    most CODE_BYTES)."""
    encode = load_tokenizer(tokenizer).encode
    prose = counted = len(encode(docs).ids)
    parts: list[str] = []
    size = 0
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for module in sorted(lib.glob("*.py")):  # no tests, no vendored packages
        if (counted >= tokens and counted >= 2 * prose) or size >= CODE_BYTES:
            break
        source = module.read_text(encoding="utf-8", errors="replace").strip("\n")
        parts.append("\n\n" + source)
        size += len(source)
        counted += len(encode(source).ids)
    return "".join(parts), counted


def default_text_sample(model: str | os.PathLike, tokens: int = 0) -> TextSource | None:
    """The sample (at least ``tokens`` tokens where it can) for a model whose tokenizer.json sits beside it
    (an export folder), or None (a model without token inputs or without a tokenizer: give --calib)."""

    tokenizer = model_file(model).parent / "tokenizer.json"
    return python_text_sample(tokenizer, tokens) if tokenizer.is_file() else None
