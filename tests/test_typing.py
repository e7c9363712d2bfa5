"""The public API's hints reach users' type checkers: the wheel ships py.typed, mypy accepts the calls a
user writes (tests/typing/public_api.py) and refuses wrong ones (tests/typing/wrong_calls.py). The floors
in CHECKED_FLOORS type-check their own bodies too: the library's, a floor at a time."""

import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent / "typing"
# the library's own bodies mypy accepts (the rest: not yet)
CHECKED_FLOORS = (
    "base",
    "numerics",
    "settings",
    "graph",
    "data",
    "pipeline",
    "accuracy",
    "workflows",
    "experiments",
    "cli",
    "techniques",
)
ROOT = HERE.parents[1]
LIBRARY = ("fp8onnx", "passes")  # where the library's own modules sit (passes/: fp8onnx.passes)


@pytest.fixture(scope="module")
def mypy_errors() -> dict[str, set[str]]:
    """mypy over both files and the checked floors in one run: per file name, the lines it reports an
    error on. The other floors' bodies are not checked here (silent): only what a user's code sees."""
    pytest.importorskip("mypy")
    args = ["--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary", "--no-incremental"]
    files = [str(HERE / "public_api.py"), str(HERE / "wrong_calls.py"), *(f"fp8onnx/{f}" for f in CHECKED_FLOORS)]
    files.append("fp8onnx_boot.py")  # the console script's first step, beside the package
    files.append("passes")  # fp8onnx.passes, installed from the top-level passes/
    result = subprocess.run(
        [sys.executable, "-m", "mypy", *args, *files], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert "error: " in result.stdout or result.returncode == 0, result.stdout + result.stderr
    errors: dict[str, set[str]] = {"public_api.py": set(), "wrong_calls.py": set()}
    for line in result.stdout.splitlines():
        if ": error:" in line:
            path, lineno = line.split(":")[:2]
            key = path if path.startswith(LIBRARY) else pathlib.Path(path).name
            errors.setdefault(key, set()).add(lineno)
    errors["output"] = {result.stdout}
    return errors


def test_the_wheel_ships_py_typed():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["fp8onnx"]
    assert (ROOT / "fp8onnx" / "py.typed").exists()


def test_a_users_calls_type_check(mypy_errors):
    assert mypy_errors["public_api.py"] == set(), mypy_errors["output"]


def test_wrong_calls_are_refused(mypy_errors):
    assert mypy_errors["wrong_calls.py"] == {"7", "8", "9", "10", "11"}, mypy_errors["output"]


def test_the_checked_floors_type_check(mypy_errors):
    found = {path: lines for path, lines in mypy_errors.items() if path.startswith(LIBRARY)}
    assert found == {}, mypy_errors["output"]


def test_every_floor_is_checked():
    """No floor left out of the mypy run: a new floor is typed from the start."""
    from test_layout import LAYERS

    assert {*CHECKED_FLOORS, "passes"} == set(LAYERS)
