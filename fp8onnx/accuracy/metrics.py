"""What ``compare`` measures, batch by batch: per-output statistics (cosine, relative L2, maximum
absolute error, top-1 agreement), task accuracy and perplexity from labels, and which outputs are
class scores. The criteria: the FP8 LLM paper's >= 99.5% of FP16 (``LLM_RATIO``) and the PTQ
paper's 1% relative loss (``PTQ_REL_LOSS``).

Beside the running totals, every sum is also kept per sample (a sample: one index of the outputs'
first axis; a language model's window), so that each figure comes with its noise: :func:`paired_se`
is the jackknife standard error over samples of any statistic of those sums, paired when the
statistic reads two models' sums on the same samples (SPEC §12). Tokens of one window are not
independent draws, so the window, not the token, is the unit."""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError

# A task's scored positions, fed to models trimmed to them (accuracy.scored_positions): [batch, scored, 1]
POSITIONS = "fp8onnx_scored_positions"

logger = logging.getLogger(__name__)

LLM_RATIO = 0.995  # FP8 within 99.5% of FP16 (FP8 LLM paper)


PTQ_REL_LOSS = 0.01  # within 1% relative loss (PTQ paper)


_LOGITS_NAME = re.compile(r"logit|score|prob|class", re.IGNORECASE)


@dataclasses.dataclass
class _OutputStats:
    rows: int = 0
    cos_sum: float = 0.0
    cos_min: float = 1.0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs: float = 0.0
    top1_hits: int = 0
    top1_rows: int = 0
    nonfinite: int = 0  # rows of the candidate holding an inf or a NaN (a float16 overflow, say)
    # per sample: cosine sum, rows, squared error, reference energy, top-1 hits, top-1 rows (OUTPUT_COLUMNS)
    per_sample: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)

    def update(self, ref: np.ndarray, out: np.ndarray, logits: bool, keep: np.ndarray | None = None) -> None:
        """Add one batch. ``keep``: which rows count (False: a padded position of a [batch, seq, width]
        output, whose values mean nothing); None: every row."""
        if ref.shape != out.shape:
            raise Fp8OnnxError(f"Output shapes differ: reference {ref.shape}, candidate {out.shape}.")
        r = ref.reshape(-1, ref.shape[-1] if ref.ndim else 1)
        cos, err, energy, peak, hits, bad = _row_stats(r, out.reshape(r.shape), logits)
        weight = np.ones(len(cos))
        if keep is not None and keep.size == len(cos) and not keep.all():
            weight = keep.reshape(-1).astype(np.float64)
            cos, err, energy, hits = cos * weight, err * weight, energy * weight, hits & keep.reshape(-1)
            peak = np.where(weight > 0, peak, 0.0)
        kept = weight > 0
        self.rows += int(kept.sum())
        self.nonfinite += int((bad & kept).sum())
        self.cos_sum += float(cos.sum())
        self.cos_min = min(self.cos_min, float(cos[kept].min())) if kept.any() else self.cos_min
        self.err_sq += float(np.nansum(err))
        self.ref_sq += float(energy.sum())
        peak = peak[~np.isnan(peak)]  # an all-NaN row (an overflowed candidate's) has no difference to show
        self.max_abs = max(self.max_abs, float(peak.max()) if peak.size else 0.0)
        if logits:
            self.top1_hits += int(hits.sum())
            self.top1_rows += int(kept.sum())
        if len(cos):
            columns = (cos, weight, err, energy, hits, float(logits) * weight)
            self.per_sample.append(_by_sample(np.stack(np.broadcast_arrays(*columns), axis=1), samples_of(ref)))

    def merge(self, other: _OutputStats) -> None:
        """Add another batch's sums (in batch order: the same floats as one running update)."""
        self.rows += other.rows
        self.cos_sum += other.cos_sum
        self.cos_min = min(self.cos_min, other.cos_min)
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq
        self.max_abs = max(self.max_abs, other.max_abs)
        self.top1_hits += other.top1_hits
        self.top1_rows += other.top1_rows
        self.nonfinite += other.nonfinite
        self.per_sample.extend(other.per_sample)

    def columns(self) -> dict[str, np.ndarray]:
        """Each per-sample sum over all batches so far, by name (OUTPUT_COLUMNS)."""
        return _columns(self.per_sample, OUTPUT_COLUMNS)

    def to_json(self) -> dict:
        return {
            "cosine_mean": self.cos_sum / self.rows if self.rows else None,
            "cosine_min": self.cos_min if self.rows else None,
            "rel_l2": float(np.sqrt(self.err_sq / self.ref_sq)) if self.ref_sq else None,
            "max_abs_err": self.max_abs,
            "top1_agreement": self.top1_hits / self.top1_rows if self.top1_rows else None,
            "nonfinite_rows": self.nonfinite,
        }


