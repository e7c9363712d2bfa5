"""Keyword arguments of the Python API taken, in one place, into the settings objects they belong to.

An entry point such as :func:`fp8onnx.compare` takes its settings as typed frozen objects (``measure=``,
``run=``) and, for convenience, their fields as keywords (``generate=0, provider="cpu"``): :func:`take` moves
the keywords that are one object's fields into it, and what is left goes to the next object; a keyword that is
no object's field is a ``TypeError`` naming it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["refuse_unknown", "take"]

T = TypeVar("T", bound="DataclassInstance")


def take(cls: type[T], given: T | None, options: dict[str, Any]) -> T:
    """``given`` (or ``cls()``) with the ``options`` that are ``cls``'s fields in place of its own; those are
    removed from ``options``, which keeps the rest."""
    names = {f.name for f in dataclasses.fields(cls)}
    mine = {k: options.pop(k) for k in list(options) if k in names}
    base = given if given is not None else cls()
    return dataclasses.replace(base, **mine) if mine else base


def refuse_unknown(function: str, options: dict[str, Any], *classes: type[DataclassInstance]) -> None:
    """A ``TypeError`` naming the first of ``options`` that none of ``classes`` has as a field."""
    known = [f.name for cls in classes for f in dataclasses.fields(cls)]
    unknown = [k for k in options if k not in known]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}; it takes {', '.join(known)}")
