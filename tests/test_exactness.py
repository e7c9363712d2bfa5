"""A lint of the suite itself (SPEC §11): no test compares two float results of onnxruntime, the BLAS
or onnx.reference for exact equality, unless it says why that holds on every CPU.

Two runs of different graphs (or of one graph at two optimisation levels, batch sizes or executors)
may sum in other orders and differ in the last bits across CPUs (AVX2 vs AVX-512, Intel vs AMD) and
thread counts; a fresh clone on an AVX-512 AMD EPYC failed four such tests that passed where they were
written. Such pairs go through ``helpers.assert_same_sums`` (or a stated tolerance). A comparison that
is exact by construction (one graph, one feed, one session's options; integer outputs; element-wise
ops only) carries a comment ``# exact: <why>`` on its line or the line above.

The check reads each test function's AST: a value is *computed* if it comes from a call of
``run_ort``, ``run_reference``, ``value_of``, ``.run(...)``, ``calibrate`` or a name assigned from
one; ``np.array_equal``, ``np.testing.assert_array_equal`` and ``==`` inside ``assert`` with computed
values on both sides are flagged."""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
SOURCES = {"run_ort", "run_reference", "value_of", "run", "calibrate", "_run", "session_run"}
EQUALS = {"array_equal", "assert_array_equal"}


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


# What is compared is not a float result: a count, shape, name, type or key set.
META_ATTRS = {"shape", "dtype", "size", "ndim", "name", "op_type", "num_batches", "num_samples", "batching", "executor"}
META_CALLS = {"len", "sorted", "set", "list", "tuple", "str", "int", "type", "keys", "isinstance", "frozenset"}


def _metadata(expr: ast.AST) -> bool:
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.Attribute):
        return expr.attr in META_ATTRS
    return _called(expr) in META_CALLS


def _reasoned(lines: list[str], first: int, last: int) -> bool:
    """An ``# exact:`` comment on the statement's lines or in the comment lines right above it."""
    if any("# exact:" in line for line in lines[first - 1 : last]):
        return True
    i = first - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        if "# exact:" in lines[i]:
            return True
        i -= 1
    return False


def _conjuncts(test: ast.AST):
    """The parts an assert requires each to hold: ``a and b`` splits; ``not x`` asserts no equality."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for v in test.values:
            yield from _conjuncts(v)
    else:
        yield test


def _equality(expr: ast.AST):
    """(node, a, b) for an exact equality that ``expr`` asserts (``all(...)`` over a generator too)."""
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], ast.Eq):
        yield expr, expr.left, expr.comparators[0]
    elif _called(expr) in EQUALS and len(expr.args) >= 2:
        yield expr, expr.args[0], expr.args[1]
    elif _called(expr) == "all" and expr.args and isinstance(expr.args[0], ast.GeneratorExp):
        yield from _equality(expr.args[0].elt)


class _Taint(ast.NodeVisitor):
    """Names bound (in one function) to values computed by a runtime, transitively."""

    def __init__(self):
        self.names: set[str] = set()

    def computed(self, expr: ast.AST) -> bool:
        for sub in ast.walk(expr):
            if _called(sub) in SOURCES:
                return True
            if isinstance(sub, ast.Name) and sub.id in self.names:
                return True
        return False

    def _bind(self, target: ast.AST) -> None:
        if isinstance(target, ast.Name):
            self.names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._bind(t)
        elif isinstance(target, ast.Starred):
            self._bind(target.value)
        elif isinstance(target, (ast.Subscript, ast.Attribute)):
            self._bind(target.value)  # outs[target] = run_ort(...): outs, not target

    def visit_Assign(self, node):
        if self.computed(node.value):
            for t in node.targets:
                self._bind(t)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if self.computed(node.value):
            self._bind(node.target)

    def visit_For(self, node):
        if self.computed(node.iter):
            self._bind(node.target)
        self.generic_visit(node)

    def visit_comprehension(self, node):
        if self.computed(node.iter):
            self._bind(node.target)
        self.generic_visit(node)


def flagged(source: str) -> list[tuple[int, str]]:
    """(line, text) of each exact comparison of two computed values without an ``# exact:`` reason
    (on its lines or in the comment lines right above)."""
    lines = source.splitlines()
    tree = ast.parse(source)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        taint = _Taint()
        for _ in range(3):  # names bound from names bound later in the text (loops) settle in a few passes
            taint.visit(fn)
        pairs = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Assert):
                for part in _conjuncts(node.test):
                    pairs.extend(_equality(part))
            elif isinstance(node, ast.Expr) and _called(node.value) == "assert_array_equal":
                pairs.extend(_equality(node.value))
        for node, a, b in pairs:
            if not (taint.computed(a) and taint.computed(b)):
                continue
            if _metadata(a) or _metadata(b):
                continue  # counts, shapes, names, types: not float results
            if _called(a) == "approx" or _called(b) == "approx":
                continue  # a stated tolerance
            if _reasoned(lines, node.lineno, node.end_lineno):
                continue
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


@pytest.mark.parametrize("path", sorted(TESTS.rglob("test_*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_exact_comparison_of_two_computed_float_results(path):
    found = flagged(path.read_text())
    assert not found, "\n".join(
        f"{path.relative_to(TESTS)}:{line}: {text} (use helpers.assert_same_sums, or say '# exact: <why>')"
        for line, text in found
    )


def test_the_lint_flags_what_it_must_and_takes_a_reason():
    bad = (
        "def test_a(tmp_path):\n"
        "    outs = {}\n"
        "    for t in 'ab':\n"
        "        outs[t] = run_ort(t, feed)[0]\n"
        "    np.testing.assert_array_equal(outs['a'], outs['b'])\n"
        "    x, y = run_ort(p, f)[0], run_reference(p, f)[0]\n"
        "    assert np.array_equal(x, y)\n"
        "    assert session.run(None, f)[0].max() == run_ort(q, f)[0].max()\n"
    )
    assert [line for line, _ in flagged(bad)] == [5, 7, 8]
    fine = (
        "def test_b():\n"
        "    got = run_ort(p, f)[0]\n"
        "    want = reference(x)\n"
        "    np.testing.assert_array_equal(got, want)\n"  # one side computed by NumPy code of the test
        "    # exact: one graph, one feed, one session's options\n"
        "    np.testing.assert_array_equal(got, run_ort(p, f)[0])\n"
        "    assert got.shape == run_ort(q, f)[0].shape\n"
    )
    assert flagged(fine) == []
