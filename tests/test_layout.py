"""The package's imports point one way: no module of fp8onnx imports (at the top or inside a
function) a module that imports it back, directly or through others."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fp8onnx"


def _imports(path: pathlib.Path) -> set[str]:
    """The fp8onnx modules ``path`` imports (``from .x import``, ``from . import x``, ``fp8onnx.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("fp8onnx."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("fp8onnx."))
    return found


def test_no_import_circle():
    modules = {p.stem: p for p in ROOT.glob("*.py") if p.stem != "__init__"}
    graph = {name: sorted(m for m in _imports(path) if m in modules and m != name) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name):
        state[name] = 1
        stack.append(name)
        for dep in graph[name]:
            if state.get(dep) == 1:
                circle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(graph) > 30 and graph["quantize"]  # the scan sees the package
