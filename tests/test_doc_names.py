"""The docs and the scripts beside the tests name fp8onnx's modules and functions as they are: every
``from fp8onnx... import`` in README.md and docs/*.md imports, every dotted ``fp8onnx.x.y`` they quote
resolves, and every fp8onnx name the benchmark scripts and model builders import exists (a module moved
to another floor, a function renamed, and the docs would send users to a name that is not there, or a
benchmark would stop at its first line: tests/bench/ray_estimate.py did)."""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ("json", "onnx", "npz", "data")  # fp8onnx.json: the manifest a folder gets, not a module


def _resolves(dotted: str) -> bool:
    """``dotted`` names a module of fp8onnx or an attribute of one. A module that needs an optional
    dependency not installed here (torch, without the [wild] extra) cannot be checked and counts as found."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("fp8onnx"):
                return True  # the optional dependency is missing here; CI (with it) checks the name
            continue
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                found = getattr(found, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_the_names_the_docs_give_exist(doc):
    text = (ROOT / doc if doc == "README.md" else ROOT / "docs" / doc).read_text()
    named = {
        f"{m[1]}.{n.strip()}"
        for m in re.finditer(r"from (fp8onnx[\w.]*) import ([\w, ]+)", text)
        for n in m[2].split(",")
    }
    named |= {m[1] for m in re.finditer(r"`(fp8onnx(?:\.\w+)+)", text) if m[1].rsplit(".", 1)[1] not in FILES}
    assert sorted(n for n in named if not n.endswith(".") and not _resolves(n)) == []


@pytest.mark.parametrize("folder", ["tests/bench", "models"])
def test_the_scripts_import_names_that_exist(folder):
    missing = []
    for script in sorted((ROOT / folder).glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp8onnx"):
                missing += [
                    f"{script.name}: {node.module}.{a.name}"
                    for a in node.names
                    if not _resolves(f"{node.module}.{a.name}")
                ]
    assert missing == []