@dataclasses.dataclass
class _Score:
    """One model's sums over its batches, or one batch's: per-output statistics, and with labels the
    correct predictions and the summed cross-entropy."""

    outputs: dict[str, _OutputStats]
    correct: int = 0
    nll: float = 0.0
    # per sample with labels: correct predictions, labelled positions, cross-entropy (LABEL_COLUMNS)
    per_sample: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)

    def merge(self, other: _Score) -> None:
        for o, stats in self.outputs.items():
            stats.merge(other.outputs[o])
        self.correct += other.correct
        self.nll += other.nll
        self.per_sample.extend(other.per_sample)

    def columns(self, output: str) -> dict[str, np.ndarray]:
        """The per-sample sums of ``output`` and, with labels, of the task: one entry per sample."""
        return {**self.outputs[output].columns(), **_columns(self.per_sample, LABEL_COLUMNS)}


ROW_CHUNK = 1 << 22  # elements of one float64 slice of the outputs (32 MiB): a 262k-token vocabulary's logits
# at 4 x 512 positions are 4 GB as float64, and the statistics took several such copies at once


def _row_stats(ref: np.ndarray, out: np.ndarray, logits: bool):
    """Per row of two [rows, width] outputs, in float64, a bounded slice at a time: cosine (1 where both
    are zero, 0 where undefined), squared error (NaN-skipping), reference energy, largest absolute
    difference (NaN-skipping; NaN for an all-NaN row), top-1 agreement (False unless ``logits``) and whether
    the candidate's row holds an inf or a NaN."""
    rows = ref.shape[0]
    cos, err, energy, peak = (np.empty(rows) for _ in range(4))
    hits, bad = np.zeros(rows, bool), np.zeros(rows, bool)
    step = max(1, ROW_CHUNK // max(1, ref.shape[1]))
    for s in range(0, rows, step):
        r, c = ref[s : s + step].astype(np.float64), out[s : s + step].astype(np.float64)
        nr, nc = np.linalg.norm(r, axis=1), np.linalg.norm(c, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            part = np.where((nr == 0) & (nc == 0), 1.0, (r * c).sum(axis=1) / (nr * nc))
        cos[s : s + step] = np.nan_to_num(part, nan=0.0)
        bad[s : s + step] = ~np.isfinite(nc)  # float64 sums of squares of float32 values do not overflow
        diff = c - r
        err[s : s + step] = np.nansum(diff * diff, axis=1)
        energy[s : s + step] = (r * r).sum(axis=1)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN row: NaN, skipped by the caller's nanmax
            peak[s : s + step] = np.nanmax(np.abs(diff), axis=1) if diff.shape[1] else 0.0
        if logits:
            hits[s : s + step] = r.argmax(axis=1) == c.argmax(axis=1)
    return cos, err, energy, peak, hits, bad


def _score(
    ref: list[np.ndarray], outs: list[np.ndarray], out_names, labels, label_out, classes=frozenset(), feed=None
) -> _Score:
    """One batch's score; ``feed``'s ``attention_mask`` (when it has one) takes padded positions out of the
    per-row statistics of outputs shaped [batch, seq, ...]."""
    score = _Score({o: _OutputStats() for o in out_names})
    for o, r, c in zip(out_names, ref, outs):
        score.outputs[o].update(r, c, _looks_like_logits(o, r.shape, labels, classes), _rows_kept(feed, r))
    if label_out is not None:
        scored = labels >= 0  # a negative label marks a position not scored (padding, a sequence's end)
        hit = (outs[label_out].argmax(axis=-1) == labels) & scored
        nll = _nll(outs[label_out], labels)
        score.correct, score.nll = int(hit.sum()), float(nll.sum())
        samples = samples_of(outs[label_out])
        columns = np.stack([hit.reshape(-1), scored.reshape(-1), nll], axis=1).astype(np.float64)
        score.per_sample.append(_by_sample(columns, samples))
    return score


def _rows_kept(feed: dict | None, output: np.ndarray) -> np.ndarray | None:
    """The attended positions of a [batch, seq, width] output (the mask's last ``seq`` columns: a KV
    cache's mask covers the past too), or None where the feed has no such mask."""
    scored = None if feed is None else feed.get(POSITIONS)
    if scored is not None and output.ndim == 3 and output.shape[:2] == scored.shape[:2]:
        return scored[..., 0] >= 0  # a task's scored positions (accuracy.scored_positions): -1 pads
    mask = None if feed is None else feed.get("attention_mask")
    if mask is None or output.ndim != 3:
        return None
    mask = np.asarray(mask)
    if mask.ndim != 2 or mask.shape[0] != output.shape[0] or mask.shape[1] < output.shape[1]:
        return None
    return mask[:, mask.shape[1] - output.shape[1] :].astype(bool)


OUTPUT_COLUMNS = ("cos", "rows", "err_sq", "ref_sq", "top1_hits", "top1_rows")
LABEL_COLUMNS = ("correct", "labelled", "nll")


def samples_of(output: np.ndarray) -> int:
    """How many samples one batch's ``output`` holds: its first axis (one window of a language model,
    one image); a 0-d or 1-d output is one sample."""
    return int(output.shape[0]) if output.ndim >= 2 else 1


def _by_sample(columns: np.ndarray, samples: int) -> np.ndarray:
    """Per-row columns [rows, k] summed into [samples, k]: each sample's rows are consecutive."""
    if samples == 0:
        return np.zeros((0, columns.shape[1]))
    return columns.reshape(samples, -1, columns.shape[1]).sum(axis=1)


def _columns(parts: list[np.ndarray], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    if not parts:
        return {}
    joined = np.concatenate(parts)
    return {n: joined[:, i] for i, n in enumerate(names)}


# Each statistic compare reports, as a function of per-sample column sums (arrays broadcast: the
# jackknife evaluates them for every left-out sample at once).
STATISTICS = {
    "accuracy": (("correct", "labelled"), lambda c, n: c / n),
    "perplexity": (("nll", "labelled"), lambda nll, n: np.exp(nll / n)),
    "top1": (("top1_hits", "top1_rows"), lambda h, n: h / n),
    "cosine": (("cos", "rows"), lambda c, n: c / n),
    "rel-l2": (("err_sq", "ref_sq"), lambda e, r: 1.0 - np.sqrt(e / r)),
}


def paired_se(statistic, *columns: np.ndarray) -> float | None:
    """One standard error of ``statistic(*sums)`` by the jackknife over samples: ``columns`` hold one
    per-sample sum each, all over the same samples, and ``statistic`` maps their totals to a number
    (broadcasting). A statistic of two models' columns (a difference, a ratio) is paired: what the
    models share sample by sample cancels. None with fewer than 2 samples, or where the statistic is
    not finite for some left-out sample (nothing labelled without it)."""
    m = len(columns[0]) if columns else 0
    if m < 2 or any(len(c) != m for c in columns):
        return None
    left_out = [c.sum() - c for c in columns]
    with np.errstate(all="ignore"):
        values = np.asarray(statistic(*left_out), dtype=np.float64)
    if not np.all(np.isfinite(values)):
        return None
    return float(np.sqrt((m - 1) / m * np.sum((values - values.mean()) ** 2)))


def difference_se(kind: str, model: dict[str, np.ndarray], base: dict[str, np.ndarray], ratio: bool = False):
    """One standard error of a statistic (``STATISTICS[kind]``) of ``model`` minus (or, with
    ``ratio``, over) the same statistic of ``base``, paired over their samples; None where either
    lacks the columns."""
    names, fn = STATISTICS[kind]
    if any(n not in model or n not in base for n in names):
        return None
    k = len(names)

    def pair(*sums):
        a, b = fn(*sums[:k]), fn(*sums[k:])
        return a / b if ratio else a - b

    return paired_se(pair, *(model[n] for n in names), *(base[n] for n in names))


def gain_se(kind: str, model: dict, other: dict, base: dict) -> float | None:
    """One standard error of ``model``'s ratio to ``base`` minus ``other``'s (the gain of one variant
    over another, in fractions of FP16's metric), paired over the three models' samples."""
    names, fn = STATISTICS[kind]
    if any(n not in d for n in names for d in (model, other, base)):
        return None
    k = len(names)

    def gain(*sums):
        b = fn(*sums[2 * k :])
        return fn(*sums[:k]) / b - fn(*sums[k : 2 * k]) / b

    return paired_se(gain, *(d[n] for d in (model, other, base) for n in names))


def samples_needed(samples: int, se: float | None, gap: float, z: float) -> int | None:
    """How many samples would bring ``z`` standard errors below ``gap`` (SE falls as one over the
    square root of the samples): the data a difference of ``gap`` needs to be told from noise."""
    if se is None or gap <= 0 or samples <= 0:
        return None
    return int(np.ceil(samples * (z * se / gap) ** 2))


def labelled(labels: np.ndarray | None) -> int:
    """How many positions ``labels`` scores (negative labels are not scored)."""
    return 0 if labels is None else int((np.asarray(labels) >= 0).sum())


def next_token_labels(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """A causal language model's labels from its own input: at each position the next token, where both
    positions are attended (``mask``'s last ``seq`` columns: a KV cache's mask covers the past too);
    -1 (not scored) at padding and at each row's last position."""
    ids = np.asarray(ids)
    labels = np.full(ids.shape, -1, np.int64)
    labels[..., :-1] = ids[..., 1:]
    if mask is not None:
        mask = np.asarray(mask)[..., -ids.shape[-1] :].astype(bool)
        keep = np.zeros(ids.shape, bool)
        keep[..., :-1] = mask[..., :-1] & mask[..., 1:]
        labels[~keep] = -1
    return labels


def _looks_like_logits(name: str, shape: tuple, labels: np.ndarray | None, classes=frozenset()) -> bool:
    """Whether top-1 agreement is measured on this output: class scores by their labels, their name, a
    Softmax computing them, or ``--metric top1`` (``classes``)."""
    if len(shape) < 2 or shape[-1] < 2:
        return False
    if name in classes or (labels is not None and tuple(labels.shape) == tuple(shape[:-1])):
        return True
    return bool(_LOGITS_NAME.search(name))


METRICS = ("auto", "accuracy", "top1", "cosine", "rel-l2")


_PASS_THROUGH = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose")


def class_outputs(model) -> frozenset[str]:
    """Class scores: outputs computed by a Softmax/LogSoftmax/Sigmoid (or a softmax written out as
    Div(Exp(...), ...)), through reshapes and casts, and
    2-D ``[batch, classes]`` outputs of a linear head (a MatMul/Gemm, its bias Add included), whatever
    the model's family. A pooled or normalized embedding (ReduceMean, Div, Tanh last) is not one."""
    found = set()
    for value in model.graph.outputs:
        node = value.producer()
        while node is not None and node.op_type in _PASS_THROUGH and node.inputs and node.inputs[0] is not None:
            node = node.inputs[0].producer()
        if node is not None and (node.op_type in ("Softmax", "LogSoftmax", "Sigmoid") or _softmax_by_hand(node)):
            found.add(value.name)
        elif node is not None and _two_d(value) and _linear_head(node):
            found.add(value.name)
    return frozenset(found)


def _softmax_by_hand(node) -> bool:
    """Div(Exp(x - max), ReduceSum(...)): a softmax spelled out (jax2tf and tf2onnx write it so)."""
    if node.op_type != "Div" or not node.inputs or node.inputs[0] is None:
        return False
    numerator = node.inputs[0].producer()
    return numerator is not None and numerator.op_type == "Exp"


def _two_d(value) -> bool:
    shape = value.shape
    return shape is not None and len(shape) == 2 and (not isinstance(shape[-1], int) or shape[-1] >= 2)


def _linear_head(node) -> bool:
    if node.op_type == "Add":  # a bias added after the MatMul
        producers = [v.producer() for v in node.inputs if v is not None and v.const_value is None]
        node = producers[0] if len(producers) == 1 else None
    return node is not None and node.op_type in ("MatMul", "Gemm")


def _label_output(ref: list[np.ndarray], out_names: list[str], labels: np.ndarray | None) -> int | None:
    """Index of the output the labels score (its leading shape is theirs), or None without labels."""
    if labels is None:
        return None
    found = next((i for i, r in enumerate(ref) if r.ndim >= 2 and r.shape[:-1] == labels.shape), None)
    if found is None:
        raise Fp8OnnxError(
            f"Data 'labels' of shape {labels.shape} match no output's leading shape "
            f"({', '.join(f'{n} {r.shape}' for n, r in zip(out_names, ref))})."
        )
    return found


def _to_json(stats: dict) -> dict:
    return {o: s.to_json() for o, s in stats.items()}


def _nll(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[label] at every position of ``labels`` (0 where not scored; all NaN where
    the labels are not class indices of this output), float64."""
    x = logits.reshape(-1, logits.shape[-1])
    y = labels.reshape(-1).astype(np.int64)
    out = np.zeros(len(y))
    where = np.flatnonzero(y >= 0)  # a negative label: a position not scored
    if where.size and y[where].max() >= x.shape[-1]:
        return np.full(len(y), np.nan)
    step = max(1, ROW_CHUNK // max(1, x.shape[-1]))  # a bounded float32 copy at a time: 16 rows of a 262k vocabulary
    for s in range(0, len(where), step):
        rows = where[s : s + step]
        part = x[rows].astype(np.float32)
        peak = part.max(axis=-1, keepdims=True)
        logz = np.log(np.exp(part - peak).sum(axis=-1, dtype=np.float64)) + peak[:, 0]
        out[rows] = logz - part[np.arange(len(part)), y[rows]]
    return out


def _perplexity(nll: float, labelled: int) -> float | None:
    return float(np.exp(nll / labelled)) if labelled and np.isfinite(nll) else None


def _accuracy(correct: int, labelled: int) -> float | None:
    return correct / labelled if labelled else None
