"""What a quantization did, for people (``summary()``) and for machines (``to_json()``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fp8onnx.base.version import __version__
from fp8onnx.numerics.formats import EMULATED_NOTE

__all__ = ["FolderReport", "NodeReport", "QuantizeReport", "TensorReport", "describe_config"]


def _json_dict(items) -> dict:
    """Arrays as lists; a tensor's block scales and maxima as their shape, min and max (every one of
    them would make a report several times the size of the float8 weights; the model holds them)."""
    out = dict(items)
    blocked = bool(out.get("block_size"))
    for k, v in out.items():
        if isinstance(v, np.ndarray):
            out[k] = {"blocks": list(v.shape), "min": float(v.min()), "max": float(v.max())} if blocked else v.tolist()
    return out


def describe_config(cfg: dict) -> str:
    """One line for a QuantizeConfig.to_json(): formats, scaling, activation mode, granularity."""
    wf, af = cfg["weight_format"], cfg["activation_format"]
    how = wf if wf == af else f"{wf} weights / {af} activations"
    scaling = cfg["scaling"]
    if scaling == "constant":
        scaling += f" {cfg['scale']:g}"
    elif scaling == "pow2" and cfg.get("margin"):
        scaling += f" margin {cfg['margin']}"
    elif scaling == "percentile":
        scaling += f" {cfg['percentile']:g}"
    how += f", {scaling} scaling"
    if cfg.get("headroom", 1) != 1:
        how += f", activation headroom {cfg['headroom']:g}x"
    activations = cfg.get("activations")
    if activations == "dynamic":
        how += ", dynamic activations"
    elif activations == "dynamic-per-token":
        how += ", dynamic per-token activations"
    elif activations == "dynamic-per-group":
        how += f", dynamic per-group activations ({cfg.get('group_size')} channels a scale)"
    elif activations == "none":
        how += ", weight-only (activations in float)"
    if cfg.get("per_channel") == "conv":
        how += ", per-channel Conv weights"
    elif cfg.get("per_channel"):
        how += ", per-channel weights"
    if cfg.get("weight_block_size"):
        how += f", one weight scale per {cfg['weight_block_size']} elements of each weight's reduction axis"
    if cfg.get("weight_rounding") == "gptq":
        how += ", GPTQ weight rounding"
    if cfg.get("smooth") is not None:
        how += f", smoothing alpha {cfg['smooth']:g}"
    if cfg.get("bias_correction"):
        how += ", bias correction"
    if cfg.get("sequential"):
        how += ", sequential calibration"
    if cfg.get("float_vocab"):
        how += ", vocabulary projections in float"
    if cfg.get("float_stem"):
        how += ", stem convolutions in float"
    if cfg.get("embeddings") == "fp8":
        how += ", fp8 embeddings"
    if cfg.get("precision") in ("fp16", "bf16"):
        how += f", {cfg['precision'].upper()} graph"
    if cfg.get("preset"):
        how += f" (preset {cfg['preset']})"
    return how


@dataclasses.dataclass
class TensorReport:
    name: str
    kind: str  # "weight" | "activation"
    format: str
    # An array per channel or block (a list in to_json(): a model's block scales as Python floats would
    # take several times the memory of its float8 weights); None when computed in the graph (dynamic)
    scale: float | np.ndarray | None
    amax: float | np.ndarray | None
    axis: int | None = None  # per-channel axis (the blocked axis with block_size)
    block_size: int = 0  # weights with block scales: elements per block along axis (0: none)


@dataclasses.dataclass
class NodeReport:
    name: str
    op_type: str
    quantized: bool
    reason: str | None = None  # why it was left alone
    tensors: list[TensorReport] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class QuantizeReport:
    model: str
    output: str
    config: dict
    opset_from: int | None
    opset_to: int | None
    prepared: list[str]  # graph preparation steps that changed something (opset upgrade, folding, ...)
    nodes: list[NodeReport]
    calibration: dict | None
    input_bytes: int
    output_bytes: int
    modified: bool
    lowered: list[str] = dataclasses.field(default_factory=list)  # nodes now com.microsoft.GemmFloat8
    not_lowered: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> why it kept Q/DQ
    runtime_checked: str | None = "cpu"  # the EP the output was loaded on before writing (None: none)
    fast_form: dict | None = None  # --gemm-op block-fp8: {op, w8a8: [...], w8a16: [...], kept_qdq: {node: why}}
    target_problems: list[str] = dataclasses.field(default_factory=list)  # what --target would reject
    phases: list[dict] = dataclasses.field(default_factory=list)  # wall seconds per phase (fp8onnx.base.phases)
    family: dict | None = None  # --preset auto: the model family seen, why, and the preset applied
    w8a16: dict | None = None  # --w8a8-share: {how, nodes, w8a8_share, losses} (workflows.loss_choice)

    @property
    def quantized(self) -> list[NodeReport]:
        return [n for n in self.nodes if n.quantized]

    @property
    def skipped(self) -> list[NodeReport]:
        return [n for n in self.nodes if not n.quantized]

    def to_json(self) -> dict:
        doc = dataclasses.asdict(self, dict_factory=_json_dict)
        if doc["w8a16"] is None:  # only where chosen: other reports stay as earlier versions wrote them
            del doc["w8a16"]
        return doc

    def summary(self) -> str:
        cfg = self.config
        lines = [f"{self.model} -> {self.output}"]
        if self.family:  # --preset auto: what was seen and applied comes first
            lines[0] += f"\n  {self.family['summary']}"
        if not self.quantized:  # must never look like success
            why = "; ".join(sorted({n.reason or "" for n in self.skipped})[:3]) or "it has no MatMul/Gemm node"
            lines = [f"NOTHING QUANTIZED in {self.model} (the output is the input graph, unchanged): {why}"]
        for step in self.prepared:
            why = " (float8 Q/DQ without zero points)" if step.startswith("upgraded opset") else ""
            lines.append(f"  {step}{why}")
        present = [t for t in ("MatMul", "Gemm", "Conv", "ConvTranspose") if any(n.op_type == t for n in self.nodes)]
        kinds = "/".join(present) or "MatMul/Gemm"
        lines.append(f"  quantized {len(self.quantized)} of {len(self.nodes)} {kinds} nodes to {describe_config(cfg)}")
        if cfg.get("emulated"):
            lines.append(f"  SIMULATION: {EMULATED_NOTE}")
        if self.calibration:
            c = self.calibration
            of = f" of {c['batching']}" if c.get("batching") else ""
            lines.append(f"  calibrated on {c['samples']} samples in {c['batches']} batches{of} ({c['source']})")
        weights = sum(1 for n in self.quantized for t in n.tensors if t.kind == "weight")
        acts = len({t.name for n in self.quantized for t in n.tensors if t.kind == "activation"})
        lines.append(f"  {weights} weights stored as float8, {acts} activation tensors with Q/DQ")
        ratio = self.output_bytes / self.input_bytes if self.input_bytes else 0.0
        lines.append(f"  size {self.input_bytes / 1e6:.2f} MB -> {self.output_bytes / 1e6:.2f} MB ({ratio:.2f}x)")
        reasons: dict[str, list[str]] = {}
        for n in self.skipped:
            reasons.setdefault(n.reason or "", []).append(n.name)
        for reason, names in reasons.items():
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} nodes)" if len(names) > 3 else "")
            lines.append(f"  left alone: {shown}: {reason}")
        lines += self._fast_form_lines()
        if self.config.get("target") == "tensorrt":
            if self.target_problems:
                lines.extend(f"  TensorRT would reject: {p}" for p in self.target_problems)
            else:
                lines.append(
                    "  TensorRT rules (E4M3FN, zero points 0, constant scales, per-tensor activations): all met"
                )
        if not self.modified and not self.quantized:
            lines.append("  nothing to quantize: the output is the input graph, unchanged")
        return "\n".join(lines)

    def _fast_form_lines(self) -> list[str]:
        """The summary's lines on the fast form: GemmFloat8 lowering, MatMulBlockQuantizedFp8Weight, where
        the model was checked."""
        cfg, lines = self.config, []
        if self.lowered or self.not_lowered:
            lines.append(
                f"  {len(self.lowered)} nodes lowered to com.microsoft.GemmFloat8 (CUDA EP, compute capability >= 8.9)"
            )
            for name, why in self.not_lowered.items():
                lines.append(f"  kept Q/DQ: {name}: {why}")
        if self.fast_form is not None:
            f = self.fast_form
            written = len(f["w8a8"]) + len(f["w8a16"])
            lines.append(
                f"  {written} MatMul/Gemm written as {f['op']} (onnxruntime's CUDA fast path, reads the float8 "
                f"weight itself): {len(f['w8a8'])} W8A8 (static E4M3 activations: a_scale), {len(f['w8a16'])} "
                "W8A16 (activations in float16/bfloat16, or quantized in the graph before it)"
            )
            for name, why in f["kept_qdq"].items():
                lines.append(f"  kept Q/DQ: {name}: {why}")
            if self.runtime_checked == "cpu":
                bf16 = " and bfloat16 (float32 arithmetic, results rounded)" if cfg.get("precision") == "bf16" else ""
                lines.append(
                    f"  checked on the CPU EP with the op{bf16} emulated (standard ops, the CUDA kernels' numerics)"
                )
        if self.runtime_checked is None:
            lines.append(
                "  not loaded in onnxruntime here: GemmFloat8 needs the CUDA EP (checked with onnx.checker and "
                "onnxruntime's op schemas)"
            )
        return lines


@dataclasses.dataclass
class FolderReport:
    source: str
    output: str
    layout: str
    reports: dict  # model file name -> QuantizeReport
    copied: list[str]
    prompts_from: str | None
    decode_steps: int
    deployment: list[str] = dataclasses.field(default_factory=list)  # what the folder's configs now say

    def to_json(self, full: bool = True) -> dict:
        """Every model's full report (``--report``), or with ``full=False`` what the folder's
        ``fp8onnx.json`` keeps: settings, counts and sizes (a preset's per-node report runs to MBs)."""

        def brief(report) -> dict:
            kept = {
                "config": report.config,
                "opset": [report.opset_from, report.opset_to],
                "quantized_nodes": len(report.quantized),
                "float_nodes": len(report.skipped),
                "prepared": report.prepared,
                "calibration": report.calibration,
                "input_bytes": report.input_bytes,
                "output_bytes": report.output_bytes,
            }
            if report.w8a16 is not None:  # --w8a8-share's choice: which nodes, how, each one's loss
                kept["w8a16"] = report.w8a16
            return kept

        return {
            "version": __version__,
            "source": self.source,
            "output": self.output,
            "layout": self.layout,
            "calibration": {"data": self.prompts_from, "decode_steps": self.decode_steps},
            "models": {name: r.to_json() if full else brief(r) for name, r in self.reports.items()},
            "copied": self.copied,
            "deployment": self.deployment,
        }

    def summary(self) -> str:
        lines = [f"{self.source} ({self.layout}) -> {self.output}: {len(self.reports)} models quantized"]
        for name, report in self.reports.items():
            lines.append(f"[{name}]")
            lines += ["  " + line for line in report.summary().splitlines()]
        lines.append(
            f"  copied {len(self.copied)} other files: {', '.join(self.copied[:8])}"
            + (", ..." if len(self.copied) > 8 else "")
        )
        lines += [f"  {line}" for line in self.deployment]
        return "\n".join(lines)
