"""GPTQ rounding (Frantar et al. 2022) of MatMul/Gemm weights on the FP8 grid, as a technique of the
calibration pipeline; its algebra is :mod:`fp8onnx.techniques.gptq_rounding`.

``H = X^T X`` is accumulated in the graph during calibration (:class:`GPTQ` declares it as a
:class:`~fp8onnx.pipeline.statistics.Sums` statistic, measured in the pipeline's one pass): per
activation feeding a quantized MatMul/Gemm, the instrumented model outputs
``Reshape(x, [-1, K])^T @ Reshape(x, [-1, K])`` in float32, and only that K x K matrix leaves
onnxruntime per batch (summed in float32 here, as GPTQ implementations do).
Models larger than the weight budget run layer by layer, as calibration does.

The rounded weights replace the float initializers *on the grid*: quantizing them again with the
same scales (which :class:`~fp8onnx.passes.InsertQDQPass` does) gives exactly GPTQ's values. They
are lazy: rounded when the model is saved, a stack of inputs at a time (:data:`STACK_BYTES`: the
inputs of the same shape, e.g. every layer's attention input, with all their weights), so memory
holds at most a few stacks, never the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.scratch import scratch_folder
from fp8onnx.graph import known
from fp8onnx.graph.plan import Decision, in_main_graph
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.passes import TensorQuant
from fp8onnx.passes.common import derived_tensor, reduction_size, release
from fp8onnx.pipeline.statistics import F32, Statistic, Sums
from fp8onnx.techniques.base import Settled, Technique
from fp8onnx.techniques.gptq_rounding import gptq_factor, ordered, restored, round_stacked

__all__ = ["GPTQ"]

logger = logging.getLogger(__name__)
# Inputs rounded together: at most this many bytes of their X^T X factors and weights (float32); one
# SmolLM2-135M layer's attention input (q, k, v) takes 3.5 MB, its MLP input (gate, up) 8.4 MB.
STACK_BYTES = 128 << 20
XTX_COLUMNS = 512  # columns of X in one block of X^T X (see _hessians)
# Fewer rows of X per channel than this, and GPTQ fits the calibration data more than new data: a warning.
# SmolLM2-135M, weight-only E4M3 with blocks of 16, 32,768 held-out tokens: top-1 agreement with FP32 0.966,
# 0.966, 0.968, 0.970 and 0.969 from 4k, 8k, 16k, 32k and 62k calibration tokens (2.7 to 40 rows per
# channel of its widest input, 1,536), next-token accuracy 99.6% -> 99.9% of FP32's from 4k to 32k.
MIN_ROWS_PER_CHANNEL = 16
_WARNED: set[int] = set()  # the row counts (calibration data) warned about in this process


def _readers(decisions: list[Decision], model: ir.Model) -> dict[str, list[tuple[ir.Node, int]]]:
    """activation name -> the (MatMul/Gemm, weight index) pairs whose weight it multiplies."""
    out: dict[str, list[tuple[ir.Node, int]]] = {}
    for d in decisions:
        node = d.node
        if node.op_type not in ("MatMul", "Gemm") or dict(d.inputs).get(1) != "weight":
            continue
        x = node.inputs[0]
        if x is None or not in_main_graph(x, model) or reduction_size(node) is None:  # e.g. a Gemm with transA
            continue
        out.setdefault(known.name(x), []).append((node, 1))
    return out


def _column_blocks(k: int) -> list[tuple[int, int]]:
    """X's K columns cut into at most 8 blocks of about :data:`XTX_COLUMNS` (X^T X is computed a block
    pair at a time, only the pairs on and above the diagonal)."""
    b = min(8, -(-k // XTX_COLUMNS))
    return [(i * k // b, (i + 1) * k // b) for i in range(b)]


def _hessians(sizes: dict[str, int]) -> Sums:
    """``X^T X`` (float32 sums, K x K) of each activation named in ``sizes`` (name -> K), computed in
    the graph as its blocks on and above the diagonal (:func:`_column_blocks`; :func:`assembled` puts
    them together): symmetry saves up to half the products, and onnxruntime's CPU EP runs a Gemm of
    these narrower blocks faster (SmolLM2-135M's 1536-wide MLP input: 22 ms a batch of 2,048 tokens in
    3 x 3 blocks, 50 ms as one product of the transposed X)."""

    def xtx(x: ir.Value, add) -> list[ir.Value]:
        k = sizes[known.name(x)]
        x2 = add("Cast", [add("Reshape", [x, np.array([-1, k], np.int64)], "2d")], "f32", to=int(F32))
        cols = _column_blocks(k)
        if len(cols) > 1:
            parts = [add("Slice", [x2, np.array([a]), np.array([b]), np.array([1])], "cols") for a, b in cols]
        else:
            parts = [x2]
        blocks = [
            add("Gemm", [parts[i], parts[j]], "xtx", dtype=F32, shape=[b1 - a1, b2 - a2], transA=1)
            for i, (a1, b1) in enumerate(cols)
            for j, (a2, b2) in enumerate(cols)
            if j >= i
        ]
        rows = add("Cast", [add("Shape", [x2], "rows", dtype=ir.DataType.INT64, shape=[1], end=1)], "n", to=int(F32))
        return [*blocks, rows]  # the rows summed (tokens, for a language model): see MIN_ROWS_PER_CHANNEL

    # float32 sums: a 1B model's X^T X matrices (16 layers x up to 5632^2) would take 5.6 GB in float64
    return Sums({name: xtx for name in sizes}, "hessians", dtype=np.float32)


def assembled(blocks: list[np.ndarray], k: int) -> np.ndarray:
    """X^T X [K, K] (float32) from its blocks on and above the diagonal, as :func:`_hessians` measures them."""
    h, it = np.empty((k, k), np.float32), iter(blocks)
    cols = _column_blocks(k)
    for i, (a1, b1) in enumerate(cols):
        for a2, b2 in cols[i:]:
            block = next(it)
            h[a1:b1, a2:b2] = block
            if a2 != a1:
                h[a2:b2, a1:b1] = block.T
    return h


@dataclass
class _Weight:
    """A weight GPTQ rounds: its value, the activation ``x`` whose X^T X rounds it, and its scales
    (``quant``), whose :meth:`scale` is what GPTQ takes."""

    value: ir.Value
    x: str
    transposed: bool
    quant: TensorQuant
    format: Fp8Format

    @property
    def shape(self) -> tuple[int, int]:
        k, n = known.value_shape(self.value).numpy()
        return (n, k) if self.transposed else (k, n)

    @property
    def blocked(self) -> bool:
        return bool(self.quant.block_size)

    def scale(self) -> np.ndarray | np.float32:
        """The scale as GPTQ sees the weight ([K, N], y = x @ w): scalar, [N] per output column, or [K, N]
        per element for block scales (computed here, when the weight's stack is rounded: a model's
        block scales at full size would take as much memory as its float32 weights)."""
        tq = self.quant
        if tq.block_size:
            full = tq.full_scale(list(known.value_shape(self.value)))
            return full.T if self.transposed else full
        if tq.axis is not None:  # per output channel: axis 1 of [K, N] (axis 0 of a transposed Gemm's)
            return np.asarray(tq.scale, np.float32).reshape(-1)
        return np.float32(tq.scale)


class GPTQ(Technique):
    """Each quantized MatMul/Gemm weight replaced by its GPTQ rounding (on the grid of its scales);
    weights read by several nodes, Conv weights and nodes whose input is inside a subgraph keep plain
    rounding.

    requires: calibration data (X^T X of each layer's input). ensures: every weight it names in its
    summary holds values on its FP8 grid (computed lazily, when the model is written)."""

    name = "GPTQ rounding"
    option = "--weight-rounding gptq"
    needs = "the Hessian X^T X of each layer's input"

    def __init__(self, model: ir.Model, decisions: list[Decision]):
        self.model, self.readers = model, _readers(decisions, model)
        self.sizes = {x: reduction_size(nodes[0][0]) for x, nodes in self.readers.items()}
        self.hessians = _hessians(self.sizes) if self.sizes else None
        self.originals: dict[str, ir.TensorProtocol] = {}  # weight name -> its float values
        self.folder: str | None = None  # where weights rounded during the pass wait to be written
        self._plan_for: dict[str, TensorQuant] | None = None  # the scales _plan_cache was planned for
        self._plan_cache: dict[str, _Weight] = {}
        self._waiting: dict[str, np.ndarray] = {}  # rounded with a stack, not yet read (lazy rounding)
        self._stacked: set[str] = set()  # activations whose weights a stack has rounded (lazy rounding)
        self.settles = bool(self.readers)  # it rounds weights as a layer-by-layer pass goes

    def statistics(self) -> list[Statistic]:
        return [self.hessians] if self.hessians else []

    def _xtx(self) -> Sums:
        """The X^T X sums (measured whenever a weight is planned: :attr:`readers` names its input)."""
        if self.hessians is None:
            raise Fp8OnnxError("GPTQ has no X^T X sums: no quantized MatMul/Gemm weight has an input it can measure.")
        return self.hessians

    def _hessian(self, x: str) -> np.ndarray:
        *blocks, counted = self._xtx().value_of(x)
        k, rows = self.sizes[x], int(counted.reshape(-1)[0])
        if rows < MIN_ROWS_PER_CHANNEL * k and rows not in _WARNED:
            _WARNED.add(rows)  # once for this data (its rows) in a process: an accuracy search rounds every candidate
            logger.warning(
                "GPTQ: the X^T X of %r sums %d rows of its %d channels (%.1f a channel); below %d a channel "
                "GPTQ fits the calibration data more than new data: give more --calib data (SmolLM2-135M: "
                "4k -> 32k calibration tokens, held-out top-1 agreement with FP32 0.966 -> 0.970)",
                x,
                rows,
                k,
                rows / k,
                MIN_ROWS_PER_CHANNEL,
            )
        return assembled(blocks, k)

    def apply(self, quant: dict[str, TensorQuant]) -> str | None:
        rounded = self.round(quant)
        return f"GPTQ rounding of {len(rounded)} weights on the FP8 grid (X^T X from the calibration data)"

    def _plan(self, quant: dict[str, TensorQuant]) -> dict[str, _Weight]:
        """weight name -> how GPTQ rounds it."""
        shared: dict[str, set] = {}
        for x, nodes in self.readers.items():
            for node, index in nodes:
                shared.setdefault(known.name(known.required_input(node, index)), set()).add(x)
        plan: dict[str, _Weight] = {}
        for x, nodes in self.readers.items():
            for node, index in nodes:
                value = known.required_input(node, index)
                name = known.name(value)
                tq = quant.get(name)
                if tq is None or not tq.format.deployable or len(shared[name]) > 1 or name in plan:
                    continue
                transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0
                plan[name] = _Weight(value, x, transposed, tq, tq.format)
        return plan

    def _stacks(self, inputs: list[str], plan: dict[str, _Weight]) -> list[tuple[list[str], dict[str, list[str]]]]:
        """The activations ``inputs`` cut into stacks: inputs whose weights have the same shapes, at most
        :data:`STACK_BYTES` of X^T X and weights (float32) each; with each input's weight names."""
        by_input: dict[str, list[str]] = {}
        for name, w in plan.items():
            if w.x in inputs:
                by_input.setdefault(w.x, []).append(name)
        kinds: dict[tuple, list[str]] = {}  # the shapes of an input's weights -> those inputs
        for x, names in by_input.items():
            key = tuple((plan[n].shape, plan[n].blocked, plan[n].format) for n in names)
            kinds.setdefault(key, []).append(x)
        stacks = []
        for key, xs in kinds.items():
            k = key[0][0][0]
            per_input = k * k + sum(shape[0] * shape[1] * (2 if blocked else 1) for shape, blocked, _ in key)
            step = max(1, STACK_BYTES // (4 * per_input))  # X^T X, weights and block scales
            stacks += [(xs[i : i + step], by_input) for i in range(0, len(xs), step)]
        return stacks

    def _round_stack(self, xs: list[str], by_input: dict[str, list[str]], plan) -> dict[str, np.ndarray]:
        factors = [gptq_factor(self._hessian(x), what=f"activation {x!r}") for x in xs]
        gains = np.stack([f[2] for f in factors])
        out = {}
        for j in range(len(by_input[xs[0]])):  # the j-th weight of every input: one shape
            names = [by_input[x][j] for x in xs]
            k, n = plan[names[0]].shape
            rows = np.empty((len(names), k, n), np.float32)
            scales = np.empty((len(names), k if plan[names[0]].blocked else 1, n), np.float32)
            for i, (name, factor) in enumerate(zip(names, factors)):
                w = plan[name]
                source = self.originals[name] if name in self.originals else w.value.const_value
                values = source.numpy()
                scales[i] = ordered(values.T if w.transposed else values, factor, w.scale(), out=rows[i])[1]
                del values
                release(source)
            q = round_stacked(rows, gains, scales, plan[names[0]].format)
            for name, factor, qi in zip(names, factors, q):
                w = plan[name]
                qi = restored(qi, factor)
                out[name] = np.ascontiguousarray(qi.T if w.transposed else qi).astype(w.value.dtype.numpy())
        return out

    def _lazy(self, name: str) -> np.ndarray:
        """Weight ``name``'s rounding when the model is written: its input's stack is rounded at its first
        weight read, the others wait in memory for their turn (a weight read again is rounded again)."""
        if name in self._waiting:
            return self._waiting.pop(name)
        plan = self._plan_cache
        x = plan[name].x
        if x in self._stacked:
            ((xs, by_input),) = self._stacks([x], plan)  # one input: one stack
            return self._round_stack(xs, by_input, plan)[name]
        dropped = self._xtx().dropped  # rounded during a layer-by-layer pass already (round_ready)
        ready = [y for y in dict.fromkeys(w.x for w in plan.values()) if y not in self._stacked and y not in dropped]
        xs, by_input = next((xs, b) for xs, b in self._stacks(ready, plan) if x in xs)
        done = self._round_stack(xs, by_input, plan)
        self._stacked.update(xs)
        result = done.pop(name)
        self._waiting.update(done)
        return result

    def round(self, quant: dict[str, TensorQuant]) -> list[str]:
        """Replace the weights (those not already rounded by :meth:`round_ready`); returns the names of
        all those rounded."""
        if not self.readers:
            return []
        rounded = []
        for name, w in self._planned(quant).items():
            rounded.append(name)
            if name in self.originals:
                continue
            # Evaluated when the model is saved (a large model is never resident whole).
            source = known.constant(w.value)
            self.originals[name] = source
            w.value.const_value = derived_tensor(
                source, lambda _, name=name: self._lazy(name), known.value_dtype(w.value), source.shape, name
            )
        logger.info("GPTQ rounded %d weights on the FP8 grid", len(rounded))
        return rounded

    def on_segment_end(self, quant: dict[str, TensorQuant], measured: set[str], weights: list[str]) -> Settled:
        """After a segment of layer-by-layer calibration: every weight whose X^T X is complete is rounded
        (:meth:`round_ready`; stored in :attr:`folder`, read back when the model is saved, so that memory
        holds no rounded weight). ``weights`` (sequential calibration): of those GPTQ rounds, the stored
        tensors of the rounded ones and the names of those whose X^T X is still to come. Without
        ``weights``, the weights still to round once every X^T X is complete are left to :meth:`round`."""
        if not weights:
            self.round_ready(quant, measured, last_when_written=True)
            return Settled()
        plan = self._planned(quant)
        mine = [name for name in weights if name in plan]
        if any(n not in self.originals and set(self._xtx().fetch[plan[n].x]) <= measured for n in mine):
            self.round_ready(quant, measured)
        stored = {n: plan[n].value.const_value for n in mine if n in self.originals}
        return Settled(stored, {n for n in mine if n not in self.originals})

    def round_ready(self, quant: dict[str, TensorQuant], measured: set[str], last_when_written: bool = False) -> None:
        """Round every weight whose X^T X is complete (layer-by-layer calibration, after each segment),
        store it in :attr:`folder` and drop the X^T X sums it needed. ``last_when_written``: once every
        X^T X is complete, the weights still to round are left to :meth:`round` (rounded when the model
        is written, a stack at a time, with no round trip through the disk: a model within the weight
        budget, one segment, never touches it)."""
        plan = self._planned(quant)
        waiting = list(dict.fromkeys(w.x for n, w in plan.items() if n not in self.originals))
        ready = [x for x in waiting if set(self._xtx().fetch[x]) <= measured]
        if not ready or (last_when_written and len(ready) == len(waiting)):
            return
        for xs, by_input in self._stacks(ready, plan):  # written a stack at a time: memory holds one stack
            for name, rounded in self._round_stack(xs, by_input, plan).items():
                w = plan[name]
                where = os.path.join(self._folder(), f"{len(self.originals)}.npy")
                np.save(where, rounded, allow_pickle=False)
                self.originals[name] = known.constant(w.value)
                w.value.const_value = ir.LazyTensor(
                    _saved(where, name),
                    dtype=known.value_dtype(w.value),
                    shape=ir.Shape(known.value_shape(w.value)),
                    name=name,
                )
        for x in ready:
            self._xtx().drop(x)  # every weight it rounds is rounded: free its K x K sums

    def _planned(self, quant: dict[str, TensorQuant]) -> dict[str, _Weight]:
        if self._plan_for is not quant:
            self._plan_for, self._plan_cache = quant, (self._plan(quant) if self.readers else {})
            self._waiting, self._stacked = {}, set()
        return self._plan_cache

    def _folder(self) -> str:
        if self.folder is None:
            self.folder = scratch_folder("fp8onnx-gptq-")
        return self.folder


def _saved(where: str, name: str) -> Callable[[], ir.TensorProtocol]:
    """Weight ``name``'s rounding, read back from ``where`` (a ``.npy`` file) when the model is written."""
    return lambda: ir.tensor(np.load(where, allow_pickle=False), name=name)
