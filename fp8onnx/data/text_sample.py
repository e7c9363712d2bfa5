"""The text a token model calibrates on when the user gives no data: about 136 kB of CPython's own
documentation (``pydoc_data.topics``, shipped with Python), tokenized by the model's tokenizer."""

from __future__ import annotations

import os
import pathlib

from fp8onnx.base.scratch import make_dir
from fp8onnx.data.feeds import TextSource
from fp8onnx.graph.model_io import model_file

__all__ = ["default_text_sample", "python_text_sample"]

# GPTQ wants 16 rows of X a channel (fp8onnx.techniques.gptq.MIN_ROWS_PER_CHANNEL): SmolLM2-135M's widest
# input has 1,536 channels, 24.6k tokens; its tokenizer reads these 136 kB as 33,505 tokens (the 48 kB of
# before gave 12,498: GPTQ then fitted the sample more than new text).
SAMPLE_BYTES = 136_000


SAMPLE_LABEL = (
    "a text sample of CPython's documentation (pydoc_data, shipped with Python, {kb} kB); "
    "domain data calibrates better: --calib"
)


_SAMPLE: list = []  # the process's sample file, written once (its folder goes at exit)


def python_text_sample(tokenizer: str | os.PathLike) -> TextSource:
    """Text to calibrate a token model on when no data is given: the even-indexed topics of CPython's
    bundled documentation (``pydoc_data.topics``), about ``SAMPLE_BYTES``, for ``tokenizer``."""
    if _SAMPLE and not _SAMPLE[1].is_file():  # removed since (an interrupted command drains scratch paths)
        _SAMPLE.clear()
    if not _SAMPLE:
        import pydoc_data.topics as topics

        docs, size = [], 0
        for name in sorted(topics.topics)[::2]:
            docs.append(topics.topics[name].strip())
            size += len(docs[-1]) + 2
            if size >= SAMPLE_BYTES:
                break
        # whole topics overshoot (a long last one took 136 kB to 184 kB): cut at a paragraph near the size
        text = "\n\n".join(docs)[:SAMPLE_BYTES]
        text = text[: text.rfind("\n\n")] if "\n\n" in text else text
        folder = make_dir("fp8onnx-sample-")  # for the process's life: drained when it exits
        path = pathlib.Path(folder) / "python-docs.txt"
        path.write_text(text + "\n", encoding="utf-8")
        _SAMPLE.extend([folder, path, len(text)])
    _, path, size = _SAMPLE
    return TextSource(path, tokenizer, label=SAMPLE_LABEL.format(kb=round(size / 1000)))


def default_text_sample(model: str | os.PathLike) -> TextSource | None:
    """The Python-docs sample for a model whose tokenizer.json sits beside it (an export folder), or
    None (a model without token inputs or without a tokenizer: give --calib)."""

    tokenizer = model_file(model).parent / "tokenizer.json"
    return python_text_sample(tokenizer) if tokenizer.is_file() else None
