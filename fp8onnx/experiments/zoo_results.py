"""``fp8onnx zoo``'s results: the pass-rate table per configuration and task family, its JSON and CSV, and the plot."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import os
import pathlib

from fp8onnx.accuracy.plots import pass_rates
from fp8onnx.graph.model_io import write_text_atomic

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ZooResult:
    models: list[dict]  # per model: name, path, fp32, fp16, metric, error, cells
    configs: list[dict]  # per configuration: label, group, models, pass shares
    ran: int  # models computed in this run (the rest were on disk)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_csv(self) -> str:
        buf = io.StringIO()
        fields = ["model", "family", "configuration", "group", "metric", "value", "ratio_to_fp16", "rel_loss_vs_fp16"]
        fields += ["passes_llm", "passes_ptq", "error"]
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        for m in self.models:
            for label, cell in m["cells"].items():
                head = {"model": m["name"], "family": m.get("family", ""), "configuration": label}
                writer.writerow({**head, **{k: cell.get(k) for k in fields[3:]}})
        return buf.getvalue()

    def table(self) -> str:
        counts = f"{len(self.models)} models x {len(self.configs)} configurations"
        lines = [f"{counts} ({self.ran} run now, {len(self.models) - self.ran} from earlier runs)"]
        head = ["configuration", "models", "within 1% rel", "99.5% of FP16"]
        rows = [
            [c["label"], str(c["models"]), _share(c["passes_ptq"], c["models"]), _share(c["passes_llm"], c["models"])]
            for c in self.configs
        ]
        lines += _columns(head, rows)
        lines.append("")
        labels = [c["label"] for c in self.configs]
        families = sorted({f for c in self.configs for f in c.get("families", {})})
        if len(families) > 1:  # within 1% relative loss, per task family
            rows = [[f, *(_family(c.get("families", {}).get(f)) for c in self.configs)] for f in families]
            lines += _columns(["family (within 1% rel)", *labels], rows)
            lines.append("")
        head = ["model", "metric", "FP16", *labels]
        rows = []
        for m in self.models:
            if m.get("error"):
                rows.append([m["name"], "error", "-", *(["-"] * len(labels))])
                continue
            rows.append(
                [m["name"], m["metric"] or "-", _f(m["fp16"], ".4f")]
                + [_cell(m["cells"].get(label)) for label in labels]
            )
        lines += _columns(head, rows)
        lines.append("cells: the metric relative to FP16's ('x': could not be built; see the JSON)")
        errors = [f"{m['name']}: {m['error']}" for m in self.models if m.get("error")]
        lines += [f"error: {e}" for e in errors]
        return "\n".join(lines)


def _share(count: int, total: int) -> str:
    return f"{count}/{total} ({count / total:.0%})" if total else "-"


def _family(counts: dict | None) -> str:
    return "-" if not counts else f"{counts['passes_ptq']}/{counts['models']}"


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _cell(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if cell.get("error"):
        return "x"
    return (
        _f(cell.get("ratio_to_fp16"), ".2%") if cell.get("ratio_to_fp16") is not None else _f(cell.get("value"), ".4f")
    )


def _columns(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    return out + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]


def write_outputs(result: ZooResult, out: str | os.PathLike) -> list[pathlib.Path]:
    out = pathlib.Path(out)
    write_text_atomic(out / "zoo.json", json.dumps(result.to_json(), indent=1) + "\n")
    write_text_atomic(out / "zoo.csv", result.to_csv())
    return [out / "zoo.json", out / "zoo.csv"]


def write_plot(result: ZooResult, path: str | os.PathLike) -> pathlib.Path:
    return pass_rates(
        [c["label"] for c in result.configs],
        [c["passes_ptq"] / c["models"] if c["models"] else 0.0 for c in result.configs],
        [c["passes_llm"] / c["models"] if c["models"] else 0.0 for c in result.configs],
        pathlib.Path(path),
    )
