"""The yardstick table: fp8onnx's models (``llm_yardstick.py --columns``) beside the torch FP8-dynamic anchor
(``fp8_anchor.py``), each against FP16 on the same items with its paired standard error, as data and as a
Markdown table.

Per set and model: the headline (next-token accuracy on text, task accuracy on LAMBADA and HellaSwag) as a
ratio to FP16's, its perplexity change against FP16's (text windows; LAMBADA: the target's per-item
perplexity), and, for every row against the anchor, the difference of the two ratios (``- anchor``) with
its standard error, paired over the three models' samples. The anchor's torch FP32 row is checked against
compare's FP32 reference row (the harness: same items, same scoring) and printed.

A file of the anchor's alone (``fp8_anchor.py``'s, for a diagnosis) is put against its own torch FP32 rows.

Several ``llm_yardstick.py --columns`` files of one model join into one table when their FP32 reference rows
are the same (the same items, scored the same): each later file adds the rows the first lacks. A file of a later
part (``--start N``: the task files from item N on) extends the rows it holds end to end instead: each must be
there already and end at item N. Rows of one set left at different lengths are cut to the shortest, and the
table says so.

``--base ROW`` puts every row against ROW instead of FP16 (its ratio and perplexity change, paired over the same
samples): two recipes compared directly (``--base llm-w8a8.onnx``), their difference's noise smaller than the
two differences from FP16 suggest.

Usage: python tests/bench/yardstick_table.py ONNX_COLUMNS.npz|ANCHOR.npz [MORE_COLUMNS.npz ...]
       [--anchor ANCHOR.npz ...] [--base ROW]
       [--model-name smollm2] [--json results.json]
Writes ``--json``: a list of records (model, recipe, set, metric, value, se, units, machine, date,
onnxruntime, torch), one per figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from fp8onnx.accuracy.metrics import STATISTICS, difference_se, gain_se

COLUMNS = ("correct", "labelled", "nll")
REFERENCE = "FP32 (reference)"


def load(path: pathlib.Path, prefix: str = "") -> tuple[dict, dict]:
    """{set: {row: {column: array}}} and the file's meta."""
    data = np.load(path)
    meta = json.loads(str(data["meta"]))
    rows: dict = {}
    for key in data.files:
        if key == "meta":
            continue
        name, rest = key.split("/", 1)
        row, column = rest.rsplit("/", 1)  # a recipe's name may hold "/" (w8a8-static/4)
        rows.setdefault(name, {}).setdefault(prefix + row, {})[column] = data[key]
    return rows, meta


def joined(rows: dict, theirs: dict, path: pathlib.Path, start: int = 0) -> None:
    """``theirs``'s rows added to ``rows`` where ``rows`` lacks them, set by set, after checking that both
    files scored the same items: their FP32 reference rows must be equal. A later part (``start`` > 0)
    extends the rows instead (:func:`appended`)."""
    for name, their_rows in theirs.items():
        mine = rows.setdefault(name, {})
        if start:
            appended(mine, their_rows, f"{path}: its {name} part from item {start}", start)
            continue
        if REFERENCE in mine and REFERENCE in their_rows:
            a, b = mine[REFERENCE], their_rows[REFERENCE]
            if len(a["nll"]) != len(b["nll"]) or not np.allclose(a["nll"], b["nll"], rtol=1e-6, atol=1e-6):
                raise SystemExit(f"{path}: its {name} FP32 reference differs from the first file's (other items).")
        for row, cols in their_rows.items():
            mine.setdefault(row, cols)


def appended(mine: dict, theirs: dict, what: str, start: int) -> None:
    """Each of ``theirs``'s rows (a later part of a run, from item ``start`` on) appended to the same row of
    ``mine``, which must be there and end at item ``start``."""
    for row, cols in theirs.items():
        if row not in mine:
            raise SystemExit(f"{what}: row {row!r} has no earlier part to extend (give that file first)")
        have = len(mine[row]["correct"])
        if have != start:
            raise SystemExit(f"{what}: row {row!r} ends at item {have}, not where this part starts")
        mine[row] = {k: np.concatenate([v, cols[k]]) for k, v in mine[row].items()}


def _value(kind: str, cols: dict) -> float:
    names, fn = STATISTICS[kind]
    return float(fn(*(cols[n].sum() for n in names)))


def _aligned(rows: dict) -> dict:
    """Every row cut to the samples all rows have (an anchor run with fewer items)."""
    n = min(len(c["correct"]) for c in rows.values())
    longer = sorted(r for r, c in rows.items() if len(c["correct"]) > n)
    if longer:
        print(f"rows cut to the {n} samples every row has: {', '.join(longer)} had more")
    return {r: {k: v[:n] for k, v in c.items()} for r, c in rows.items()}


