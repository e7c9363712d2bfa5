"""Error-compensating weight rounding on the FP8 grid (GPTQ, Frantar et al. 2022), for MatMul/Gemm.

Plain rounding puts every weight on its nearest FP8 value independently. GPTQ rounds one input row
of ``W`` [K, N] at a time and spreads that row's rounding error over the rows not yet rounded, in
proportion to how the inputs correlate: with ``H = X^T X`` of the layer's input X [rows, K], row i's
error ``e = (w_i - q_i) / Hinv[i, i]`` is subtracted as ``Hinv[i, i+1:]^T e`` (``Hinv`` the upper
Cholesky factor of ``H^-1``, damped by 1% of its mean diagonal). The result minimises
``||X W - X Q||`` far better than rounding each weight alone. Scales are those plain quantization
chose (per tensor or per output channel): GPTQ only picks *which* grid value each weight takes.

``H`` is accumulated in the graph during calibration (:class:`GPTQ` declares it as a
:class:`~fp8onnx.pipeline.statistics.Sums` statistic, measured in the pipeline's one pass): per
activation feeding a quantized MatMul/Gemm, the instrumented model outputs
``Reshape(x, [-1, K])^T @ Reshape(x, [-1, K])`` in float32, and only that K x K matrix leaves
onnxruntime per batch (summed in float32 here, as GPTQ implementations do).
Models larger than the weight budget run layer by layer, as calibration does.

The rounded weights replace the float initializers *on the grid*: quantizing them again with the
same scales (which :class:`~fp8onnx.passes.InsertQDQPass` does) gives exactly GPTQ's values. They
are lazy: each is rounded when the model is saved, one at a time, so memory stays at one weight
(reading one again, as bias correction does, rounds it again).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx_ir as ir

from fp8onnx.errors import Fp8OnnxError
from fp8onnx.graph.plan import Decision, in_main_graph
from fp8onnx.numerics.formats import Fp8Format, dequantize, quantize
from fp8onnx.passes import TensorQuant
from fp8onnx.passes._common import derived_tensor, release
from fp8onnx.pipeline.statistics import F32, Sums
from fp8onnx.scratch import scratch_folder
from fp8onnx.techniques.base import Technique

__all__ = ["GPTQ", "gptq_round"]

logger = logging.getLogger(__name__)
DAMP = 0.01  # fraction of the mean diagonal added to H (GPTQ's default)
BLOCK = 128  # rows rounded before the deferred update of the rest (GPTQ's lazy batch)
# Rows in order of decreasing h[i, i] (GPTQ's act-order). SmolLM2-135M, --preset llm, 32,768 held-out
# tokens: next-token accuracy 99.82% of FP16's and perplexity +1.20% with it, 99.32% and +1.33% without.
ACT_ORDER = True


def _targets(decisions: list[Decision], model: ir.Model) -> dict[str, list[tuple[ir.Node, int]]]:
    """activation name -> the (MatMul/Gemm, weight index) pairs whose weight it multiplies."""
    out: dict[str, list[tuple[ir.Node, int]]] = {}
    for d in decisions:
        node = d.node
        if node.op_type not in ("MatMul", "Gemm") or dict(d.inputs).get(1) != "weight":
            continue
        if node.op_type == "Gemm" and node.attributes.get_int("transA", 0):
            continue
        x, w = node.inputs[0], node.inputs[1]
        if x is None or not in_main_graph(x, model) or w.shape is None or len(w.shape) != 2:
            continue
        out.setdefault(x.name, []).append((node, 1))
    return out


def _reduction_size(node: ir.Node) -> int:
    """K of y = x W: the rows of a [K, N] weight (the columns of a transposed Gemm's [N, K]); the
    activation's own last dim is often unknown to shape inference (e.g. after a Reshape)."""
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
    return int(node.inputs[1].shape[1 if transposed else 0])


def _hessians(sizes: dict[str, int]) -> Sums:
    """``X^T X`` (float32 sums, K x K) of each activation named in ``sizes`` (name -> K), computed in
    the graph."""

    def xtx(x: ir.Value, add) -> list[ir.Value]:
        k = sizes[x.name]
        x2 = add("Cast", [add("Reshape", [x, np.array([-1, k], np.int64)], "2d")], "f32", to=int(F32))
        return [add("MatMul", [add("Transpose", [x2], "t", perm=[1, 0]), x2], "xtx", dtype=F32, shape=[k, k])]

    # float32 sums: a 1B model's X^T X matrices (16 layers x up to 5632^2) would take 5.6 GB in float64
    return Sums({name: xtx for name in sizes}, "hessians", dtype=np.float32)


def gptq_round(
    w: np.ndarray, h: np.ndarray, scale, fmt: Fp8Format, damp: float = DAMP, act_order: bool = ACT_ORDER
) -> np.ndarray:
    """``w`` [K, N] (y = x @ w) rounded to the FP8 grid of ``scale`` (scalar, [N] per output column,
    or [K, N] per element: block scales) by GPTQ with ``h`` = X^T X [K, K]; returns the rounded
    values in float32. With ``act_order`` the rows are rounded in order of decreasing ``h[i, i]``
    (GPTQ's "act-order"): the inputs with the most energy first, while the most rows remain to
    absorb their error."""
    w = np.array(w, dtype=np.float64)
    k = w.shape[0]
    scale = np.asarray(scale, np.float32)
    h = np.array(h, dtype=np.float64)
    dead = np.diag(h) == 0  # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    per_row = scale.ndim == 2  # block scales: row i rounds on its own scales
    if act_order:
        perm = np.argsort(-np.diag(h), kind="stable")
        q = gptq_round(w[perm], h[np.ix_(perm, perm)], scale[perm] if per_row else scale, fmt, damp, act_order=False)
        out = np.empty_like(q)
        out[perm] = q
        return out
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    try:
        hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: Hinv[i, j] for j >= i
    except np.linalg.LinAlgError:
        raise Fp8OnnxError("--weight-rounding gptq: the input's X^T X is not positive definite.") from None

    def grid(v: np.ndarray, row: int) -> np.ndarray:
        s = scale[row] if per_row else scale
        return dequantize(quantize(v.astype(np.float32), s, fmt), s, np.float32).astype(np.float64)

    q = np.empty_like(w)
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        block, errs, hb = w[i1:i2].copy(), np.zeros((i2 - i1, w.shape[1])), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = block[i]
            q[i1 + i] = grid(row, i1 + i)
            err = (row - q[i1 + i]) / hb[i, i]
            block[i:] -= np.outer(hb[i, i:], err)
            errs[i] = err
        w[i2:] -= hinv[i1:i2, i2:].T @ errs
    return q.astype(np.float32)


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
        self.model, self.targets = model, _targets(decisions, model)
        sizes = {x: _reduction_size(nodes[0][0]) for x, nodes in self.targets.items()}
        self.hessians = _hessians(sizes) if sizes else None
        self.originals: dict[str, ir.TensorProtocol] = {}  # weight name -> its float values
        self.folder: str | None = None  # where weights rounded during the pass wait to be written
        self._plan_for, self._plan_cache = None, {}

    def statistics(self) -> list[Sums]:
        return [self.hessians] if self.hessians else []

    def apply(self, quant: dict[str, TensorQuant]) -> str | None:
        rounded = self.round(quant)
        return f"GPTQ rounding of {len(rounded)} weights on the FP8 grid (X^T X from the calibration data)"

    def _plan(self, quant: dict[str, TensorQuant]) -> dict[str, tuple[ir.Value, str, object]]:
        """weight name -> (its value, the activation whose X^T X rounds it, ``compute(w) -> rounded``)."""
        shared: dict[str, set] = {}
        for x, nodes in self.targets.items():
            for node, index in nodes:
                shared.setdefault(node.inputs[index].name, set()).add(x)
        plan = {}
        for x, nodes in self.targets.items():
            for node, index in nodes:
                value = node.inputs[index]
                tq = quant.get(value.name)
                if tq is None or not tq.format.deployable or len(shared[value.name]) > 1 or value.name in plan:
                    continue
                transposed = bool(node.op_type == "Gemm" and node.attributes.get_int("transB", 0))
                if tq.block_size:  # one scale per element, [K, N] as GPTQ sees the weight
                    full = tq.full_scale(list(value.shape))
                    scale = full.T if transposed else full
                elif tq.axis is not None:  # per output channel: axis 1 of [K, N] (axis 0 of a transposed Gemm's)
                    scale = np.asarray(tq.scale, np.float32).reshape(-1)
                else:
                    scale = np.float32(tq.scale)

                def compute(w, x=x, scale=scale, fmt=tq.format, transposed=transposed):
                    q = gptq_round(w.T if transposed else w, self.hessians.value_of(x)[0], scale, fmt)
                    return (q.T if transposed else q).astype(w.dtype)

                plan[value.name] = (value, x, compute)
        return plan

    def round(self, quant: dict[str, TensorQuant]) -> list[str]:
        """Replace the weights (those not already rounded by :meth:`round_now`); returns the names of
        all those rounded."""
        if not self.targets:
            return []
        rounded = []
        for name, (value, _, compute) in self._plan(quant).items():
            rounded.append(name)
            if name in self.originals:
                continue
            # Evaluated when the model is saved, one weight at a time (a large model is never resident whole).
            source = value.const_value
            self.originals[name] = source
            value.const_value = derived_tensor(source, compute, value.dtype, source.shape, name)
        logger.info("GPTQ rounded %d weights on the FP8 grid", len(rounded))
        return rounded

    def round_now(self, quant: dict[str, TensorQuant], name: str, measured: set[str]):
        """Weight ``name`` rounded now (sequential or layer-by-layer calibration), if GPTQ rounds it
        and its X^T X is among the statistic outputs ``measured`` so far; returns the stored tensor
        (also put in the model: written to :attr:`folder`, read back when the model is saved, so that
        memory holds no rounded weight), False where GPTQ does not round this weight, or None where
        its X^T X is not measured yet. An X^T X all of whose weights are rounded is dropped."""
        plan = self._planned(quant)
        if name not in plan:
            return False
        value, x, compute = plan[name]
        if name in self.originals:
            return value.const_value
        if not set(self.hessians.fetch[x]) <= measured:
            return None
        source = value.const_value
        rounded = compute(source.numpy())
        release(source)
        where = os.path.join(self._folder(), f"{len(self.originals)}.npy")
        np.save(where, rounded, allow_pickle=False)
        del rounded
        stored = ir.LazyTensor(
            lambda: ir.tensor(np.load(where, allow_pickle=False), name=name),
            dtype=value.dtype,
            shape=ir.Shape(source.shape),
            name=name,
        )
        self.originals[name], value.const_value = source, stored
        if all(n in self.originals for n, (_, y, _) in plan.items() if y == x):
            self.hessians.drop(x)  # every weight it rounds is rounded: free its K x K sums
        return stored

    def round_ready(self, quant: dict[str, TensorQuant], measured: set[str]) -> None:
        """Round every weight whose X^T X is complete (layer-by-layer calibration, after each segment)."""
        for name in self._planned(quant):
            self.round_now(quant, name, measured)

    def _planned(self, quant):
        if self._plan_for is not quant:
            self._plan_for, self._plan_cache = quant, (self._plan(quant) if self.targets else {})
        return self._plan_cache

    def _folder(self) -> str:
        if self.folder is None:
            self.folder = scratch_folder("fp8onnx-gptq-")
        return self.folder
