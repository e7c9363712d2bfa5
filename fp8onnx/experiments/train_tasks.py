"""The training study's tasks: a byte-level decoder on CPython's documentation (next-byte accuracy)
and a small byte encoder that classifies documentation topics; each builds its model, data and
metric (imports torch)."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch.nn import functional as F

from fp8onnx.models.build_decoder import VOCAB, Decoder, corpus, windows

logger = logging.getLogger(__name__)
BATCH, SEQ = 16, 64  # training batch and sequence length of both tasks


def _decoder_task():
    train, valid = corpus()
    n = len(valid) // (SEQ + 1)
    held_out = torch.from_numpy(valid[: n * (SEQ + 1)].reshape(n, SEQ + 1)[:128])

    def batches(seed: int, steps: int):
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            yield torch.from_numpy(windows(train, BATCH, SEQ, rng))

    def loss_of(model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1)), logits

    def data(count: int = 128) -> tuple[np.ndarray, np.ndarray]:
        """(calibration windows from the training text, held-out windows with next-byte labels)."""
        calib = windows(train, count, SEQ, np.random.default_rng(1234))[:, :-1]
        return calib, held_out.numpy()

    def evaluate(model) -> tuple[float, float]:
        with torch.no_grad():
            loss, logits = loss_of(model, held_out)
            accuracy = float((logits.argmax(-1) == held_out[:, 1:]).float().mean())
        return float(loss), accuracy

    return Decoder, batches, loss_of, evaluate, "next-byte accuracy", data


CLASS_TOPICS = ("specialnames", "compound", "types", "debugger")  # the four largest documentation topics


class _Encoder(torch.nn.Module):
    """A small BERT-style encoder over bytes (2 layers, width 64, 4 heads; every projection an
    nn.Linear, so every matmul goes through FP8), masked mean pooling and a linear head."""

    def __init__(self, classes: int = len(CLASS_TOPICS), dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "norm1": torch.nn.LayerNorm(dim),
                    "qkv": torch.nn.Linear(dim, 3 * dim),
                    "out": torch.nn.Linear(dim, dim),
                    "norm2": torch.nn.LayerNorm(dim),
                    "up": torch.nn.Linear(dim, 2 * dim),
                    "down": torch.nn.Linear(2 * dim, dim),
                }
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, input_ids):
        b, t = input_ids.shape
        mask = (input_ids != 0).float()
        x = self.embed(input_ids) + self.pos[:t]
        bias = (1.0 - mask)[:, None, None, :] * -1e9
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).chunk(3, dim=-1)
            split = lambda z: z.reshape(b, t, self.heads, -1).transpose(1, 2)  # noqa: E731
            att = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(q.shape[-1] / self.heads) + bias, -1)
            x = x + blk["out"]((att @ split(v)).transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](F.gelu(blk["up"](blk["norm2"](x))))
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
        return self.head(pooled)


def _classify_task():
    """Which of four CPython documentation topics a sentence comes from: real sentences (6 to 40
    words), real labels, bytes padded to SEQ; 80% to train, 20% held out (a seeded split)."""
    import pydoc_data.topics as topics
    import re

    sentences, labels = [], []
    for label, name in enumerate(CLASS_TOPICS):
        text = re.sub(r"\s+", " ", topics.topics[name])
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
            if 6 <= len(s.split()) <= 40:
                sentences.append(s)
                labels.append(label)
    ids = np.zeros((len(sentences), SEQ), np.int64)
    for i, s in enumerate(sentences):
        raw = np.frombuffer(s.encode("utf-8")[:SEQ], np.uint8)
        ids[i, : len(raw)] = np.maximum(raw, 1)  # byte 0 is padding
    order = np.random.default_rng(0).permutation(len(ids))
    cut = int(0.8 * len(ids))
    train, test = order[:cut], order[cut:]
    x_train, y_train = torch.from_numpy(ids[train]), torch.from_numpy(np.array(labels)[train])
    x_test, y_test = torch.from_numpy(ids[test]), torch.from_numpy(np.array(labels)[test])

    def batches(seed: int, steps: int):
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            pick = torch.from_numpy(rng.choice(len(x_train), 2 * BATCH, replace=False))
            yield x_train[pick], y_train[pick]

    def loss_of(model, batch):
        logits = model(batch[0])
        return F.cross_entropy(logits.float(), batch[1]), logits

    def evaluate(model) -> tuple[float, float]:
        with torch.no_grad():
            loss, logits = loss_of(model, (x_test, y_test))
        return float(loss), float((logits.argmax(-1) == y_test).float().mean())

    def data(count: int = 128):
        return x_train[:count].numpy(), (x_test.numpy(), y_test.numpy())

    return _Encoder, batches, loss_of, evaluate, "topic accuracy", data


TASKS = {"decoder": _decoder_task, "classify": _classify_task}
