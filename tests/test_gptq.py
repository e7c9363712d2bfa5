"""GPTQ on the FP8 grid: the same scales, values on the grid, less output error than plain rounding."""

import itertools
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp8onnx
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.formats import Fp8Format, dequantize, quantize
from fp8onnx.pipeline import statistics
from fp8onnx.techniques.gptq import _column_blocks, _hessians, assembled
from fp8onnx.techniques.gptq_rounding import _cholesky, _inverse_lower, gptq_factor, gptq_round, ordered, round_stacked

from helpers import assert_same_model, run_ort, run_reference, sqnr_db


def correlated(rng, rows=1024, k=64):
    """Inputs that live near an 8-dimensional subspace: where GPTQ's error spreading pays."""
    base = rng.standard_normal((rows, 8))
    return (base @ rng.standard_normal((8, k)) + 0.1 * rng.standard_normal((rows, k))).astype(np.float32)


@pytest.mark.parametrize("per_channel", [False, True])
def test_gptq_rounding_is_on_the_grid_and_beats_nearest(per_channel):
    rng = np.random.default_rng(0)
    x, w = correlated(rng), rng.standard_normal((64, 32)).astype(np.float32)
    amax = np.abs(w).max(0) if per_channel else np.abs(w).max()
    scale = (amax / 448).astype(np.float32)
    nearest = dequantize(quantize(w, scale, Fp8Format.E4M3FN), scale, np.float32)
    rounded = gptq_round(w, x.T.astype(np.float64) @ x, scale, Fp8Format.E4M3FN)
    assert np.array_equal(dequantize(quantize(rounded, scale, Fp8Format.E4M3FN), scale, np.float32), rounded)
    ref = x @ w
    assert sqnr_db(ref, x @ rounded) > sqnr_db(ref, x @ nearest) + 6  # at least 4x less error power


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_act_order_rounds_high_energy_inputs_first_and_helps_with_outlier_channels(seed):
    rng = np.random.default_rng(seed)
    x = correlated(rng, k=64)
    x[:, rng.choice(64, 4, replace=False)] *= 30.0  # outlier channels, as LLM activations have
    w = rng.standard_normal((64, 32)).astype(np.float32)
    scale = (np.abs(w).max(0) / 448).astype(np.float32)
    h = x.T.astype(np.float64) @ x
    ordered = gptq_round(w, h, scale, Fp8Format.E4M3FN, act_order=True)
    plain = gptq_round(w, h, scale, Fp8Format.E4M3FN, act_order=False)
    assert np.array_equal(dequantize(quantize(ordered, scale, Fp8Format.E4M3FN), scale, np.float32), ordered)
    ref = x @ w
    assert sqnr_db(ref, x @ ordered) > sqnr_db(ref, x @ plain)
    # the permutation is undone: act-order with a diagonal H (no correlations) is nearest rounding
    nearest = dequantize(quantize(w, scale, Fp8Format.E4M3FN), scale, np.float32)
    diagonal = np.diag(rng.uniform(1, 100, 64))
    np.testing.assert_array_equal(gptq_round(w, diagonal, scale, Fp8Format.E4M3FN, act_order=True), nearest)


def test_an_input_that_is_always_zero_does_not_break_it():
    rng = np.random.default_rng(1)
    x = correlated(rng, k=16)
    x[:, 3] = 0.0
    w = rng.standard_normal((16, 4)).astype(np.float32)
    rounded = gptq_round(w, x.T.astype(np.float64) @ x, np.float32(np.abs(w).max() / 448), Fp8Format.E4M3FN)
    assert np.all(np.isfinite(rounded)) and np.all(rounded[3] == 0)


