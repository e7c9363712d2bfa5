"""GPTQ's algebra (Frantar et al. 2022) on the FP8 grid: the factor of X^T X and the row-by-row rounding.

Plain rounding puts every weight on its nearest FP8 value independently. GPTQ rounds one input row
of ``W`` [K, N] at a time and spreads that row's rounding error over the rows not yet rounded, in
proportion to how the inputs correlate. In GPTQ's own form, with ``H = X^T X`` of the layer's input
X [rows, K] (damped by 1% of its mean diagonal) and ``U`` the upper Cholesky factor of ``H^-1``, row
i's error ``e = (w_i - q_i) / U[i, i]`` is subtracted from the later rows as ``U[i, i+1:]^T e``. The
result minimises ``||X W - X Q||`` far better than rounding each weight alone. Scales are given (per
tensor, per output channel or per block): GPTQ only picks *which* grid value each weight takes.

The same rounding needs no inverse. Row i, when its turn comes, is ``w_i + sum_{j<i} G[j, i] (w_j -
q_j)`` with the rows' *original* values ``w_j`` and ``G = U^-1 diag(U)``, and ``U^-1`` is a Cholesky
factor of H itself (see :func:`gptq_factor`): one factorisation, no triangular inverse.

The algebra is float32, as in GPTQ's own implementation. Two things make it fast on a CPU:
:func:`gptq_factor` factors H once per input (q/k/v share it) in matrix products, and
:func:`round_stacked` rounds many weights of one shape at once (a stack over the leading axis), so
that the row loop runs K times per stack instead of K times per weight. Stacking does not change a
single bit of any weight's result: each is computed by the same element-wise operations and the same
BLAS products as alone (``tests/test_gptq.py`` checks it).
"""

from __future__ import annotations

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format, round_to_grid

__all__ = ["DAMP", "gptq_factor", "gptq_round", "round_stacked"]

DAMP = 0.01  # fraction of the mean diagonal added to H (GPTQ's default)
# GPTQ's lazy batch, nested: the rows are rounded in blocks of BLOCKS[0] rows, each of which first takes
# the errors of all rows before it in one matrix product; inside a block, in blocks of BLOCKS[1] rows,
# whose errors reach the block's later rows in one matrix product, and so on; inside the innermost block,
# row by row (BLOCKS[-1] / 2 element-wise multiply-adds per weight). On the 2-core development machine,
# 30 stacked weights of each of SmolLM2-135M's shapes round in 1.7 s, against 2.6 s in blocks of 32 rows
# alone.
BLOCKS = (128, 32, 8)
# Rows in order of decreasing h[i, i] (GPTQ's act-order). SmolLM2-135M, --preset llm, 32,768 held-out
# tokens: next-token accuracy 99.82% of FP16's and perplexity +1.20% with it, 99.32% and +1.33% without.
ACT_ORDER = True


def _inverse_lower(lower: np.ndarray) -> np.ndarray:
    """Inverse of a lower-triangular matrix, by halves ([[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1,
    B^-1]]): about k^3 / 3 multiply-adds, in matrix products (NumPy has no triangular inverse)."""
    k = lower.shape[0]
    if k <= 64:
        return np.tril(np.linalg.inv(lower))
    m = k // 2
    a, b = _inverse_lower(lower[:m, :m]), _inverse_lower(lower[m:, m:])
    out = np.zeros_like(lower)
    out[:m, :m], out[m:, m:] = a, b
    out[m:, :m] = -(b @ (lower[m:, :m] @ a))
    return out


