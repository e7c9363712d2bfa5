"""The package's layout: its imports point one way (no module of fp8onnx imports, at the top or
inside a function, a module that imports it back, directly or through others), and graphs are edited
only in passes/."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fp8onnx"
PASSES = ROOT.parent / "passes"  # installed as fp8onnx.passes
BOOT = ROOT.parent / "fp8onnx_boot.py"  # the console script's first step, a module of its own beside the package


def _modules() -> dict[str, pathlib.Path]:
    """Dotted names below fp8onnx ("quantizer", "cli.common", "passes.insert_qdq"; a package by its
    name) -> file."""
    found = {}
    for top, prefix in ((ROOT, ()), (PASSES, ("passes",))):
        for path in top.rglob("*.py"):
            parts = (*prefix, *path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and "models" not in parts:
                found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The fp8onnx modules ``name`` imports (relative at any level, or ``fp8onnx.x``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.startswith("fp8onnx."):
                stem = node.module.split(".")[1:]
            elif node.module == BOOT.stem:
                stem = [BOOT.stem]
            else:
                continue
            targets = [".".join([*stem, a.name]) for a in node.names] + [".".join(stem)]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("fp8onnx.")]
            targets += [a.name for a in node.names if a.name == BOOT.stem]
        for target in targets:
            while target and target not in modules:  # fp8onnx.x.name -> the module x
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_circle():
    modules = {**_modules(), BOOT.stem: BOOT}  # fp8onnx_boot imports the CLI: the CLI never imports it back
    graph = {name: sorted(_imports(name, path, modules)) for name, path in modules.items()}
    # a package's __init__ that only gathers its own modules is not a floor of its own
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name):
        state[name] = 1
        stack.append(name)
        for dep in graph[name]:
            if dep.startswith(name + "."):  # a package importing its own modules
                continue
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
    assert len(graph) > 30 and "workflows.fallback" in graph["cli.quantize"]  # the scan sees the package
    assert "passes.common" in graph["passes.instrument"]  # and passes/, relative imports included
    assert "cli" in graph[BOOT.stem]  # and the console script's first step


# docs/development.md's floors, bottom first: a module imports only from its own floor or lower ones.
LAYERS = (
    "base",  # errors, scratch folders, timings, progress, the version: no fp8onnx import
    "numerics",  # float8 formats, scaling, the CUDA kernels' reference numerics
    "passes",  # the graph rewrites (fp8onnx.passes)
    "settings",  # what a run is asked (QuantizeConfig, presets, targets) and what it reports
    "graph",  # the model: files, preparation, plans, placement, onnxruntime sessions
    "data",  # calibration and evaluation data
    "pipeline",  # running data through a model for statistics
    "techniques",  # scales, GPTQ, smoothing, bias correction, the family's recipe
    "accuracy",  # metrics, evaluation, sensitivity, compare, generation, plots
    "workflows",  # quantize, quantize_folder, calibrate, inspect, the accuracy-target search
    "experiments",  # study, zoo, FP8 training
    "cli",  # the command line
)


def test_modules_sit_on_named_floors():
    """The root is the library's face (``__init__`` alone); every other module sits on a floor of
    LAYERS and imports nothing from a floor above its own."""
    modules = _modules()
    floors = {name: name.split(".")[0] for name in modules if name}
    loose = sorted(name for name, floor in floors.items() if floor not in LAYERS)
    assert loose == [], f"modules outside a named floor (docs/development.md): {loose}"
    upward = sorted(
        f"{name} -> {dep}"
        for name, path in modules.items()
        if name
        for dep in _imports(name, path, modules)
        if dep and LAYERS.index(floors[dep]) > LAYERS.index(floors[name])
    )
    assert upward == [], "imports from a higher floor: " + ", ".join(upward)
    assert {p.name for p in ROOT.glob("*.py")} == {"__init__.py"}


def test_graph_nodes_are_built_only_in_passes():
    """docs/development.md's rule: a module outside passes/ asks a pass (or passes.instrument) for the
    nodes it needs; it never builds one. Inside passes/ onnx_ir's Tape is the one builder (no
    ir.node/ir.Node or onnx.helper.make_node: a node is recorded on a tape and inserted from it)."""
    anywhere = re.compile(r"\bir\.(node|Node)\(|\bmake_node\(")
    outside = re.compile(r"\bTape\(|\bop_multi_out\(")
    offenders = {
        name: [
            n
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if anywhere.search(line) or (not name.startswith("passes") and outside.search(line))
        ]
        for name, path in _modules().items()
    }
    assert {name: lines for name, lines in offenders.items() if lines} == {}
    tapes = sum(path.read_text().count("Tape()") for name, path in _modules().items() if name.startswith("passes"))
    assert tapes > 10  # the scan reads passes/


def test_no_module_over_400_lines():
    """Modules stay small, one noun each: a module that outgrows 400 lines is split by what its parts do."""
    files = list(_modules().values())  # fp8onnx.passes too
    sizes = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in files}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_every_subpackage_is_in_the_wheel():
    """pyproject lists its packages one by one: a subpackage missing there works in an editable
    install (CI's) and is absent from a wheel."""
    import tomllib

    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {"fp8onnx." + ".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.rglob("__init__.py")}
    found = {name.rstrip(".") for name in found}
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