@pytest.mark.parametrize("k", [5, 64, 300, 700])
def test_the_gain_is_gptqs_inverse_factor_scaled_by_its_diagonal(k):
    """gptq_factor's gain (one Cholesky factorisation by blocks, float32) against NumPy's float64
    -U^-1 diag(U), U = cholesky(inv(H)).T the factor of GPTQ's own form; its pieces against NumPy too."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((2 * k + 50, k))
    h = x.T @ x
    order, dead, gain = gptq_factor(h.astype(np.float32), damp=0.01, act_order=True)
    damped = h[np.ix_(order, order)] + 0.01 * np.mean(np.diag(h)) * np.eye(k)
    upper = np.linalg.cholesky(np.linalg.inv(damped)).T
    expected = -np.linalg.inv(upper) * np.diag(upper)[None, :]
    assert gain.dtype == np.float32 and not dead.any() and np.array_equal(gain, np.triu(gain))
    np.testing.assert_allclose(gain, expected, rtol=0, atol=2e-4 * np.abs(expected).max())
    np.testing.assert_array_equal(np.diag(gain), -1.0)
    lower = _cholesky(damped, block=64)
    np.testing.assert_allclose(lower, np.linalg.cholesky(damped), rtol=1e-10, atol=1e-12 * np.abs(lower).max())
    np.testing.assert_allclose(_inverse_lower(lower) @ lower, np.eye(k), atol=1e-9)
    with pytest.raises(Fp8OnnxError, match="X\\^T X of layer7 is not positive definite"):
        gptq_factor(-np.eye(k, dtype=np.float32), what="layer7")


@pytest.mark.parametrize("k", [7, 512, 600, 1100, 5000])
def test_x_t_x_is_measured_by_blocks_on_and_above_the_diagonal(tmp_path, k):
    """The in-graph X^T X: column blocks of at most ~512 (at most 8 of them, covering K once), only
    the pairs on and above the diagonal computed, put together symmetric and equal to NumPy's X^T X
    over every batch (float32 sums)."""
    import onnx_ir as ir

    cols = _column_blocks(k)
    assert cols[0][0] == 0 and cols[-1][1] == k and all(a[1] == b[0] for a, b in itertools.pairwise(cols))
    assert len(cols) == min(8, -(-k // 512))
    if k > 1100:
        return  # the sizes alone: a 5000-wide X^T X is not worth a test's time
    rng = np.random.default_rng(k)
    w = rng.standard_normal((k, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 3])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    feeds = [{"x": rng.standard_normal((2, 4, k)).astype(np.float32)} for _ in range(3)]
    sums = _hessians({"x": k})
    m = ir.load(tmp_path / "m.onnx")
    statistics.measure(m, [sums], as_data(feeds, input_specs(m)), RunOptions(batch_size=2), "hessians")
    *blocks, rows = sums.value_of("x")
    assert rows.reshape(-1).tolist() == [3 * 2 * 4]  # the rows X^T X summed: 3 batches of 2 x 4
    h = assembled(blocks, k)
    x = np.concatenate([f["x"].reshape(-1, k) for f in feeds]).astype(np.float64)
    assert h.dtype == np.float32 and np.array_equal(h, h.T)  # exact: one triangle computed, mirrored
    np.testing.assert_allclose(h, x.T @ x, rtol=0, atol=1e-4 * np.abs(x.T @ x).max())


def test_nested_lazy_blocks_round_as_the_textbook_row_loop():
    """round_stacked (no inverse; nested blocks, matrix products between blocks) against GPTQ's
    textbook loop in float64 (U the upper Cholesky factor of the damped H^-1, every row's error spread
    over all later rows at once). The two sum in other orders (float32 BLAS products whose order is the
    CPU's kernel's choice), so a pick may differ where the value sits on the midpoint between two grid
    points, and the rows after it in that column then differ too (the error fed forward differs). So:
    in every column the first pick that differs is such a tie, few columns have one, and GPTQ's
    objective (the output error tr(E H E^T)) is the textbook's."""
    rng = np.random.default_rng(11)
    k, n = 300, 48
    x = correlated(rng, k=k)
    factor = gptq_factor(x.T @ x)
    w = rng.standard_normal((k, n)).astype(np.float32)
    s = (np.abs(w).max(0) / 448).astype(np.float32)
    rows, _ = ordered(w, factor, s)
    h = (x.T @ x).astype(np.float32).astype(np.float64)[np.ix_(factor[0], factor[0])]
    h[np.diag_indices(k)] += 0.01 * np.mean(np.diag(h))
    upper = np.linalg.cholesky(np.linalg.inv(h)).T
    work, expected, before = rows.astype(np.float64), np.empty((k, n)), np.empty((k, n))
    for i in range(k):
        before[i] = work[i]
        expected[i] = dequantize(quantize(work[i], s, Fp8Format.E4M3FN), s)
        work[i + 1 :] -= np.outer(upper[i, i + 1 :], (work[i] - expected[i]) / upper[i, i])
    got = round_stacked(rows[None].copy(), factor[2][None], s[None, None], Fp8Format.E4M3FN)[0]
    differ = got != expected
    # float32 work values carry about sqrt(k) roundings of |w|'s size (about 1e-6 |w| here; measured on
    # AVX-512: ties within 2.5e-6); 1e-5 |w| leaves a margin and still rejects all but 1 in ~1000 picks
    tie = 1e-5 * np.abs(w).max()
    for j in np.flatnonzero(differ.any(0)):
        i = np.argmax(differ[:, j])
        midpoint = (np.float64(got[i, j]) + expected[i, j]) / 2
        assert abs(before[i, j] - midpoint) < tie, (i, j, before[i, j], got[i, j], expected[i, j])
    assert differ.any(0).sum() <= n // 8

    def objective(q):
        e = rows.astype(np.float64) - q
        return np.einsum("ij,ik,kj->", e, h, e)

    assert objective(got) == pytest.approx(objective(expected), rel=0.01)


