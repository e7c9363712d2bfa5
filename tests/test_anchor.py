"""The torch FP8-dynamic anchor (tests/bench/fp8_anchor.py) and fp8onnx's per-token recipe are the same
arithmetic: on a small torch block exported by torch, fp8onnx's graph (per-channel E4M3 weights rounded to
nearest, per-token dynamic E4M3 activations) and the anchor's fake quantization agree far more closely than
either agrees with the float model, and the anchor's static recipe reads its calibration's amax.

requires: torch; ensures: a gap between the anchor and ``--preset llm`` on a real model is not the harness."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import onnxruntime as ort
import pytest

import fp8onnx

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "bench"))
fp8_anchor = pytest.importorskip("fp8_anchor")


class Block(torch.nn.Module):
    """A Llama-style block's projections, named as the anchor finds them."""

    def __init__(self, width: int = 64, hidden: int = 160):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_proj = torch.nn.Linear(width, width, bias=False)
        self.o_proj = torch.nn.Linear(width, width, bias=False)
        self.gate_proj = torch.nn.Linear(width, hidden, bias=False)
        self.up_proj = torch.nn.Linear(width, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, width, bias=False)
        for lin in (self.q_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) / lin.in_features**0.5
            # a few outlier channels, as trained LLMs have: per-channel and per-token scales must matter
            lin.weight.data[:3] *= 20

    def forward(self, x):
        h = x + self.o_proj(torch.tanh(self.q_proj(x)))
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_anchor_and_fp8onnx_per_token_recipe_compute_the_same_numbers(tmp_path):
    block = Block().eval()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 64)).astype(np.float32)
    x[:, 0] *= 30  # one token far larger than the others (an attention sink's row)
    path = tmp_path / "block.onnx"
    with torch.no_grad():
        torch.onnx.export(
            block,
            (torch.from_numpy(x),),
            str(path),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "b", 1: "s"}},
            opset_version=17,
            dynamo=False,
        )
        ref = block(torch.from_numpy(x)).numpy()
    out = tmp_path / "block.fp8.onnx"
    fp8onnx.quantize(
        path,
        out,
        preset="none",
        activations="dynamic-per-token",
        per_channel=True,
        weight_rounding="nearest",
    )
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    fakes = fp8_anchor.quantized(block, "fp8-dynamic", set(fp8_anchor.GROUPS), set(fp8_anchor.GROUPS))
    assert len(fakes) == 5
    with torch.no_grad():
        anchor = block(torch.from_numpy(x)).numpy()
    quant_error = _rel(anchor, ref)
    assert 1e-3 < quant_error < 0.1  # FP8 moved the output, by what E4M3 rounding moves it
    # Same arithmetic: only the last bits of float32 sums (and an amax * 1/448 one ulp off amax / 448) differ.
    # onnxruntime's and torch's GEMMs differ in the last bits across CPUs (SPEC 11): a tolerance, not bits.
    assert _rel(got, anchor) < 0.02 * quant_error


def test_the_static_recipe_takes_its_scale_from_the_calibration_amax(tmp_path):
    block = Block().eval()
    fakes = fp8_anchor.quantized(block, "w8a8-static", {"down"}, set())
    assert [f.activations for f in fakes.values()].count("static") == 1
    for f in fakes.values():
        f.observing = True
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        block(x)
        for f in fakes.values():
            f.observing = False
        down = fakes["down_proj"]
        # the down projection saw the block's hidden activations: its amax is theirs; float weights
        h = x + block.o_proj(torch.tanh(block.q_proj(x)))
        hidden = torch.nn.functional.silu(block.gate_proj(h)) * block.up_proj(h)
        assert torch.isclose(down.amax, hidden.abs().max())
        y = down(hidden)
    scale = hidden.abs().max() / 448
    assert torch.equal(y, torch.nn.functional.linear(fp8_anchor.e4m3(hidden, scale), down.weight))
    assert not torch.equal(y, torch.nn.functional.linear(hidden, down.weight))


