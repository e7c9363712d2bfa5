"""The docs' measured tables and the README's figures are what their result files render
(``tests/bench/docs_tables.py``): a figure typed by hand, or a result file re-measured without its table
re-rendered, fails here."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "bench"))

import docs_tables  # noqa: E402

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_marked_table_is_its_render():
    marked = sum(len(docs_tables.tables(p.read_text())) for p in DOCS)
    assert marked >= 8  # the result-file tables of docs/benchmarks.md: the check is not vacuous
    assert [problem for p in DOCS for problem in docs_tables.check(p)] == []


def test_an_altered_figure_fails_and_write_restores_it(tmp_path):
    text = (REPO / "docs" / "benchmarks.md").read_text()
    start, end, result, _ = docs_tables.tables(text)[0]
    line = next(row for row in text.split("\n")[start:end] if "±" in row)  # a model's row
    figure = docs_tables.FIGURE.findall(line)[0]  # 12.34%
    altered = f"{figure[:-2]}{(int(figure[-2]) + 1) % 10}%"  # its last digit changed
    copy = tmp_path / "benchmarks.md"
    copy.write_text(text.replace(line, line.replace(figure, altered, 1), 1))
    problems = docs_tables.check(copy)
    assert len(problems) == 1 and result in problems[0] and altered in problems[0]
    docs_tables.check(copy, write=True)
    assert copy.read_text() == text


def test_readme_figures_come_from_its_result_files():
    text = (REPO / "README.md").read_text()
    assert docs_tables.LINK.findall(text)  # it links the files its figures come from
    assert docs_tables.unbacked(text) == []
    invented = text.replace("98.90% ±0.59%", "98.93% ±0.59%")
    assert docs_tables.unbacked(invented) == ["98.93%"]


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))])
def test_every_page_states_only_figures_its_result_files_render(page):
    """README and docs/*.md (docs/history/ holds what was typed by hand, dated): a percentage stated in prose
    is one that a result file the page links renders; an example of output (an indented block) or a
    program's own line (inline code) is quoted, not stated.

    requires: the page. ensures: no stated figure without its result file."""
    path = REPO / page if page == "README.md" else REPO / "docs" / page
    assert docs_tables.unbacked(path.read_text()) == []


def test_a_marker_that_names_no_result_file_is_one_sentence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- table: docs/results/no_such.json -->\n| a |\n")
    (problem,) = docs_tables.check(page)
    assert "no_such.json cannot be read" in problem
    page.write_text("<!-- table: docs/results/smollm2_lambada300_grid.json sets=hellaswag -->\n| a |\n")
    (problem,) = docs_tables.check(page)
    assert "has no set 'hellaswag'" in problem


def test_a_cost_table_renders_floor_runs_in_order_and_fails_on_an_altered_figure(tmp_path):
    """requires: ``tests/bench/floor.py --json`` documents. ensures: their rows, file by file, in one table; a
    figure typed differently is a difference naming the files."""

    def run(model, wall, rss, fp32):
        floor = {"wall_s": 10.0, "peak_rss_mib": 1000.0, "runs_wall_s": [10.0]}
        quantize = {"wall_s": wall, "peak_rss_mib": rss, "phases": ""}
        return {
            "model": model,
            "options": [],
            "fp32_mib": fp32,
            "floor": floor,
            "quantize": quantize,
            "time_ratio": wall / 10.0,
            "rss_ratio": rss / 1000.0,
            "rss_over_model": rss / fp32,
        }

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"machine": "m", "date": "2026-12-07", "results": [run("small", 12.0, 500.0, 600.0)]}))
    b.write_text(json.dumps({"machine": "m", "results": [run("large", 25.0, 2000.0, 6000.0)]}))
    table = docs_tables.render(f"{a},{b}", "")
    rows = table.split("\n")[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["small", "large"]
    assert "| 1.20x | 0.50x | 0.83x | 2026-12-07 |" in rows[0] and "| 2.50x | 2.00x | 0.33x | - |" in rows[1]
    page = tmp_path / "page.md"
    page.write_text(f"<!-- table: {a},{b} -->\n{table}\n")
    assert docs_tables.check(page) == []
    page.write_text(f"<!-- table: {a},{b} -->\n{table.replace('2.50x', '2.40x')}\n")
    (problem,) = docs_tables.check(page)
    assert "reads '2.40x' where" in problem and str(b) in problem
    with pytest.raises(docs_tables.TableError, match="several result files make a cost table"):
        docs_tables.render(f"{a},docs/results/qwen_full.json", "")
