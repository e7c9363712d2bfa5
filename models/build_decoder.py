"""Train the bundled sample model: a tiny Llama-style decoder on CPython's own documentation.

The FP8 LLM paper quantizes Llama-family decoders, so the sample has the same blocks: RMSNorm,
rotary position embeddings, causal multi-head attention and a SwiGLU MLP, over byte-level tokens.
It is trained here on the text of the Python documentation that ships with CPython
(``pydoc_data.topics``), then exported to ONNX with dynamic batch and sequence axes.

Writes, next to this script in ``decoder/``:
  decoder.onnx  - the FP32 model (input ``input_ids`` int64 [batch, seq], output ``logits``)
  calib.npz     - 128 windows of 64 bytes from the training text (``input_ids``)
  eval.npz      - 256 windows of 64 bytes from held-out topics (``input_ids``, ``labels`` = next bytes)

Usage: python models/build_decoder.py [--steps N]   (needs torch; 2,500 steps took 5.5 minutes on 2 CPU cores)
       python models/build_decoder.py --eval-all    (no training: writes ``decoder/eval_all.npz``, every
       non-overlapping 64-byte window of the held-out topics, 495 windows = 31,680 predictions; accuracy
       differences of 0.1-0.3% between quantized models are noise on eval.npz's 16,384)
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

HERE = pathlib.Path(__file__).resolve().parent / "decoder"
VOCAB, DIM, LAYERS, HEADS, FFN, SEQ = 256, 128, 4, 4, 352, 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = RMSNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = RMSNorm(DIM)
        self.w_gate = nn.Linear(DIM, FFN, bias=False)
        self.w_up = nn.Linear(DIM, FFN, bias=False)
        self.w_down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(DIM // HEADS)) + mask
        y = att.softmax(-1) @ v
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, DIM))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Decoder(nn.Module):
    def __init__(self, max_seq: int = 256):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(max_seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.embed(input_ids)
        cos, sin = self.cos[:t], self.sin[:t]
        mask = torch.triu(torch.full((t, t), -1e9, device=x.device), diagonal=1)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def corpus() -> tuple[np.ndarray, np.ndarray]:
    import pydoc_data.topics as topics

    names = sorted(topics.topics)
    held_out = set(names[::10])  # every tenth topic never seen in training or calibration
    train = "\n".join(topics.topics[n] for n in names if n not in held_out).encode("utf-8")
    valid = "\n".join(topics.topics[n] for n in names if n in held_out).encode("utf-8")
    return np.frombuffer(train, np.uint8).astype(np.int64), np.frombuffer(valid, np.uint8).astype(np.int64)


def windows(data: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.choice(len(data) - length - 1, size=count, replace=False)
    return np.stack([data[s : s + length + 1] for s in starts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--eval-all", action="store_true", help="only write decoder/eval_all.npz (no training)")
    args = ap.parse_args()
    if args.eval_all:
        _, valid = corpus()
        n = len(valid) // (SEQ + 1)
        w = valid[: n * (SEQ + 1)].reshape(n, SEQ + 1)
        HERE.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(HERE / "eval_all.npz", input_ids=w[:, :-1], labels=w[:, 1:])
        print(f"wrote {HERE / 'eval_all.npz'}: {n} windows of {SEQ} held-out bytes")
        return
    torch.manual_seed(0)
    torch.set_num_threads(2)
    train, valid = corpus()
    print(f"corpus: {len(train)} training bytes, {len(valid)} held-out bytes")
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    rng = np.random.default_rng(0)
    t0 = time.time()
    for step in range(args.steps):
        batch = torch.from_numpy(windows(train, 32, SEQ, rng))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)
    model.eval()

    data_rng = np.random.default_rng(1)
    calib = windows(train, 128, SEQ, data_rng)[:, :-1]
    ev = windows(valid, 256, SEQ, data_rng)
    with torch.no_grad():
        logits = model(torch.from_numpy(ev[:, :-1]))
    acc = (logits.argmax(-1).numpy() == ev[:, 1:]).mean()
    print(f"held-out next-byte accuracy (torch FP32): {acc:.4f}")

    HERE.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(HERE / "calib.npz", input_ids=calib)
    np.savez_compressed(HERE / "eval.npz", input_ids=ev[:, :-1], labels=ev[:, 1:])
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=256)
    program = torch.onnx.export(
        model,
        (torch.from_numpy(calib[:2]),),
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: batch, 1: seq}},
        dynamo=True,
        optimize=True,
    )
    program.save(str(HERE / "decoder.onnx"))
    print(f"wrote {HERE}")


if __name__ == "__main__":
    main()
