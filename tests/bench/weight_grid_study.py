"""Where the weights' FP8 rounding costs, in torch: E4M3 weights per output channel or in blocks of 32 along K,
rounded to nearest or by GPTQ (X^T X of each Linear's input from ``--calib``), activations in float, scored on
``llm_yardstick.py``'s own items (a diagnosis of ``--preset llm-w8a8``'s weights, not a preset).

Each variant is ``ROUNDING-GRID`` (``rtn``/``gptq``, ``pc``/``blk``: per channel, blocks of 32), optionally
``@GROUP=GRID,...`` to give some projection groups (``q k v o gate up down``) another grid (``float``: left in
float): ``gptq-blk@down=pc`` is GPTQ everywhere, blocks of 32 but per-channel down projections. ``GRID+R``
keeps the R input rows whose inputs carry the most energy (X^T X's largest diagonal: an LLM's massive
activation channels) in float and rounds the rest, GPTQ on their own X^T X (the float rows' error is zero). ``gptq/D``
damps X^T X by D times its mean diagonal instead of fp8onnx's 1% (``gptq/0.1-pc``). ``ROUNDING~S`` multiplies
every scale by ``2^u`` (``u`` uniform in [0, 1), seed ``S``): about as precise a rounding (E4M3's relative step
repeats every power of two), another draw of where each weight meets the grid; a few seeds measure how far a
score moves from the draw alone (``gptq~1-pc;gptq~2-pc``). ``ROUNDING*N`` rounds every column on each of the
scales ``2^(k/N)`` times its amax scale (k < N) and keeps, per column, the rounding whose error ``e`` has the
least ``e^T X^T X e`` on the calibration (``gptq*8-pc+4``); ``ROUNDING^N`` picks each column's scale of the
same N before rounding, by its nearest rounding's error weighted by X^T X's diagonal (N plain roundings, no
GPTQ run per candidate). The rounding is
fp8onnx's own GPTQ algebra (``fp8onnx.techniques.gptq_rounding.gptq_round``: the ONNX path's) on the torch
model's weights; the scales are ``amax / 448`` of each channel or block; lm_head and the embedding stay float.
The ONNX ``llm-w8a8 --activations none`` model and ``gptq-blk`` here score the same target perplexity on
SmolLM2's LAMBADA items (43.92 both, 2026-12-05), so a group swapped here is a group swapped there.

Writes ``--out`` (``.npz``, ``fp8_anchor.py``'s layout: ``{set}/{variant}/{column}`` beside ``meta``), with
``fp32`` the torch model as it is; ``tests/bench/yardstick_table.py --`` renders it against ``torch fp32``.

Usage: python tests/bench/weight_grid_study.py --reference models/smollm2/model.onnx
       --tokenizer models/smollm2/tokenizer.json --calib models/smollm2/calib.npz --only lambada --lambada 300
       --variant "gptq-pc;gptq-blk;rtn-pc;rtn-blk" --out grid.npz
"""

from __future__ import annotations

import argparse
import copy
import pathlib

import numpy as np
import torch
from fp8_anchor import ROOT, load, run_windows, score_sets, sources
from llm_yardstick import machine

from fp8onnx.numerics.formats import Fp8Format, round_to_grid
from fp8onnx.techniques.gptq_rounding import gptq_round