def test_kept_channels_pass_in_float_and_leave_the_scales(tmp_path):
    """``RECIPE+R``: the R input channels of largest calibration amax pass in float (inputs and weight
    columns); the static amax and the weights' channel scales are the other channels'. Single projections
    (``q``) and groups (``qkv``) name the same Linears."""
    assert fp8_anchor._groups("q+down") == {"q_proj", "down_proj"}
    assert fp8_anchor._groups("qkv") == {"q_proj", "k_proj", "v_proj"}
    block = Block().eval()
    fakes = fp8_anchor.quantized(block, "w8a8-static", {"q"}, {"q"})
    q = fakes["q_proj"]
    x = torch.randn(4, 6, 64)
    x[..., 5] = 40 + torch.randn(4, 6)  # a massive channel
    q.observing = True
    with torch.no_grad():
        q(x)
    q.observing = False
    q.keep_float(1)
    assert q.kept.nonzero().flatten().tolist() == [5]
    assert torch.isclose(q.amax, x[..., [i for i in range(64) if i != 5]].abs().max())
    assert torch.equal(q.weight[:, 5], q.float_weight[:, 5])  # the kept column is the float weight's
    with torch.no_grad():
        exact = torch.nn.functional.linear(x, q.float_weight)
        kept = _rel(q(x).numpy(), exact.numpy())
        q.kept, q.amax = None, x.abs().max()
        q.weight = fp8_anchor.e4m3(q.float_weight, fp8_anchor._scale(q.float_weight.abs().amax(1, keepdim=True)))
        whole = _rel(q(x).numpy(), exact.numpy())
    assert kept < whole / 2  # the massive channel's rounding dominated the product


def test_the_yardstick_table_pairs_rows_with_fp16_and_the_anchor(tmp_path):
    """yardstick_table.py: a row's ratio to FP16 and its gap to the anchor, with paired standard errors
    computed as compare computes them, on columns written as llm_yardstick/fp8_anchor write them."""
    import json

    import yardstick_table

    from fp8onnx.accuracy.metrics import difference_se, gain_se

    rng = np.random.default_rng(1)
    n = 50
    fp16 = {"correct": rng.integers(0, 2, n).astype(float), "labelled": np.ones(n), "nll": rng.gamma(2.0, 1.0, n)}
    model = {k: v.copy() for k, v in fp16.items()}
    model["correct"][:5] = 0.0
    model["nll"] += 0.05
    anchor = {k: v.copy() for k, v in fp16.items()}
    anchor["correct"][:10] = 0.0
    arrays = {f"lambada/{row}/{k}": v for row, cols in (("FP16", fp16), ("m.onnx", model)) for k, v in cols.items()}
    onnx_file, anchor_file = tmp_path / "onnx.npz", tmp_path / "anchor.npz"
    np.savez(onnx_file, meta=np.array(json.dumps({"sets": ["lambada"], "fp8onnx": "x"})), **arrays)
    np.savez(
        anchor_file,
        meta=np.array(json.dumps({"family": "smollm2"})),
        **{f"lambada/fp8-dynamic/{k}": v[:40] for k, v in anchor.items()},  # fewer items: rows are cut to 40
    )
    rows, _ = yardstick_table.load(onnx_file)
    theirs, _ = yardstick_table.load(anchor_file, prefix="torch ")
    rows["lambada"].update(theirs["lambada"])
    records = {r["recipe"]: r for r in yardstick_table.figures(rows["lambada"], "lambada", "torch fp8-dynamic")}
    cut = {name: {k: v[:40] for k, v in cols.items()} for name, cols in (("f", fp16), ("m", model), ("a", anchor))}
    m = records["m.onnx"]
    assert m["units"] == 40
    assert m["ratio_to_fp16"] == pytest.approx(cut["m"]["correct"].sum() / cut["f"]["correct"].sum())
    assert m["ratio_se"] == pytest.approx(difference_se("accuracy", cut["m"], cut["f"], ratio=True))
    assert m["vs_anchor"] == pytest.approx(
        (cut["m"]["correct"].sum() - cut["a"]["correct"].sum()) / cut["f"]["correct"].sum()
    )
    assert m["vs_anchor_se"] == pytest.approx(gain_se("accuracy", cut["m"], cut["a"], cut["f"]))
    assert m["ppl_change"] > 0 and m["ppl_change_se"] > 0
    table = yardstick_table.markdown(list(records.values()), ["lambada"])
    assert "lambada (40) acc. vs FP16" in table and "torch fp8-dynamic" in table


