"""PNG plots (matplotlib, an optional dependency: ``pip install 'fp8onnx[plot]'``)."""

from __future__ import annotations

import io
import math
import pathlib

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph.model_io import write_bytes_atomic

__all__ = ["compare_rows", "constant_window", "pass_rates", "pyplot", "save_png", "scale_exponents", "sensitivity_bars"]


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Fp8OnnxError("--plot needs matplotlib: pip install 'fp8onnx[plot]'.") from None
    return plt


def save_png(plt, fig, path: pathlib.Path, dpi: int = 120) -> pathlib.Path:
    """Layout, then an atomic PNG write of ``fig`` to ``path``; the figure is closed either way."""
    try:
        fig.tight_layout()
        if not path.parent.is_dir():
            raise Fp8OnnxError(f"Plot folder {str(path.parent)!r} does not exist.")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        write_bytes_atomic(path, buf.getvalue())
        return path
    finally:
        plt.close(fig)


def _finish(plt, fig, ax, title: str, path: pathlib.Path) -> pathlib.Path:
    """Title and legend, then :func:`save_png`."""
    try:
        ax.set_title(title)
        ax.legend(fontsize=8)
    except BaseException:
        plt.close(fig)
        raise
    return save_png(plt, fig, path)


def constant_window(
    points: list[tuple[float, float]], amax: float | None, fp16: float | None, metric: str, path: pathlib.Path
) -> pathlib.Path:
    """The metric against one constant scale for every tensor (FP8-CSCALE), with FP8-AMAX and FP16."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    if points:
        ax.plot([math.log2(s) for s, _ in points], [v for _, v in points], "o-", label="FP8-CSCALE (constant scale)")
    if amax is not None:
        ax.axhline(amax, color="tab:green", linestyle="--", label="FP8-AMAX (per-tensor amax)")
    if fp16 is not None:
        ax.axhline(fp16, color="gray", linestyle=":", label="FP16")
        ax.axhline(fp16 * 0.995, color="tab:red", linestyle=":", linewidth=0.8, label="99.5% of FP16")
    ax.set_xlabel("log2(constant scale), E4M3FN")
    ax.set_ylabel(metric)
    return _finish(plt, fig, ax, "Accuracy against one constant scale for every tensor", path)


def scale_exponents(exponents: dict[str, list[float]], path: pathlib.Path) -> pathlib.Path:
    """Histogram of log2 of the per-tensor scales, one series per kind (weights, activations)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for kind, values in exponents.items():
        if values:
            bins = np.arange(math.floor(min(values)) - 0.5, math.ceil(max(values)) + 1.5)
            ax.hist(values, bins=bins, alpha=0.6, label=f"{kind} ({len(values)})")
    ax.set_xlabel("log2(per-tensor scale)")
    ax.set_ylabel("tensors")
    return _finish(plt, fig, ax, "Distribution of per-tensor scale exponents", path)


def sensitivity_bars(names: list[str], sqnr_db: list[float], path: pathlib.Path) -> pathlib.Path:
    """SQNR of each node's output with only it in FP8, one bar per node in graph order."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.4, 0.18 * len(names) + 2), 4))
    shown = [min(v, 99.0) for v in sqnr_db]  # a lossless node (inf) is drawn at the top
    ax.bar(range(len(names)), shown, color="tab:blue", label="SQNR of the node's output (dB)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=6)
    ax.set_ylabel("SQNR dB (lower = more sensitive)")
    return _finish(plt, fig, ax, "Per-node sensitivity to FP8, in graph order", path)


def pass_rates(labels: list[str], ptq: list[float], llm: list[float], path: pathlib.Path) -> pathlib.Path:
    """Per configuration, the share of models within 1% relative loss and within 99.5% of FP16."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.4, 0.5 * len(labels) + 2), 4.2))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [100 * v for v in ptq], 0.4, label="within 1% relative loss (PTQ paper)")
    ax.bar(x + 0.2, [100 * v for v in llm], 0.4, label=">= 99.5% of FP16 (FP8 LLM paper)")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("models passing (%)")
    ax.set_ylim(0, 105)
    return _finish(plt, fig, ax, "Share of the zoo's models that pass, per configuration", path)


def compare_rows(rows, generation: dict | None, path: pathlib.Path) -> pathlib.Path:
    """``compare``'s models side by side: the headline metric, the greedy tokens kept before the first
    divergence from FP32 (language models), and the time per batch relative to FP32."""
    plt = pyplot()
    panels = 3 if generation else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8))
    names = [r.name for r in rows]
    x = np.arange(len(names))

    def bars(ax, values, label, ylabel):
        ax.bar(x, [0 if v is None else v for v in values], color="tab:blue", label=label)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(label, fontsize=9)

    try:
        headline = rows[0].headline or "headline metric"
        bars(axes[0], [r.value for r in rows], headline, headline)
        if generation:
            n = generation["tokens"]
            kept = [n if r.generation is None else r.generation["tokens_before_divergence"] for r in rows]
            bars(
                axes[1],
                kept,
                f"greedy tokens before divergence (of {generation['tokens']})",
                "tokens",
            )
        base = rows[0].latency_ms
        bars(
            axes[-1],
            [None if r.latency_ms is None or not base else r.latency_ms / base for r in rows],
            "time per batch / FP32's",
            "ratio",
        )
    except BaseException:
        plt.close(fig)
        raise
    return save_png(plt, fig, path)