def _cholesky(h: np.ndarray, block: int = 256, overwrite: bool = False) -> np.ndarray:
    """Lower Cholesky factor of ``h`` (symmetric positive definite), by blocks of ``block`` columns
    whose updates are matrix products: on the 2-core development machine NumPy's bundled LAPACK factor
    is several times slower than its own matrix product (5632 x 5632 float32: 2.1 s, this 0.6 s).
    ``overwrite``: computed in ``h`` itself (a C-contiguous array of the caller's) instead of a copy.
    Raises ``np.linalg.LinAlgError`` where ``h`` is not positive definite."""
    a = h if overwrite else np.array(h)
    k = a.shape[0]
    for j in range(0, k, block):
        e = min(j + block, k)
        a[j:e, j:e] = np.linalg.cholesky(a[j:e, j:e])
        if e == k:
            break
        a[j:e, e:] = 0.0  # the upper half of these rows: the factor is lower triangular
        a[e:, j:e] = a[e:, j:e] @ _inverse_lower(a[j:e, j:e]).T
        panel = a[e:, j:e]
        for c in range(e, k, block):  # the lower half of the trailing matrix only
            c2 = min(c + block, k)
            a[c:, c:c2] -= panel[c - e :] @ panel[c - e : c2 - e].T
    return a


def gptq_factor(h: np.ndarray, damp: float = DAMP, act_order: bool = ACT_ORDER, what: str = "the input"):
    """What GPTQ needs of ``h`` = X^T X [K, K], shared by every weight that multiplies the same input:
    ``(order, dead, gain)`` with ``order`` the rows in rounding order (decreasing ``h[i, i]`` with
    ``act_order``: the inputs with the most energy first, while the most rows remain to absorb their
    error; else None), ``dead`` the inputs that were always zero, and ``gain`` [K, K] (float32, upper
    triangular, rows and columns in that order): row i's error ``w_i - q_i`` (its original value less
    its grid value) is subtracted from each later row j times ``gain[i, j]``.

    ``gain = -U^-1 diag(U)``, with U the upper Cholesky factor of the damped ``H^-1`` that GPTQ's own
    form uses, comes from one Cholesky factorisation and a column scaling: with P the order reversal and
    P H P = L L^T, H^-1 = U^T U for U = P L^-1 P, so ``U^-1 diag(U) = P (L diag(L)^-1) P``."""
    diag = np.diag(h).astype(np.float32)
    dead = diag == 0  # inputs that were always zero: their weights do not matter
    diag[dead] = 1.0
    order = np.argsort(-diag, kind="stable") if act_order else None
    rows = order if order is not None else np.arange(len(diag))
    back = rows[::-1]
    h = np.asarray(h, np.float32).take(back, 0).take(back, 1)  # P H P (P the reversal) in the rounding order
    h[np.diag_indices(len(diag))] = diag[back] + np.float32(damp * np.mean(diag[rows], dtype=np.float64))
    try:
        lower = _cholesky(h, overwrite=True)
    except np.linalg.LinAlgError:
        raise Fp8OnnxError(f"--weight-rounding gptq: the X^T X of {what} is not positive definite.") from None
    lower /= -np.diag(lower).copy()  # -L diag(L)^-1: the columns scaled, the diagonal -1
    return order, dead, np.ascontiguousarray(lower[::-1, ::-1])