def figures(rows: dict, set_name: str, anchor: str | None, base_name: str = "FP16") -> list[dict]:
    """The records of one set: value, ratio to the base (FP16; torch's FP32 in a file of torch rows alone)
    and its SE, perplexity change, the gap to the anchor."""
    rows = _aligned(rows)
    base = rows[base_name]
    out = []
    has_ppl = set_name != "hellaswag"
    for row, cols in rows.items():
        units = len(cols["correct"])
        rec = {"set": set_name, "recipe": row, "units": units, "base": base_name}
        rec["accuracy"] = _value("accuracy", cols)
        rec["ratio_to_fp16"] = rec["accuracy"] / _value("accuracy", base)
        rec["ratio_se"] = difference_se("accuracy", cols, base, ratio=True) if row != base_name else None
        if has_ppl:
            rec["perplexity"] = _value("perplexity", cols)
            rec["ppl_change"] = rec["perplexity"] / _value("perplexity", base) - 1
            rec["ppl_change_se"] = difference_se("perplexity", cols, base, ratio=True) if row != base_name else None
        if anchor and anchor in rows and row not in (anchor, base_name, REFERENCE, "torch fp32"):
            rec["vs_anchor"] = rec["ratio_to_fp16"] - _value("accuracy", rows[anchor]) / _value("accuracy", base)
            rec["vs_anchor_se"] = gain_se("accuracy", cols, rows[anchor], base)
            if has_ppl:
                rec["ppl_vs_anchor"] = rec["perplexity"] / _value("perplexity", base) - _value(
                    "perplexity", rows[anchor]
                ) / _value("perplexity", base)
                rec["ppl_vs_anchor_se"] = gain_se("perplexity", cols, rows[anchor], base)
        out.append(rec)
    return out


def _pct(v, se=None, sign=False) -> str:
    if v is None:
        return "-"
    text = f"{100 * v:+.2f}%" if sign else f"{100 * v:.2f}%"
    return text if se is None else f"{text} ±{100 * se:.2f}%"


def markdown(records: list[dict], sets: list[str]) -> str:
    recipes = list(dict.fromkeys(r["recipe"] for r in records))
    by = {(r["set"], r["recipe"]): r for r in records}
    head = ["model"]
    for s in sets:
        units = next((r["units"] for r in records if r["set"] == s), 0)
        base = next((r["base"] for r in records if r["set"] == s), "FP16")
        head.append(f"{s} ({units}) acc. vs {base}")
        if s != "hellaswag":
            head.append(f"{s} ppl")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for recipe in recipes:
        cells = [recipe]
        for s in sets:
            r = by.get((s, recipe))
            if r is None:
                cells += ["-"] * (1 if s == "hellaswag" else 2)
                continue
            if recipe in (r["base"], REFERENCE):
                cells.append(f"{r['accuracy']:.4f}")
            else:
                cells.append(_pct(r["ratio_to_fp16"], r["ratio_se"]))
            if s != "hellaswag":
                change = "" if recipe == r["base"] else f" ({_pct(r['ppl_change'], r['ppl_change_se'], sign=True)})"
                cells.append(f"{r['perplexity']:.2f}{change}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def anchor_gaps(records: list[dict], sets: list[str]) -> str:
    rows = [r for r in records if "vs_anchor" in r]
    if not rows:
        return ""
    lines = ["| model - anchor | " + " | ".join(sets) + " |", "|" + "---|" * (len(sets) + 1)]
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        cells = [recipe]
        for s in sets:
            r = next((x for x in rows if x["set"] == s and x["recipe"] == recipe), None)
            if r is None:
                cells.append("-")
                continue
            text = _pct(r["vs_anchor"], r["vs_anchor_se"], sign=True)
            if "ppl_vs_anchor" in r:
                text += f"; ppl {_pct(r['ppl_vs_anchor'], r['ppl_vs_anchor_se'], sign=True)}"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("onnx", type=pathlib.Path, nargs="+")
    parser.add_argument("--anchor", type=pathlib.Path, action="append", default=[])
    parser.add_argument("--model-name", default="")
    parser.add_argument("--base", help="the row every other is put against (default: FP16)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    first, *more = args.onnx
    torch_only = "family" in json.loads(str(np.load(first)["meta"]))
    rows, meta = load(first, prefix="torch " if torch_only else "")
    metas = {"onnx": meta}
    origin = {(s, recipe): meta for s, r in rows.items() for recipe in r}  # whose run a row is
    for path in more:
        theirs, metas[str(path)] = load(path)
        origin.update({(s, recipe): metas[str(path)] for s, r in theirs.items() for recipe in r})
        joined(rows, theirs, path, metas[str(path)].get("start", 0))
    anchor_name = None
    for path in args.anchor:
        theirs, ameta = load(path, prefix="torch ")
        metas[str(path)] = ameta
        origin.update({(s, recipe): ameta for s, r in theirs.items() for recipe in r})
        for s, r in theirs.items():
            if s in rows and ameta.get("start"):
                appended(rows[s], r, f"{path}: its {s} part from item {ameta['start']}", ameta["start"])
            elif s in rows:
                rows[s].update(r)
        anchor_name = anchor_name or "torch fp8-dynamic"
    records = []
    for s, r in rows.items():
        base = "FP16" if "FP16" in r else "torch fp32" if "torch fp32" in r else None
        if args.base is not None:
            base = args.base if args.base in r else None
        if base is None:
            continue
        if "torch fp32" in r and REFERENCE in r:
            cut = _aligned({k: r[k] for k in ("torch fp32", REFERENCE)})
            same = float(np.mean(cut["torch fp32"]["correct"] == cut[REFERENCE]["correct"]))
            print(f"{s}: torch fp32 vs ONNX FP32, samples with the same hits: {same:.4f}")
        records += figures(r, s, anchor_name, base)
    sets = list(dict.fromkeys(r["set"] for r in records))
    for rec in records:
        made = origin.get((rec["set"], rec["recipe"]), meta)
        rec.update(model=args.model_name, **{k: made.get(k, meta.get(k)) for k in ("machine", "date", "onnxruntime")})
    print(markdown(records, sets))
    gaps = anchor_gaps(records, sets)
    if gaps:
        print()
        print(gaps)
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps({"meta": metas, "records": records}, indent=1, default=float))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
