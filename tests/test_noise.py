"""Numbers with their noise (SPEC §12): the jackknife over samples behind every ± that compare, the
accuracy search and the docs print. Exact checks of what fp8onnx computes itself (NumPy only)."""

from __future__ import annotations

import numpy as np
import pytest

from fp8onnx.accuracy.metrics import _score, difference_se, paired_se, samples_needed


def test_the_jackknife_of_a_mean_is_the_textbook_standard_error():
    x = np.random.default_rng(0).standard_normal(50)
    assert paired_se(lambda s: s / 49.0, x) == pytest.approx(x.std(ddof=1) / np.sqrt(50), rel=1e-9)
    assert paired_se(lambda s: s, np.ones(1)) is None  # one sample: no estimate


def test_a_ratio_of_sums_matches_the_delta_method():
    rng = np.random.default_rng(1)
    n = rng.integers(50, 150, 400).astype(float)  # labelled positions per window
    c = rng.binomial(n.astype(int), 0.4).astype(float)
    r = c.sum() / n.sum()
    delta = np.sqrt(np.sum((c - r * n) ** 2)) / n.sum()  # linearised ratio estimator
    assert paired_se(lambda a, b: a / b, c, n) == pytest.approx(delta, rel=0.02)


def test_windows_not_tokens_are_the_unit():
    """Tokens of one window move together: when FP8 flips whole windows, the per-window standard error
    is about sqrt(tokens per window) larger than a per-token (McNemar-style) one would say."""
    rng = np.random.default_rng(2)
    windows, tokens = 40, 100
    ref = rng.random((windows, tokens)) < 0.4
    flip = rng.random(windows) < 0.3  # whole windows lose 20% of their hits
    cand = ref & ~((rng.random((windows, tokens)) < 0.2) & flip[:, None])
    labelled = np.full(windows, float(tokens))
    model = {"correct": cand.sum(1).astype(float), "labelled": labelled}
    base = {"correct": ref.sum(1).astype(float), "labelled": labelled}
    se = difference_se("accuracy", model, base)
    per_token = np.sqrt((cand != ref).sum()) / cand.size
    assert se > 2 * per_token


def test_pairing_cancels_what_the_models_share():
    rng = np.random.default_rng(3)
    hard = rng.random((30, 64)) < 0.5  # the samples' own difficulty dominates
    cand = hard.copy()
    cand[0, :3] = ~cand[0, :3]
    labelled = np.full(30, 64.0)
    a = {"correct": cand.sum(1).astype(float), "labelled": labelled}
    b = {"correct": hard.sum(1).astype(float), "labelled": labelled}
    paired = difference_se("accuracy", a, b)
    alone = paired_se(lambda c, n: c / n, a["correct"], labelled)
    assert paired < alone / 5
    assert difference_se("accuracy", a, a) == 0.0
    assert difference_se("top1", a, b) is None  # columns the statistic needs are missing


def test_samples_needed_to_resolve_a_gap():
    # SE 0.007 on 24 windows; a gap of 0.005 at 2 SE needs (2 * 0.007 / 0.005)^2 = 7.84 times the data
    assert samples_needed(24, 0.007, 0.005, 2.0) == 189
    assert samples_needed(24, None, 0.005, 2.0) is None and samples_needed(24, 0.01, 0.0, 2.0) is None


def test_per_sample_sums_add_up_to_the_totals():
    rng = np.random.default_rng(4)
    ref = rng.standard_normal((3, 5, 7)).astype(np.float32)  # 3 windows of 5 positions over 7 classes
    out = ref + 0.3 * rng.standard_normal(ref.shape).astype(np.float32)
    labels = rng.integers(0, 7, (3, 5))
    labels[1, 2] = -1  # not scored
    score = _score([ref], [out], ["logits"], labels, 0)
    cols = score.columns("logits")
    assert set(cols) >= {"cos", "rows", "top1_hits", "correct", "labelled", "nll"} and len(cols["cos"]) == 3
    stats = score.outputs["logits"]
    assert cols["rows"].sum() == stats.rows == 15 and cols["top1_hits"].sum() == stats.top1_hits
    assert cols["cos"].sum() == pytest.approx(stats.cos_sum) and cols["correct"].sum() == score.correct
    assert list(cols["labelled"]) == [5, 4, 5] and cols["nll"].sum() == pytest.approx(score.nll)
    empty = _score([ref[:0]], [out[:0]], ["logits"], None, None)  # a 0-length batch adds no sample
    assert len(empty.columns("logits").get("cos", [])) == 0


