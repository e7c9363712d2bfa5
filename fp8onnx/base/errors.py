"""The one exception type for bad input; the CLI turns it into a sentence and exit code 2."""

from __future__ import annotations

__all__ = ["Fp8OnnxError", "first_line", "printable"]


class Fp8OnnxError(ValueError):
    """Bad usage or bad input: the message is one sentence that names the file, tensor or node."""


def printable(text: object) -> str:
    """``text`` with control and non-printable characters escaped: corrupt files put raw bytes into
    the messages of the libraries that read them, and a message is one printable line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text, printable; its type name when it has no text
    (third-party errors carry multi-line messages, sometimes none)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return printable(lines[0].strip()) if lines else type(exc).__name__
