"""The one exception type for bad input; the CLI turns it into a sentence and exit code 2."""

from __future__ import annotations

__all__ = ["Fp8OnnxError"]


class Fp8OnnxError(ValueError):
    """Bad usage or bad input: the message is one sentence that names the file, tensor or node."""
