"""The one exception type for bad input; the CLI turns it into a sentence and exit code 2."""

from __future__ import annotations

__all__ = ["Fp8OnnxError", "printable"]


class Fp8OnnxError(ValueError):
    """Bad usage or bad input: the message is one sentence that names the file, tensor or node."""


def printable(text: object) -> str:
    """``text`` with control and non-printable characters escaped: corrupt files put raw bytes into
    the messages of the libraries that read them, and a message is one printable line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