def test_the_held_out_part_is_every_third_sample_and_the_parts_are_disjoint():
    from fp8onnx.data.feeds import Batch
    from fp8onnx.data.split import Part, count_samples

    class Source:
        def batches(self, batch_size):
            ids = np.arange(10)
            for s in range(0, 10, batch_size):
                yield Batch({"x": ids[s : s + batch_size, None] * np.ones((1, 4), np.int64)}, ids[s : s + batch_size])
            yield Batch({"x": np.asarray(99)})  # one feed with no batch axis: one sample, not cut

    def seen(part, size):
        return [int(v) for b in part.batches(size) for v in (b.labels if b.labels is not None else [b.feed["x"]])]

    for size in (1, 3, 4, 16):
        held, rest = seen(Part(Source(), held_out=True), size), seen(Part(Source(), held_out=False), size)
        assert held == [2, 5, 8] and rest == [0, 1, 3, 4, 6, 7, 9, 99]
    assert count_samples(Source(), 4) == 11


def test_a_spread_takes_few_samples_from_all_over_the_data_each_once():
    """requires: a source read the same way twice; ensures: Spread's samples sit at evenly spaced positions
    over all of it, the first few already spread (not the first windows, often one document), each once,
    in batches of one shape up to the size asked; a feed that cannot be cut is one sample, alone."""
    from fp8onnx.data.feeds import Batch
    from fp8onnx.data.split import Spread

    class Source:
        def __init__(self, n, tail=False):
            self.n, self.tail = n, tail

        def batches(self, batch_size):
            ids = np.arange(self.n)
            for s in range(0, self.n, batch_size):
                x = ids[s : s + batch_size, None] * np.ones((1, 4), np.int64)
                yield Batch({"x": x}, ids[s : s + batch_size])
            if self.tail:
                yield Batch({"x": np.asarray(99)})

    for size in (1, 3, 16):
        got = list(Spread(Source(256), 64).batches(size))
        order = [int(v) for b in got for v in b.labels]
        assert order[:4] == [0, 130, 65, 194] and len(order) == len(set(order)) == 64
        assert sorted(order) == np.linspace(0, 255, 64).round().astype(int).tolist()
        assert all(b.size <= size and (b.feed["x"][:, 0] == b.labels).all() for b in got)
    assert [int(v) for b in Spread(Source(3), 64).batches(4) for v in b.labels] == [0, 2, 1]  # fewer: all of them
    whole = list(Spread(Source(4, tail=True), 64).batches(8))  # 5 samples: the last one a feed with no batch axis
    assert [b.size for b in whole] == [1, 1, 3] and whole[1].labels is None  # 0 | the uncut feed | 2, 1, 3
    assert whole[2].labels.tolist() == [2, 1, 3]
    assert not list(Spread(Source(0), 64).batches(4))


def test_padded_positions_leave_the_row_statistics():
    """A task's items padded to one length: the padded positions' outputs mean nothing (the mask hides
    them), so cosine, top-1 agreement, errors and the per-sample rows count only attended positions."""
    rng = np.random.default_rng(5)
    ref = rng.standard_normal((2, 4, 6)).astype(np.float32)
    out = ref + 0.01 * rng.standard_normal(ref.shape).astype(np.float32)
    mask = np.ones((2, 4), np.int64)
    mask[1, 2:] = 0  # item 1: two padded positions, where the candidate says the opposite
    out[1, 2:] = -ref[1, 2:]
    padded = _score([ref], [out], ["logits"], None, None, feed={"attention_mask": mask})
    stats, cols = padded.outputs["logits"], padded.columns("logits")
    assert stats.rows == 6 and list(cols["rows"]) == [4, 2] and list(cols["top1_rows"]) == [4, 2]
    assert stats.cos_min > 0.99 and stats.top1_hits == stats.top1_rows == 6
    assert stats.max_abs < 0.1 and cols["cos"].sum() == pytest.approx(stats.cos_sum)
    unmasked = _score([ref], [out], ["logits"], None, None).outputs["logits"]
    assert unmasked.rows == 8 and unmasked.cos_min < -0.99  # what the padded rows did before
    # a KV cache's mask covers past and present: its last seq columns are the outputs' positions
    past = np.concatenate([np.ones((2, 3), np.int64), mask], axis=1)
    assert _score([ref], [out], ["logits"], None, None, feed={"attention_mask": past}).outputs["logits"].rows == 6
    full = _score([ref], [out], ["logits"], None, None, feed={"attention_mask": np.ones((2, 4), np.int64)})
    assert full.outputs["logits"].rows == 8  # nothing padded: every row, as before
