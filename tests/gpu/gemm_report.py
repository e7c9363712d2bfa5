"""The GEMM timing's rows (every form, width, M and DeepGEMM setting against FP16 at the same M and width,
in the same process) and the printed table of them."""

from __future__ import annotations

import re

from gemm_models import FORMS

SETTINGS = ("deepgemm_off", "deepgemm_on")
SHORT = {"gemv": "gemv", "gemv-mma": "mma", "deepgemm": "dg", "dequant+cublas": "deq", "other": "oth"}
LOG_LINE = "MatMulBlockQuantizedFp8Weight: using SM90 DeepGEMM"


def logged_deepgemm(stderr_text: str) -> dict[tuple[str, str, int], bool]:
    """{(form, width, M): whether onnxruntime logged its DeepGEMM line} from a timing process's stderr,
    between the "@@probe FORM WIDTH M" and "@@end" markers of its log probes."""
    seen: dict[tuple[str, str, int], bool] = {}
    current = None
    for line in stderr_text.splitlines():
        marker = re.match(r"@@probe (\S+) (\S+) (\d+)$", line.strip())
        if marker:
            current = (marker[1], marker[2], int(marker[3]))
            seen[current] = False
        elif line.strip() == "@@end":
            current = None
        elif current is not None and LOG_LINE in line:
            seen[current] = True
    return seen


def _row(setting: str, width: str, form: str, m: int, cell: dict, base: dict, log: dict) -> dict:
    row = {"width": width, "m": m, "form": form, "deepgemm": setting == "deepgemm_on"}
    for key in ("wall_ms", "kernel_us", "path", "expected_path", "kernels", "error", "skipped"):
        if cell.get(key) not in (None, ""):
            row[key] = cell[key]
    if "wall_ms" in cell and "wall_ms" in base:
        row["ratio"] = cell["wall_ms"] / base["wall_ms"]
    if cell.get("kernel_us") and base.get("kernel_us"):
        row["kernel_ratio"] = cell["kernel_us"] / base["kernel_us"]
    if (form, width, m) in log:
        row["log_deepgemm"] = log[(form, width, m)]
    return row


def rows(settings: dict, logs: dict) -> list[dict]:
    """One row per setting, width, form and M (FP16's too, ratio 1), from each setting's results
    ({width: {form: {M: cell}}}; a form that failed as a whole is an {"error": ...})."""
    out = []
    for setting, result in settings.items():
        for width, forms in result.get("results", {}).items():
            base = forms.get("fp16", {})
            for form, cells in forms.items():
                if "error" in cells or "skipped" in cells:
                    out.append({"width": width, "form": form, "deepgemm": setting == "deepgemm_on", **cells})
                    continue
                for m, cell in cells.items():
                    out.append(_row(setting, width, form, int(m), cell, base.get(m, {}), logs.get(setting, {})))
    return out


def _cell(row: dict | None, with_path: bool) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "error"
    if "ratio" not in row:
        return "skip" if "skipped" in row else "-"
    text = f"{row['ratio']:.2f}" + (f"/{row['kernel_ratio']:.2f}" if "kernel_ratio" in row else "")
    if with_path:
        path = SHORT.get(row.get("path", ""), "") or f"{SHORT.get(row.get('expected_path', ''), '')}?"
        text += f" {path}" + ("+log" if row.get("log_deepgemm") else "")
    return text


def table(all_rows: list[dict]) -> str:
    """Per width, one line per M: FP16's wall time, then each form's ratio to FP16 (wall time / device
    kernel time from the CUPTI trace), the fast form with DeepGEMM off and on, with the path that ran."""
    index = {(r["width"], r.get("m"), r["form"], r["deepgemm"]): r for r in all_rows}
    columns = [(f, False) for f in FORMS[1:3]] + [(f, True) for f in FORMS[1:3]] + [(f, False) for f in FORMS[3:]]
    names = {"fast_w8a16": "w8a16", "fast_w8a8": "w8a8", "gemm_float8": "GemmFloat8", "qdq": "Q/DQ"}
    head = "".join(f"{names[f] + (' DG' if on else ''):>19}" for f, on in columns)
    lines = [
        "Latency relative to FP16's at the same width and M (below 1: faster): wall time / device kernel time;",
        "fast-form path: gemv, mma (tensor-core GEMV), dg (DeepGEMM), deq (dequantize + cuBLAS), '?' = by the",
        "rules, not seen; +log: onnxruntime logged DeepGEMM. DG: ORT_FP8_MATMUL_DEEPGEMM=1 (fast form only;",
        "GemmFloat8 and Q/DQ shown without it, both settings in the JSON).",
    ]
    for width in dict.fromkeys(r["width"] for r in all_rows):
        lines += ["", f"K x N = {width}", f"{'M':>6}{'FP16 ms':>10}{head}"]
        for m in sorted({r["m"] for r in all_rows if r["width"] == width and r.get("m") is not None}):
            base = index.get((width, m, "fp16", False), {})
            wall = f"{base['wall_ms']:.4f}" if "wall_ms" in base else "-"
            cells = "".join(f"{_cell(index.get((width, m, f, on)), f.startswith('fast')):>19}" for f, on in columns)
            lines.append(f"{m:>6}{wall:>10}{cells}")
    return "\n".join(lines)