FMT = Fp8Format.E4M3FN
BLOCK = 32
GROUPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _grid_scale(w: np.ndarray, grid: str) -> np.ndarray:
    """``w`` [K, N]'s scales: [N] per output channel, [K, N] (blocks of 32 along K, repeated) per block."""
    if grid == "pc":
        return (np.abs(w).max(axis=0) / FMT.fmax).astype(np.float32)
    k, n = w.shape
    if k % BLOCK:
        raise SystemExit(f"blocks of {BLOCK} need K divisible by {BLOCK}, got {k}")
    blocks = np.abs(w).reshape(k // BLOCK, BLOCK, n).max(axis=1) / FMT.fmax
    return np.repeat(blocks.astype(np.float32), BLOCK, axis=0)


def hessians(wrapped, linears: dict, calib: pathlib.Path, batch: int) -> dict[str, np.ndarray]:
    """X^T X (float64 sums) of every Linear's input over ``calib``'s windows."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    run_windows(wrapped, calib, batch)
    for h in handles:
        h.remove()
    return {n: v.numpy().astype(np.float32) for n, v in sums.items()}


def _rounded(w: np.ndarray, h: np.ndarray, scale: np.ndarray, rounding: str, damp: str) -> np.ndarray:
    if rounding == "rtn":
        return round_to_grid(np.clip(w / scale, -FMT.fmax, FMT.fmax), FMT) * scale
    return gptq_round(w, h, scale, FMT, **({"damp": float(damp)} if damp else {}))


def _searched(w: np.ndarray, h: np.ndarray, scale: np.ndarray, rounding: str, damp: str, n: int) -> np.ndarray:
    """``w`` rounded on each column's best of the scales ``scale * 2^(k/n)``, k < n: the one whose error
    ``e`` has the least ``e^T X^T X e`` (a column's GPTQ rounding depends on that column alone, so the
    choice is exact per column). ``n`` = 1: the given scales."""
    best, q = None, None
    for k in range(n):
        qk = _rounded(w, h, scale * np.float32(2 ** (k / n)), rounding, damp)
        e = (w - qk).astype(np.float64)
        err = np.einsum("kn,kn->n", e, h.astype(np.float64) @ e)
        if best is None:
            best, q = err, qk
        else:
            better = err < best
            best, q[:, better] = np.where(better, err, best), qk[:, better]
    return q


def _picked(w: np.ndarray, d: np.ndarray, scale: np.ndarray, n: int) -> np.ndarray:
    """Each column's scale, of ``scale * 2^(k/n)`` (k < n), whose nearest rounding has the least error
    weighted by ``d`` (X^T X's diagonal): a choice made before GPTQ, at the cost of n roundings."""
    best, out = None, scale.copy()
    for k in range(n):
        s = scale * np.float32(2 ** (k / n))
        e = w - round_to_grid(np.clip(w / s, -FMT.fmax, FMT.fmax), FMT) * s
        err = d.astype(np.float64) @ (e.astype(np.float64) ** 2)
        better = err < best if best is not None else np.ones(len(err), bool)
        best = err if best is None else np.where(better, err, best)
        out[better] = s[better]
    return out


def variant_model(pristine, linears: dict, spec: str, h: dict, cache: dict):
    """A copy of ``pristine`` with its Linears' weights rounded as ``spec`` says."""
    base, _, over = spec.partition("@")
    rounding, grid = base.split("-")
    rounding, _, damp = rounding.partition("/")  # gptq/0.1: GPTQ damped by 10% of X^T X's mean diagonal
    rounding, _, seed = rounding.partition("~")  # rtn~3: scales dithered with seed 3 (another draw of the rounding)
    rounding, _, search = rounding.partition("*")  # gptq*8: each column's scale the best of 8 on X^T X
    rounding, _, pick = rounding.partition("^")  # gptq^8: each column's scale the best of 8 for diag(X^T X), RTN
    overrides = dict(kv.split("=") for kv in over.split(",") if kv)
    model = copy.deepcopy(pristine)
    modules = dict(model.named_modules())
    for name, linear in linears.items():
        group = next(g.split("_")[0] for g in GROUPS if g in name)
        g = overrides.get(group, grid)
        if g == "float":
            continue
        key = (name, rounding, damp, seed, search, pick, g)
        if key not in cache:
            w = linear.weight.detach().numpy().T.astype(np.float32)  # [K, N]: y = x @ w
            g, _, top = g.partition("+")  # pc+2: the 2 input rows of largest X^T X diagonal kept in float
            rest = np.ones(w.shape[0], bool)
            rest[np.argsort(-np.diag(h[name]), kind="stable")[: int(top or 0)]] = False
            scale = _grid_scale(w[rest], g)
            if seed:  # each scale times 2^u, u uniform in [0, 1): E4M3's relative precision is the same at any
                # scale, so the rounding is as good, but every weight meets the grid at another place
                rng = np.random.default_rng([int(seed), list(linears).index(name)])
                scale = scale * np.exp2(rng.uniform(0, 1, scale.shape)).astype(np.float32)
            q = w.copy()
            hr = h[name][np.ix_(rest, rest)]  # the float rows' error is zero: the objective is the other rows'
            if pick:
                scale = _picked(w[rest], np.diag(hr), scale, int(pick))
            q[rest] = _searched(w[rest], hr, scale, rounding, damp, int(search or 1))
            cache[key] = torch.from_numpy(np.ascontiguousarray(q.T))
        modules[name].weight.data = cache[key]
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["smollm2", "gemma3", "qwen"], default="smollm2")
    parser.add_argument("--reference", type=pathlib.Path, required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--corpora", default=str(ROOT / "models" / "corpora"))
    parser.add_argument("--calib", type=pathlib.Path, required=True)
    parser.add_argument("--only", default="lambada")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--lambada", type=int, default=300)
    parser.add_argument("--hellaswag", type=int, default=500)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--variant", required=True, help="';'-separated ROUNDING-GRID[@GROUP=GRID,...]")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    data = sources(args, args.reference)
    pristine, wrap = load(args.family, args.reference.parent)
    linears = {n: m for n, m in pristine.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    h = hessians(wrap(pristine), linears, args.calib, 8)
    meta = {"family": args.family, "reference": str(args.reference), "calib": str(args.calib), **machine()}
    meta.update(torch=torch.__version__, threads=torch.get_num_threads(), seconds={})
    arrays: dict[str, np.ndarray] = {}
    cache: dict = {}
    for spec in ["fp32", *args.variant.split(";")]:
        model = pristine if spec == "fp32" else variant_model(pristine, linears, spec, h, cache)
        score_sets(wrap(model), data, args.batch, spec, arrays, meta, args.out)


if __name__ == "__main__":
    main()
