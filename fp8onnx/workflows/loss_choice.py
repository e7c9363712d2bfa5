"""Which GEMMs keep float activations (W8A16), chosen by the model's own loss (``--w8a8-share``).

Each node with a quantized activation is measured by its share of the model's output loss: the loss
with only that activation in FP8 (every weight FP8, as the recipe has it) less the loss with none,
on a few calibration samples, spread over all of the data (:class:`fp8onnx.data.split.Spread`: the
first four of an LLM's windows are often one document). The loss is the KL divergence of the output's
distribution from FP32's where the output is class scores (an LLM's next-token distribution), else one
minus the cosine of its rows. One onnxruntime session serves every measurement: the quantized inputs are gated
(:class:`fp8onnx.passes.GateInputsPass`) and each run opens one gate.

The choice: nodes go W8A8 cheapest first (loss share per multiply-accumulate, a node's MACs counted by
its weight's size: every GEMM of a transformer runs once per token) until ``w8a8_share`` of the
quantized MACs are W8A8, and so does every further node whose share is not above zero; the rest stay
W8A16. The same rule holds whatever the exporter called the nodes (a dynamo export's ``node_linear_N``,
onnxruntime-genai's fused ``qkv_proj``). A model whose weights exceed ``--weight-memory`` is measured layer
by layer, as it is calibrated (one segment's weights in memory at a time). Without data to measure on
(``--stats``), or a whole-graph model too large to hold three times in memory, the names of the Llama-style
attention projections and the last layer are the fallback (:data:`W8A16_NAMES`), and the summary says which
way the choice was made.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging

import numpy as np
import onnx_ir as ir

from fp8onnx.accuracy.metrics import ROW_CHUNK, class_outputs
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.progress import progress_bar
from fp8onnx.data.feeds import Batch
from fp8onnx.data.split import Spread
from fp8onnx.graph import known
from fp8onnx.graph.plan import Decision, last_layers
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.graph.runtime import machine_memory, session_for_model, weight_bytes
from fp8onnx.passes import GATE_PREFIX, GateInputsPass, InsertQDQPass, TensorQuant
from fp8onnx.pipeline.segments import run_segmented

__all__ = ["LOSS_SAMPLES", "W8A16_NAMES", "LossChoice", "choose_w8a16"]

logger = logging.getLogger(__name__)

# The loss is measured on at least LOSS_SAMPLES calibration samples and LOSS_ROWS rows of the output (an LLM's
# 4 windows of 128 tokens: 512 positions), at most LOSS_MAX_SAMPLES: an encoder's pooled output has one row per
# sentence, and 4 sentences told its nodes apart by noise (MiniLM: 64 sentences)
LOSS_SAMPLES, LOSS_ROWS, LOSS_MAX_SAMPLES = 4, 512, 64

# The fallback: the attention projections (Llama names: torch, Optimum, genai's qkv_proj; fp8onnx's sample)
# and the last decoder layer, as --preset llm-w8a8 chose them by name before the loss was measured.
W8A16_NAMES = ("*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*", "*/q", "*/k", "*/v", "*/o")


@dataclasses.dataclass
class LossChoice:
    """The nodes left W8A16, and how they were chosen (the summary's line)."""

    w8a16: list[str]
    share: float  # of the quantized MACs W8A8
    how: str
    losses: dict[str, float] = dataclasses.field(default_factory=dict)  # node -> its share of the loss

    def to_json(self) -> dict:
        return {"how": self.how, "nodes": self.w8a16, "w8a8_share": self.share, "losses": self.losses}

    def line(self) -> str:
        return (
            f"W8A16 {self.how}: {len(self.w8a16)} nodes keep float activations, {self.share:.1%} of the quantized "
            "MACs W8A8"
        )


def choose_w8a16(
    model: ir.Model, decisions: list[Decision], quant: dict[str, TensorQuant], goal: float, source, run: RunOptions
) -> tuple[list[Decision], LossChoice]:
    """(``decisions`` with the chosen nodes' activations taken out, the choice).

    requires: ``quant`` holds every quantized tensor's TensorQuant; ``model`` is still the float graph.
    ensures: the W8A8 nodes' MACs are at least ``goal`` of the quantized MACs, or every node is W8A8."""
    candidates = [d for d in decisions if any(k == "activation" for _, k in d.inputs) and d.node.graph is model.graph]
    macs = {known.name(d.node): _macs(d) for d in decisions}
    why = _cannot_measure(model, candidates, source, run)
    if why:
        names = _by_names(model, candidates)
        how = f"by names (the fallback: {why})"
    else:
        losses, samples = _losses(model, decisions, candidates, quant, source, run)
        names = _by_loss(losses, macs, [known.name(d.node) for d in candidates], goal)
        how = f"by measured loss ({_loss_kind(model)} to FP32 on {samples} calibration samples, a run per node)"
    chosen = set(names)
    out = [
        Decision(d.node, [(i, k) for i, k in d.inputs if k == "weight"]) if d.node.name in chosen else d
        for d in decisions
    ]
    total = sum(macs.values()) or 1
    w8a8 = sum(macs[known.name(d.node)] for d in out if any(k == "activation" for _, k in d.inputs))
    choice = LossChoice(sorted(chosen), w8a8 / total, how, {} if why else losses)
    logger.info("%s", choice.line())
    return out, choice


def _macs(d: Decision) -> int:
    """A node's multiply-accumulates per token: its weight's size (0 without a constant weight)."""
    for index, kind in d.inputs:
        value = d.node.inputs[index]
        if kind == "weight" and value is not None and value.const_value is not None:
            return int(np.prod(value.const_value.shape.numpy()))
    return 0


def _cannot_measure(model: ir.Model, candidates, source, run: RunOptions) -> str:
    if source is None:
        return "no calibration data to measure the loss on"
    if not model.graph.outputs or not candidates:
        return "nothing to measure"
    if not _layered(model, run) and 3 * weight_bytes(model) > machine_memory():
        return "the model is too large to hold a measuring copy"
    return ""


def _layered(model: ir.Model, run: RunOptions) -> bool:
    """Whether the loss is measured layer by layer: the model's weights exceed the budget (as calibration's)."""
    return weight_bytes(model) > run.weight_memory and not run.distributed


def _by_names(model: ir.Model, candidates) -> list[str]:
    late = last_layers(model, 1)
    return [
        d.node.name
        for d in candidates
        if d.node.name in late or any(fnmatch.fnmatchcase(d.node.name or "", p) for p in W8A16_NAMES)
    ]


def _by_loss(losses: dict[str, float], macs: dict[str, int], names: list[str], goal: float) -> list[str]:
    """The nodes left W8A16: the costliest per MAC, once ``goal`` of the MACs are W8A8 by the cheapest."""
    total = sum(macs.values()) or 1
    w8a8 = sum(m for n, m in macs.items() if n not in names)  # nodes without an activation to choose for
    order = sorted(names, key=lambda n: (losses[n] / max(macs[n], 1), n))
    kept = []
    for name in order:
        if w8a8 / total < goal or losses[name] <= 0:
            w8a8 += macs[name]
        else:
            kept.append(name)
    return kept


def _loss_kind(model: ir.Model) -> str:
    first = known.name(model.graph.outputs[0])
    return "KL of the output distribution" if first in class_outputs(model) or "logit" in first else "1 - cosine"


def _losses(model, decisions, candidates, quant, source, run: RunOptions) -> tuple[dict[str, float], int]:
    """(per candidate: the output loss with only its activation quantized, less the loss with none; the
    samples it was measured on). FP32's outputs come first, from a session that is closed before the gated
    copy's opens: one model's weights in onnxruntime at a time, not two. A model over the weight budget
    (``run.weight_memory``) runs layer by layer both times (:func:`fp8onnx.pipeline.segments.run_segmented`:
    each gate setting of each batch is one of its batches), holding one segment's weights at a time."""
    output = model.graph.outputs[0].name
    layered = _layered(model, run)
    references = _references(model, output, source, run, layered)
    gated, gates = _gated_copy(model, decisions, candidates, quant)
    dtype = np.float16 if gates[0].dtype == ir.DataType.FLOAT16 else np.float32
    settings = [
        {g.name: np.asarray(float(k == i + 1), dtype) for i, g in enumerate(gates)} for k in range(len(gates) + 1)
    ]
    sums = np.zeros(len(settings))  # k = 0: no gate open; k: gate k - 1 alone
    feeds = ({**batch.feed, **gate} for batch, _ in references for gate in settings)

    def add(b: int, out: np.ndarray) -> None:
        j, k = divmod(b, len(settings))
        sums[k] += references[j][1].loss(out)

    _forward(gated, output, run, layered, "the loss-measuring copy", feeds, add, len(references) * len(settings))
    seen = sum(batch.size for batch, _ in references)
    return {d.node.name: float(sums[k + 1] - sums[0]) / seen for k, d in enumerate(candidates)}, seen


def _references(model, output: str, source, run: RunOptions, layered: bool) -> list[tuple[Batch, _Reference]]:
    """The batches the loss is measured on, a few samples from all over the data (at least LOSS_SAMPLES and
    LOSS_ROWS rows of the output, at most LOSS_MAX_SAMPLES), with FP32's output on each: the first batch
    says how many rows a sample gives, and so how many more are needed."""
    kl = _loss_kind(model).startswith("KL")
    cap = min(run.batch, LOSS_SAMPLES)  # an LLM's logits: a few samples at a time
    # a source whose files hold larger batches (an export folder's recorded feeds: 16 prompts) gives them
    # whole: their first samples only, or every run measures 4x the samples asked for
    batches = (_first(b, cap) for b in Spread(source, LOSS_MAX_SAMPLES).batches(cap))
    first = next(batches, None)
    if first is None:
        raise Fp8OnnxError("The calibration data gave no batch to measure the loss on.")
    chosen, seen, need = [first], first.size, LOSS_MAX_SAMPLES
    outs: list[np.ndarray] = []

    def keep(b: int, out: np.ndarray) -> None:
        nonlocal need
        outs.append(out)
        if b == 0:  # rows per sample, from FP32's output
            rows = int(np.prod(out.shape[1:-1]))  # as _Reference reads it: [batch, rows, last]
            need = min(LOSS_MAX_SAMPLES, max(LOSS_SAMPLES, -(-LOSS_ROWS // rows)))

    def more():
        nonlocal seen
        yield first.feed
        for batch in batches:
            if seen >= need:
                return
            chosen.append(batch)
            seen += batch.size
            yield batch.feed

    if layered:  # the first batch alone first: it says how many more the run needs
        _forward(model, output, run, layered, "the float model", iter([first.feed]), keep, 1)
        rest = list(more())[1:]
        if rest:
            _forward(model, output, run, layered, "the float model", iter(rest), lambda b, o: outs.append(o), len(rest))
    else:
        _forward(model, output, run, layered, "the float model", more(), keep, None)
    return [(batch, _Reference(out, kl)) for batch, out in zip(chosen, outs)]


def _forward(model, output: str, run: RunOptions, layered: bool, what: str, feeds, on_out, total) -> None:
    """``model``'s ``output`` on each feed, in order, to ``on_out(index, array)``: one session (closed on
    return), or layer by layer (segments of at most ``run.weight_memory`` bytes of weights)."""
    if layered:
        run_segmented(
            model,
            [output],
            feeds,
            lambda b, values: on_out(b, values[output]) if output in values else None,  # the segment computing it
            budget=run.weight_memory,
            provider=run.provider,
            progress=lambda it, n, d: progress_bar(it, total=n, desc=f"{what}: {d}", unit="batch", enable=run.progress),
        )
        return
    session = session_for_model(model, run.provider, what, arena=False)
    runs = progress_bar(feeds, total=total, desc=what, unit="run", enable=run.progress)
    for b, feed in enumerate(runs):
        on_out(b, session.run([output], feed)[0])


def _first(batch: Batch, n: int) -> Batch:
    """The batch's first ``n`` samples: every array whose first axis is the batch's, sliced (a prefill's
    empty KV caches too); others as they are."""
    size = batch.size
    if size <= n:
        return batch
    feed = {k: v[:n] if v.ndim and v.shape[0] == size else v for k, v in batch.feed.items()}
    return Batch(feed, None if batch.labels is None else batch.labels[:n])


def _gated_copy(model, decisions, candidates, quant):
    """A copy of ``model`` with every weight quantized and every candidate's activation gated."""
    gated = model.clone()
    by_name = {n.name: n for n in gated.graph}
    originals = {
        (d.node.name, i): by_name[d.node.name].inputs[i] for d in candidates for i, k in d.inputs if k == "activation"
    }
    node_inputs = [(by_name[d.node.name], i) for d in decisions if d.node.name in by_name for i, _ in d.inputs]
    InsertQDQPass(node_inputs, quant)(gated)
    GateInputsPass([(name, i, x) for (name, i), x in originals.items()])(gated)
    gates = [v for v in gated.graph.inputs if v.name.startswith(GATE_PREFIX)]
    return gated, gates


class _Reference:
    """FP32's output on one batch, with what every loss against it reuses: per row, the probabilities and
    their negative entropy (KL), or the unit rows (cosine)."""

    def __init__(self, ref: np.ndarray, kl: bool):
        r = ref.astype(np.float32).reshape(ref.shape[0], -1, ref.shape[-1])
        self.kl, self.shape = kl, r.shape
        if kl:
            log_p = r - _logsumexp(r)
            self.p = np.exp(log_p)
            self.neg_entropy = (self.p * log_p).sum(-1)
        else:
            self.unit = r / np.maximum(np.linalg.norm(r, axis=-1, keepdims=True), 1e-30)

    def loss(self, out: np.ndarray) -> float:
        """Summed over samples (the first axis): the mean over rows of KL(ref || out), or of 1 - cosine, a
        bounded slice of rows at a time (a vocabulary's logits: temporaries of the whole batch's size set
        llm-w8a8's peak memory).
        KL(p || q) = sum p log p - (sum p c - logsumexp(c)) for q = softmax(c), as sum p = 1."""
        c = out.reshape(self.shape)
        per_row = np.empty(self.shape[:2])
        step = max(1, ROW_CHUNK // max(1, self.shape[0] * self.shape[2]))
        for s in range(0, self.shape[1], step):
            part = c[:, s : s + step].astype(np.float32)
            if self.kl:
                dot = (self.p[:, s : s + step] * part).sum(-1)
                per_row[:, s : s + step] = self.neg_entropy[:, s : s + step] - (dot - _logsumexp(part)[..., 0])
            else:
                norms = np.linalg.norm(part, axis=-1)
                cos = (self.unit[:, s : s + step] * part).sum(-1) / np.maximum(norms, 1e-30)
                per_row[:, s : s + step] = 1.0 - np.where(norms > 0, cos, 1.0)
        return float(per_row.mean(axis=1).sum())


def _logsumexp(x: np.ndarray) -> np.ndarray:
    peak = x.max(-1, keepdims=True)
    return peak + np.log(np.exp(x - peak).sum(-1, keepdims=True))
