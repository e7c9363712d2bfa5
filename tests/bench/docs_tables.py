"""The docs' measured tables, rendered from their result files, and the check that they still are.

A table in a Markdown file is marked by a comment on the line right above it, naming the result file (a
``yardstick_table.py --json`` file: ``{"meta": ..., "records": [...]}``, path from the repository's root) and,
optionally, which of its figures to show::

    <!-- table: docs/results/smollm2_lambada300_grid.json sets=lambada recipes=FP16,defaults.onnx gaps -->
    | model | lambada (300) acc. vs FP16 | lambada ppl |
    |---|---|---|
    ...

A marker may instead name one or more ``tests/bench/floor.py --json`` files (comma-separated, no spaces:
``<!-- table: docs/results/cost_a.json,docs/results/cost_b.json -->``): their rows, in that order, render the
cost table (each model's quantize time and peak memory against the floor measured in the same run).

``sets=`` and ``recipes=`` (comma-separated, in the order shown; quoted where a name has spaces:
``recipes="FP32 (reference),FP16"``) cut the records; a recipe may be renamed for
the table as ``file=shown`` (``llm-w8a8.onnx=llm-w8a8``); ``gaps`` renders the table of every model's
difference from the torch anchor instead of the main one. The table is the lines from the one after the
comment to the first that does not start with ``|``. What stands there must be what the records render
(:func:`yardstick_table.markdown` / :func:`yardstick_table.anchor_gaps`): a figure typed by hand, or a result
file re-measured without its table re-rendered, is a difference.

Prose figures are held to the same files: :func:`unbacked` lists the figures of a text (percentages with
two decimals, ``±`` standard errors) that no record of the result files the text links renders.

Usage: python tests/bench/docs_tables.py [--write] [FILE.md ...]
       (default: README.md and docs/*.md; without --write: exit 1 and name each table that differs)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import sys

from yardstick_table import _pct, anchor_gaps, markdown

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARK = re.compile(r"^<!-- table: (?P<path>\S+)(?P<options>.*?) -->$")
LINK = re.compile(r"docs/results/[\w.-]+\.json")
FIGURE = re.compile(r"[+-]?\d+\.\d\d%")


class TableError(ValueError):
    """A marker that names no result file, or options the file cannot satisfy."""


def records(path: pathlib.Path) -> list[dict]:
    data = _load(path)
    if not isinstance(data.get("records"), list):
        raise TableError(f"result file {path} has no 'records' list (yardstick_table.py --json writes one)")
    return data["records"]


def _load(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TableError(f"result file {path} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise TableError(f"result file {path} holds no JSON object")
    return data


def cost_table(docs: list[tuple[str, dict]]) -> str:
    """The cost table of ``floor.py --json`` documents ``(path, document)``: per model and run, the FP32 file,
    the quantize options, the floor's and quantize's wall time and peak RSS (the median run's), and the ratios
    floor.py computed."""
    lines = [
        "| model | FP32 file | quantize options | floor: time, peak RSS | quantize: time, peak RSS | time vs floor "
        "| peak vs floor | peak vs file | date |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path, doc in docs:
        if not isinstance(doc.get("results"), list):
            raise TableError(f"result file {path} has no 'results' list (tests/bench/floor.py --json writes one)")
        for r in doc["results"]:
            floor, q = r["floor"], r["quantize"]
            lines.append(
                f"| {r['model']} | {r['fp32_mib']:,.0f} MiB | {' '.join(r.get('options') or []) or 'defaults'} "
                f"| {floor['wall_s']:,.0f} s, {floor['peak_rss_mib']:,.0f} MiB "
                f"| {q['wall_s']:,.0f} s, {q['peak_rss_mib']:,.0f} MiB | {r['time_ratio']:.2f}x "
                f"| {r['rss_ratio']:.2f}x | {r['rss_over_model']:.2f}x | {doc.get('date', '-')} |"
            )
    return "\n".join(lines)


def render(result: str, options: str) -> str:
    """The table a marker's result file (or files, comma-separated) and options render."""
    paths = [ROOT / part for part in result.split(",")]
    docs = [(p, _load(p)) for p in paths]
    if all("results" in doc for _, doc in docs):
        return cost_table(docs)
    if len(paths) > 1:
        raise TableError(f"{result}: several result files make a cost table (tests/bench/floor.py --json) only")
    path = paths[0]
    recs = records(path)
    opts = dict(o.partition("=")[::2] for o in shlex.split(options))
    sets = opts["sets"].split(",") if opts.get("sets") else list(dict.fromkeys(r["set"] for r in recs))
    missing = [s for s in sets if not any(r["set"] == s for r in recs)]
    if missing:
        raise TableError(f"result file {path} has no set {missing[0]!r}")
    recs = [r for r in recs if r["set"] in sets]
    if opts.get("recipes"):
        shown = dict((item.split("=", 1) * 2)[:2] for item in opts["recipes"].split(","))
        absent = [name for name in shown if not any(r["recipe"] == name for r in recs)]
        if absent:
            raise TableError(f"result file {path} has no recipe {absent[0]!r}")
        recs = [dict(r, recipe=shown[r["recipe"]]) for name in shown for r in recs if r["recipe"] == name]
    return anchor_gaps(recs, sets) if "gaps" in opts else markdown(recs, sets)


def tables(text: str) -> list[tuple[int, int, str, str]]:
    """(first line, end line, result file, options) of each marked table in ``text``'s lines."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARK.match(line.strip())
        if m is None:
            continue
        end = i + 1
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        out.append((i + 1, end, m["path"], m["options"]))
    return out


def check(path: pathlib.Path, write: bool = False) -> list[str]:
    """The marked tables of ``path`` that differ from their renders (one sentence each); with ``write`` the
    file is rewritten with the renders instead (atomically)."""
    text = path.read_text()
    lines = text.split("\n")
    problems = []
    for start, end, result, options in reversed(tables(text)):
        try:
            rendered = render(result, options).split("\n")
        except TableError as exc:
            problems.append(f"{path}:{start}: {exc}")
            continue
        if lines[start:end] != rendered:
            problems.append(f"{path}:{_difference(lines[start:end], rendered, start, result)}")
            lines[start:end] = rendered
    if write and problems:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("\n".join(lines))
        tmp.replace(path)
    return problems


def rendered_figures(path: pathlib.Path) -> set[str]:
    """Every figure the records of ``path`` render: ratios, perplexity changes, their errors, gaps (a cost
    table's file renders no percentage)."""
    out: set[str] = set()
    if "results" in _load(path):
        return out
    for r in records(path):
        for key in ("ratio_to_fp16", "ppl_change", "vs_anchor", "ppl_vs_anchor"):
            if r.get(key) is None:
                continue
            se = r.get(f"{key.removesuffix('_to_fp16')}_se")
            for sign in (False, True):
                out.add(_pct(r[key], sign=sign))
                if se is not None:
                    out.add(_pct(se))
        out.add(_pct(r["accuracy"]))
    return out


def prose(text: str) -> str:
    """``text`` without what quotes rather than states: indented blocks (a command's output shown as an
    example) and inline code (an option's value, a program's own line)."""
    lines = [line for line in text.split("\n") if not line.startswith("    ")]
    return re.sub(r"`[^`]*`", "", "\n".join(lines))


def unbacked(text: str) -> list[str]:
    """The figures the prose of ``text`` states (``12.34%``) that no record of the result files it links
    (``docs/results/X.json``, a table's marker included) renders."""
    text = prose(text)
    backed: set[str] = set()
    for link in sorted(set(LINK.findall(text))):
        backed |= rendered_figures(ROOT / link)
    return [f for f in FIGURE.findall(text) if f not in backed and f.lstrip("+") not in backed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=pathlib.Path)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    files = args.files or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for f in files for p in check(f, args.write)]
    for p in problems:
        print(p)
    if problems and not args.write:
        sys.exit(1)


def _difference(have: list[str], want: list[str], start: int, result: str) -> str:
    """Where a table first differs from its render: ``LINE: reads 'cell' where RESULT renders 'cell'`` (the first
    cells that differ), or that its length does."""
    for i, (a, b) in enumerate(zip(have, want)):
        if a != b:
            cells = [(x, y) for x, y in zip(a.split("|"), b.split("|")) if x != y] or [(a, b)]
            return f"{start + i + 1}: reads {cells[0][0].strip()!r} where {result} renders {cells[0][1].strip()!r}"
    return f"{start + 1}: the table has {len(have)} lines where {result} renders {len(want)}"


if __name__ == "__main__":
    main()
