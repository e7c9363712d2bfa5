"""The FP8 error budget: for each quantized node, how much of its output error comes from its weight and
how much from its activation, and whether the activation's is *range* (values clipped at the format's
largest value, or below its smallest normal, where the grid is coarse) or *mantissa* (rounding within
the normal range).

One instrumented pass, like :mod:`fp8onnx.accuracy.sensitivity`: beside each node, shadow copies read
its inputs through the Q/DQ ``quantize`` would insert - all of them (the node's SQNR, as sensitivity
ranks it), the weight alone, the activation alone, and the activation's range error alone (its
quantization error kept only where the value is out of the format's normal range). Each reduces
``sum((y' - y)^2)`` to a scalar per batch, with ``sum(y^2)``, and the activation's clipped and
below-normal element counts.

The budget sums the nodes' relative squared errors (``10^(-SQNR/10)``, the quantity sensitivity ranks)
into the model's: a node's *share* is its part of that sum. The split of a node's error is reported
as the weight's and the activation's relative errors on their own (they do not add exactly: the two
errors are not orthogonal), and the activation's range error as a fraction of the activation's.
Activations with a per-tensor constant scale (static) get the range split; dynamic and per-token ones
do not (their scale follows each row).
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from fp8onnx.graph import known
from fp8onnx.passes import InsertQDQPass
from fp8onnx.passes.instrument import error_outputs, range_only, shadow_of
from fp8onnx.pipeline.statistics import Statistic

__all__ = ["Budget", "NodeBudget", "budget_rows"]

_KINDS = ("all", "weight", "activation", "range")


@dataclasses.dataclass
class NodeBudget:
    name: str
    op_type: str
    share: float  # of the summed relative squared errors of all measured nodes
    rel_err: float  # sum((y_q - y)^2) / sum(y^2), every input quantized
    weight_rel_err: float | None  # the weight alone quantized
    activation_rel_err: float | None  # the activation alone
    range_rel_err: float | None  # the activation's clipped and below-normal values alone (static scales)
    clipped: float | None  # fraction of the activation's values beyond the format's largest (static scales)
    below_normal: float | None  # fraction below its smallest normal (zeros excluded)

    @property
    def range_share(self) -> float | None:
        """The activation's range error as a fraction of its whole error."""
        if self.range_rel_err is None or not self.activation_rel_err:
            return None
        return min(1.0, self.range_rel_err / self.activation_rel_err)

    def verdict(self) -> str:
        w, a = self.weight_rel_err or 0.0, self.activation_rel_err or 0.0
        if a <= w:
            return "weight"
        r = self.range_share
        return "activation (range)" if r is not None and r >= 0.5 else "activation (mantissa)"


class Budget(Statistic):
    """The shadows and their sums (a :class:`fp8onnx.pipeline.statistics.Statistic`); ``kinds``: which of
    all / weight / activation / range (all of them by default; sensitivity alone measures "all")."""

    def __init__(self, decisions: list, quant: dict, kinds: tuple[str, ...] | None = None):
        self.decisions, self.quant, self.kinds = decisions, quant, kinds or _KINDS
        self.outputs: list[str] = []
        self.sums: dict[str, float] = {}
        self._names: dict[str, dict[str, str]] = {}  # node -> what -> output name

    def instrument(self, model: ir.Model, tag: str) -> list[str]:
        nodes = {n.name: n for n in model.graph}
        shadows, node_inputs = [], []
        for d in self.decisions:
            node = nodes[d.node.name]
            for kind in self.kinds:
                wanted = {"all": ("weight", "activation"), "range": ("activation",)}.get(kind, (kind,))
                picked = [i for i, role in d.inputs if role in wanted]
                if not picked or (kind == "range" and not self._static(node, picked)):
                    continue
                shadow = shadow_of(node, f"fp8onnx_budget_{kind}")
                shadows.append((node, kind, shadow, picked))
                node_inputs += [(shadow, i) for i in picked]
        InsertQDQPass(node_inputs, self.quant)(model)  # one Q/DQ per tensor, shared by the shadows reading it
        for node, kind, shadow, picked in shadows:
            names = self._names.setdefault(known.name(node), {})
            if kind == "range":
                names.update(range_only(model.graph, node, shadow, picked, self.quant))
            names[kind], energy = error_outputs(model.graph, node, shadow, kind, "energy" not in names)
            names.setdefault("energy", energy)
        self.outputs = [o for names in self._names.values() for o in names.values()]
        return self.outputs

    def sensitivity_outputs(self, kind: str = "all") -> list[tuple[str, str] | None]:
        """Per node, its error and energy outputs with ``kind``'s inputs quantized (every input, or the
        activation alone): what sensitivity ranks; None where the node has no such shadow."""
        names = [self._names.get(d.node.name, {}) for d in self.decisions]
        return [(n[kind], n["energy"]) if kind in n else None for n in names]

    def merge(self, summary: dict) -> None:
        for name, value in summary.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def _static(self, node: ir.Node, picked: list[int]) -> bool:
        return all(isinstance(self.quant[known.name(known.required_input(node, i))].scale, float) for i in picked)

    def rows(self) -> list[NodeBudget]:
        """Per node, its budget; shares of the measured nodes' summed relative squared errors."""
        raw = []
        for d in self.decisions:
            names = self._names[d.node.name]
            energy = self.sums.get(names["energy"], 0.0)

            def rel(kind, names=names, energy=energy):
                return None if kind not in names else (self.sums.get(names[kind], 0.0) / energy if energy else math.inf)

            elements = self.sums.get(names.get("elements", ""), 0.0)

            def fraction(key, names=names, elements=elements):
                return self.sums.get(names[key], 0.0) / elements if key in names and elements else None

            raw.append((d.node, rel("all"), rel("weight"), rel("activation"), rel("range"), fraction("clipped"),
                        fraction("below_normal")))  # fmt: skip
        total = sum(r[1] for r in raw if r[1] is not None and math.isfinite(r[1]))
        return [
            NodeBudget(
                node.name, node.op_type, (a / total) if total and math.isfinite(a) else 0.0, a, w, act, rng, c, b
            )
            for node, a, w, act, rng, c, b in raw
        ]


def budget_rows(rows: list[NodeBudget], top: int | None = None) -> str:
    """The budget as a table, the largest shares first."""
    ordered = sorted(rows, key=lambda r: -r.share)[:top] if top else sorted(rows, key=lambda r: -r.share)
    width = max([len("node"), *(len(r.name) for r in ordered)])

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(v):
        return "-" if v is None else f"{v:.2e}"

    lines = [
        "FP8 error budget: each node's share of the summed relative squared errors (its output with only it in "
        "FP8); the weight's and the activation's relative errors alone; of the activation's, the part from values "
        "clipped or below the smallest normal (range)",
        f"{'node':<{width}}  {'share':>6}  {'rel err':>8}  {'weight':>8}  {'activ.':>8}  {'range':>6}  "
        f"{'clipped':>7}  {'<normal':>7}  mostly",
    ]
    for r in ordered:
        lines.append(
            f"{r.name:<{width}}  {pct(r.share):>6}  {num(r.rel_err):>8}  {num(r.weight_rel_err):>8}  "
            f"{num(r.activation_rel_err):>8}  {pct(r.range_share):>6}  {pct(r.clipped):>7}  {pct(r.below_normal):>7}  "
            f"{r.verdict()}"
        )
    return "\n".join(lines)