def test_a_run_in_parts_joins_end_to_end(tmp_path, monkeypatch):
    """``llm_yardstick.py --start N`` scores the task file from item N on (its meta says where); the table joins
    such parts end to end into the whole run's rows, refuses a part that does not start where the rows end,
    and cuts rows left at different lengths to the shortest, saying so."""
    import argparse
    import json

    import llm_yardstick
    import yardstick_table

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    items = [json.dumps({"text": f"item {i} ends with word{i}"}) for i in range(5)]
    (corpora / "lambada.jsonl").write_text("\n".join(items) + "\n\n")
    args = argparse.Namespace(corpora=corpora, tokenizer=None, seq_len=8, eval=None, windows=1, lambada=9)
    monkeypatch.setattr(llm_yardstick, "TextSource", lambda path, *a, **k: path)  # the file each set reads
    part = llm_yardstick._sets(argparse.Namespace(**vars(args), hellaswag=1, only="lambada", start=3))
    assert part["lambada"][0].read_text().splitlines() == items[3:]
    assert llm_yardstick._sets(argparse.Namespace(**vars(args), hellaswag=1, only="lambada", start=0))["lambada"][
        0
    ] == (corpora / "lambada.jsonl")
    with pytest.raises(SystemExit, match="task files only"):
        llm_yardstick._sets(argparse.Namespace(**vars(args), hellaswag=1, only="ptb,lambada", start=3))

    rng = np.random.default_rng(2)
    whole = {
        row: {"correct": rng.integers(0, 2, 8).astype(float), "labelled": np.ones(8), "nll": rng.gamma(2.0, 1.0, 8)}
        for row in ("FP32 (reference)", "FP16", "m.onnx")
    }

    def save(path, start, stop, rows=tuple(whole)):
        arrays = {f"lambada/{r}/{k}": v[start:stop] for r in rows for k, v in whole[r].items()}
        np.savez(path, meta=np.array(json.dumps({"sets": ["lambada"], "start": start})), **arrays)
        return path

    first, second = save(tmp_path / "a.npz", 0, 5), save(tmp_path / "b.npz", 5, 8)
    rows, _ = yardstick_table.load(first)
    theirs, meta = yardstick_table.load(second)
    yardstick_table.joined(rows, theirs, second, meta["start"])
    for row, cols in whole.items():
        for k, v in cols.items():
            assert np.array_equal(rows["lambada"][row][k], v)
    again, _ = yardstick_table.load(first)
    with pytest.raises(SystemExit, match="ends at item 5, not where this part starts"):
        yardstick_table.joined(again, yardstick_table.load(save(tmp_path / "c.npz", 6, 8))[0], tmp_path / "c.npz", 6)
    again, _ = yardstick_table.load(first)
    extra = {"lambada": {"other.onnx": whole["m.onnx"]}}
    with pytest.raises(SystemExit, match=r"'other\.onnx' has no earlier part"):
        yardstick_table.joined(again, extra, tmp_path / "d.npz", 5)
    again, _ = yardstick_table.load(first)
    yardstick_table.joined(again, yardstick_table.load(save(tmp_path / "e.npz", 5, 8, ("m.onnx",)))[0], "e", 5)
    records = yardstick_table.figures(again["lambada"], "lambada", None)
    assert {r["units"] for r in records} == {5}  # FP16 and FP32 have no second part: every row is cut to 5