@pytest.mark.parametrize("blocks", [False, True])
def test_rounding_weights_as_a_stack_changes_no_bit(blocks):
    """Three weights of one shape, each with its own X^T X and scales, rounded as one stack: each
    result is bit for bit its rounding alone (same element-wise steps, same BLAS products)."""
    rng = np.random.default_rng(3)
    k, n = 300, 40
    ws, factors, scales = [], [], []
    for _ in range(3):
        w = rng.standard_normal((k, n)).astype(np.float32)
        s = np.repeat(np.abs(w).reshape(10, 30, n).max(1) / 448, 30, axis=0) if blocks else np.abs(w).max(0) / 448
        ws.append(w)
        x = correlated(rng, k=k)
        factors.append(gptq_factor(x.T @ x))
        scales.append(s.astype(np.float32))
    alone = [gptq_round(w, f, s, Fp8Format.E4M3FN) for w, f, s in zip(ws, factors, scales)]
    prepared = [ordered(w, f, s) for w, f, s in zip(ws, factors, scales)]
    stacked = round_stacked(
        np.stack([r for r, _ in prepared]),
        np.stack([f[2] for f in factors]),
        np.stack([s for _, s in prepared]),
        Fp8Format.E4M3FN,
    )
    for q, f, expected in zip(stacked, factors, alone):
        out = np.empty_like(q)
        out[f[0]] = q
        np.testing.assert_array_equal(out, expected)


def two_layers(path, rng):
    w1, w2 = (
        (rng.standard_normal((64, 64)) / 8).astype(np.float32),
        (rng.standard_normal((64, 16)) / 8).astype(np.float32),
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("Gemm", ["h", "w2t"], ["y"], name="gemm2", transB=1),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2.T.copy(), "w2t")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


@pytest.mark.parametrize("activations", ["static", "none", "dynamic-per-token"])
def test_quantize_with_gptq_has_less_error_on_held_out_inputs(tmp_path, activations):
    rng = np.random.default_rng(2)
    path = two_layers(tmp_path / "m.onnx", rng)
    x = correlated(rng, rows=512)
    np.savez(tmp_path / "calib.npz", x=x[:256])
    held_out = {"x": x[256:]}
    ref = run_ort(path, held_out)[0]
    got = {}
    for rounding in ("nearest", "gptq"):
        calib = tmp_path / "calib.npz" if activations == "static" or rounding == "gptq" else None
        report = fp8onnx.quantize(
            path,
            tmp_path / f"{rounding}.onnx",
            calib,
            activations=activations,
            weight_rounding=rounding,
            provider="cpu",
        )
        got[rounding] = run_ort(tmp_path / f"{rounding}.onnx", held_out)[0]
    assert any("GPTQ rounding of 2 weights" in p for p in report.prepared)
    assert report.config["weight_rounding"] == "gptq"
    assert sqnr_db(ref, got["gptq"]) > sqnr_db(ref, got["nearest"]) + 1
    assert np.allclose(run_reference(tmp_path / "gptq.onnx", held_out)[0], got["gptq"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rows", [256, 1024])
def test_too_few_calibration_rows_for_gptq_are_said(tmp_path, caplog, monkeypatch, rows):
    """One warning, naming the input and its rows per channel, below 16 rows a channel (K = 64 here); once
    a process for the same input and rows (an accuracy search rounds every candidate alike)."""
    monkeypatch.setattr(sys.modules["fp8onnx.techniques.gptq"], "_WARNED", set())
    rng = np.random.default_rng(4)
    path = two_layers(tmp_path / "m.onnx", rng)
    np.savez(tmp_path / "calib.npz", x=correlated(rng, rows=rows))
    with caplog.at_level("WARNING", logger="fp8onnx"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", tmp_path / "calib.npz", activations="none", weight_rounding="gptq")
    said = [r.getMessage() for r in caplog.records if "rows of its" in r.getMessage()]
    if rows < 16 * 64:
        assert len(said) == 1 and f"sums {rows} rows of its 64 channels (4.0 a channel)" in said[0]
    else:
        assert said == []
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp8onnx"):
        fp8onnx.quantize(path, tmp_path / "r.onnx", tmp_path / "calib.npz", activations="none", weight_rounding="gptq")
    assert not [r for r in caplog.records if "rows of its" in r.getMessage()]  # said once


def test_gptq_needs_calibration_data(tmp_path):
    path = two_layers(tmp_path / "m.onnx", np.random.default_rng(3))
    with pytest.raises(Fp8OnnxError, match="--weight-rounding gptq needs --calib DATA"):
        fp8onnx.quantize(path, tmp_path / "q.onnx", activations="none", weight_rounding="gptq", provider="cpu")


def test_layer_by_layer_gives_the_same_model(tmp_path):
    """Above the weight budget X^T X is collected segment by segment: the same rounding, byte for byte."""
    rng = np.random.default_rng(4)
    path = two_layers(tmp_path / "m.onnx", rng)
    np.savez(tmp_path / "calib.npz", x=correlated(rng, rows=256))
    options = {"activations": "none", "weight_rounding": "gptq", "provider": "cpu"}
    whole = fp8onnx.quantize(path, tmp_path / "whole.onnx", tmp_path / "calib.npz", **options)
    parts = fp8onnx.quantize(path, tmp_path / "parts.onnx", tmp_path / "calib.npz", weight_memory=1, **options)
    assert whole.prepared == parts.prepared
    # X^T X from the whole graph's and the segments' runs: equal up to onnxruntime's last bits, which
    # may flip a rounding tie (SPEC §11); on this project's machines the files were byte-identical
    assert_same_model(tmp_path / "whole.onnx", tmp_path / "parts.onnx")