def ordered(w: np.ndarray, factor, scale, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``w`` [K, N] and its ``scale`` (scalar, [N] or [K, N]) as :func:`round_stacked` takes them: float32
    rows in the factor's order (written into ``out`` [K, N] if given), the rows of dead inputs zero, the
    scale as [1, N] or [K, N]."""
    order, dead, _ = factor
    if out is None:
        out = np.empty(w.shape, np.float32)
    if order is not None:
        dead = dead[order]
        if w.dtype == np.float32:
            np.take(w, order, axis=0, out=out)
        else:
            out[...] = w[order]
    else:
        out[...] = w
    out[dead, :] = 0.0
    scale = np.asarray(scale, np.float32)
    scale = scale if scale.ndim == 2 else np.broadcast_to(scale, (1, w.shape[1]))
    if order is not None and scale.shape[0] > 1:
        scale = scale[order]
    return out, scale


def restored(q: np.ndarray, factor) -> np.ndarray:
    """A row of :func:`round_stacked`'s result back in the weight's own row order."""
    order = factor[0]
    if order is None:
        return q
    out = np.empty_like(q)
    out[order] = q
    return out


def round_stacked(w: np.ndarray, gain: np.ndarray, scale: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """GPTQ rounding of L weights at once: ``w`` [L, K, N] (rows in rounding order, float32; overwritten:
    it holds the rows' errors when this returns), ``gain`` [L, K, K] (each weight's :func:`gptq_factor`),
    ``scale`` [L, 1, N] or [L, K, N]; returns the rounded values [L, K, N] (float32, rows in the same
    order).

    One thread: cutting the stack in parts rounded side by side (NumPy's element-wise steps use one
    core each) measured slower on the 2-core development machine, 2.5 s against 1.85 s for SmolLM2-135M's
    210 weights, since the matrix products already use every core."""
    q = np.empty_like(w)
    # Blocks of BLOCKS[0] rows in turn, each first given the errors of all rows before it in one matrix
    # product (the rows already rounded hold their errors in ``w`` by then), then rounded.
    k, top = w.shape[1], BLOCKS[0]
    orig = np.empty((w.shape[0], min(top, k), w.shape[2]), np.float32)  # a block's rows as they came
    for j1 in range(0, k, top):
        j2 = min(j1 + top, k)
        orig[:, : j2 - j1] = w[:, j1:j2]
        if j1:
            w[:, j1:j2] -= np.matmul(gain[:, :j1, j1:j2].transpose(0, 2, 1), w[:, :j1])
        _round_rows(w, gain, scale, fmt, q, orig, j1, j1, j2, 1)
    return q


def _round_rows(w, gain, scale, fmt, q, orig, base: int, i1: int, i2: int, level: int) -> None:
    """Rows ``i1:i2`` of ``w`` rounded into ``q`` (each row's error ``orig - q`` written over it; ``orig``
    holds the rows from ``base`` on as they came), each row's error spread over the later rows of
    ``i1:i2`` only: by blocks of ``BLOCKS[level]`` rows, whose errors reach the rows after them in one
    matrix product; row by row in the innermost block."""
    if level == len(BLOCKS):
        fmax, per_row = np.float32(fmt.fmax), scale.shape[1] != 1
        for i in range(i1, i2):
            row, s = w[:, i], scale[:, i] if per_row else scale[:, 0]
            # the nearest grid value, as dequantize(quantize(row, s, fmt), s) computes it (saturating)
            q[:, i] = round_to_grid(np.clip(row / s, -fmax, fmax), fmt) * s
            np.subtract(orig[:, i - base], q[:, i], out=row)
            if i + 1 < i2:
                w[:, i + 1 : i2] -= gain[:, i, i + 1 : i2, None] * row[:, None, :]
        return
    step = BLOCKS[level]
    for j1 in range(i1, i2, step):
        j2 = min(j1 + step, i2)
        _round_rows(w, gain, scale, fmt, q, orig, base, j1, j2, level + 1)
        if j2 < i2:
            w[:, j2:i2] -= np.matmul(gain[:, j1:j2, j2:i2].transpose(0, 2, 1), w[:, j1:j2])


def gptq_round(w: np.ndarray, h, scale, fmt: Fp8Format, damp: float = DAMP, act_order: bool = ACT_ORDER) -> np.ndarray:
    """``w`` [K, N] (y = x @ w) rounded to the FP8 grid of ``scale`` (scalar, [N] per output column,
    or [K, N] per element: block scales) by GPTQ with ``h`` = X^T X [K, K] (or its :func:`gptq_factor`);
    returns the rounded values in float32."""
    factor = h if isinstance(h, tuple) else gptq_factor(h, damp, act_order)
    rows, scales = ordered(w, factor, scale)
    return restored(round_stacked(rows[None], factor[2][None], scales[None], fmt)[0], factor)
