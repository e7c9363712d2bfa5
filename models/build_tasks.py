"""Six small task models for the zoo, trained here and exported with torch's exporters, each with its
own data and metric: the task families of the PTQ paper that the zoo lacked.

- ``translator`` (translation): a byte-level encoder-decoder transformer that translates CPython
  documentation text (``pydoc_data.topics``) into its ROT13 cipher; inputs ``src_ids``, ``tgt_ids``
  (teacher forcing), output ``logits``; metric: next-byte accuracy on held-out topics.
- ``segmenter`` (segmentation): a Conv encoder with a ConvTranspose decoder that labels each pixel of
  32x32 images as background, disc or square; output [N, H, W, 3]; metric: pixel accuracy.
- ``detector`` (detection): a CNN that finds the centres of coloured squares (two classes) on a 4x4
  grid over 32x32 images, CenterNet's centre heatmap as per-cell classes (no box regression);
  metric: per-cell accuracy.
- ``unet`` (diffusion): a small denoising UNet (Conv, ConvTranspose, a time embedding and attention
  at the bottleneck) trained as a DDPM on scikit-learn's digits at 16x16; inputs ``x_t`` and ``t``,
  output the predicted noise; metric: agreement with FP32 (mean cosine).
- ``text-classifier`` (classification): a transformer encoder over 64 bytes that tells which of 8
  CPython documentation topics a window comes from (held-out: the last fifth of each topic),
  exported with ``torch.onnx.export(dynamo=True)``.
- ``audio-classifier`` (classification): 1-D convolutions and a transformer layer over 0.25 s of 8 kHz
  audio that tell six kinds of synthetic sound apart (tones, chirps, two-tone, noise bursts).

Each goes to ``OUT/NAME/`` as ``model.onnx``, ``calib.npz`` (inputs only), ``eval.npz`` (inputs and,
for the classifiers, ``labels``) and ``zoo.json`` (its task family and the options the zoo quantizes
it with: Conv and ConvTranspose opted in where the model is mostly convolutions). Everything is
seeded. Needs torch and scikit-learn (the ``[wild]`` extra and scikit-learn).

Usage: python models/build_tasks.py [--out models/zoo] [--steps-scale 1.0] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

HERE = pathlib.Path(__file__).resolve().parent
CONV = ["MatMul", "Gemm", "Conv", "ConvTranspose"]


# --- shared pieces -----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, memory=None):
        memory = x if memory is None else memory
        n, t, d = x.shape
        s, h = memory.shape[1], self.heads
        q = self.q(x).reshape(n, t, h, d // h).transpose(1, 2)
        k = self.k(memory).reshape(n, s, h, d // h).transpose(1, 2)
        v = self.v(memory).reshape(n, s, h, d // h).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        if self.causal:
            scores = scores + torch.triu(torch.full((t, s), -1e9), diagonal=1)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, d))


class Layer(nn.Module):
    """Pre-norm transformer layer: self-attention, optional cross-attention, GELU MLP."""

    def __init__(self, dim: int, heads: int, ffn: int, causal: bool = False, cross: bool = False):
        super().__init__()
        self.n1, self.att = nn.LayerNorm(dim), Attention(dim, heads, causal)
        self.cross = Attention(dim, heads) if cross else None
        self.nc = nn.LayerNorm(dim) if cross else None
        self.n2, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x, memory=None):
        x = x + self.att(self.n1(x))
        if self.cross is not None:
            x = x + self.cross(self.nc(x), memory)
        return x + self.down(F.gelu(self.up(self.n2(x))))


def train(model: nn.Module, batch_fn, steps: int, lr: float, name: str) -> None:
    steps = max(steps, 30)  # OneCycleLR needs a warm-up of at least two steps (10%)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    start, loss = time.time(), None
    for step in range(steps):
        loss = model.loss(*batch_fn(step))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    print(f"{name}: {steps} steps in {time.time() - start:.0f} s, last loss {loss.item():.4f}")


def export(model, args: tuple, inputs: list[str], outputs: list[str], path: pathlib.Path, dynamo: bool = False):
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=1024)
            shapes = {name: {0: batch} for name in inputs}
            program = torch.onnx.export(
                model,
                args,
                input_names=inputs,
                output_names=outputs,
                dynamo=True,
                dynamic_shapes=shapes,
                opset_version=18,
            )
            program.save(str(path))
        else:
            axes = {name: {0: "batch"} for name in inputs + outputs}
            torch.onnx.export(
                model,
                args,
                str(path),
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )


def write(out: pathlib.Path, family: str, metric: str, calib: dict, evals: dict, options: dict | None = None):
    np.savez(out / "calib.npz", **calib)
    np.savez(out / "eval.npz", **evals)
    doc = {"family": family, "metric": metric, "options": options or {}}
    (out / "zoo.json").write_text(json.dumps(doc, indent=1) + "\n")


def accuracy(model, inputs: dict, labels: np.ndarray) -> float:
    with torch.no_grad():
        logits = model(*(torch.from_numpy(v) for v in inputs.values()))
    return float((logits.argmax(-1).numpy() == labels).mean())


# --- translation: CPython docs into ROT13 --------------------------------------------------------------


def topics_text() -> dict[str, bytes]:
    import pydoc_data.topics as topics

    return {name: text.encode("utf-8") for name, text in sorted(topics.topics.items())}


def rot13(b: np.ndarray) -> np.ndarray:
    out = b.copy()
    for lo in (ord("a"), ord("A")):
        letters = (b >= lo) & (b < lo + 26)
        out[letters] = (b[letters] - lo + 13) % 26 + lo
    return out


class Translator(nn.Module):
    def __init__(self, seq: int = 24, dim: int = 64):
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(256, dim), nn.Embedding(257, dim)  # 256: start of sequence
        self.src_pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.tgt_pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.enc = nn.ModuleList(Layer(dim, 4, 128) for _ in range(2))
        self.dec = nn.ModuleList(Layer(dim, 4, 128, causal=True, cross=True) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256)

    def forward(self, src_ids, tgt_ids):
        memory = self.src_emb(src_ids) + self.src_pos
        for layer in self.enc:
            memory = layer(memory)
        x = self.tgt_emb(tgt_ids) + self.tgt_pos
        for layer in self.dec:
            x = layer(x, memory)
        return self.head(self.norm(x))

    def loss(self, src, tgt_in, labels):
        return F.cross_entropy(self(src, tgt_in).reshape(-1, 256), labels.reshape(-1))


def build_translator(out: pathlib.Path, scale: float) -> None:
    seq, rng = 24, np.random.default_rng(0)
    texts = topics_text()
    names = list(texts)
    held = set(names[::10])
    train_text = np.frombuffer(b"\n".join(texts[n] for n in names if n not in held), np.uint8)
    eval_text = np.frombuffer(b"\n".join(texts[n] for n in names if n in held), np.uint8)

    def pairs(text, count, rng):
        starts = rng.integers(0, len(text) - seq, count)
        src = np.stack([text[s : s + seq] for s in starts]).astype(np.int64)
        tgt = rot13(src.astype(np.uint8)).astype(np.int64)
        tgt_in = np.concatenate([np.full((count, 1), 256), tgt[:, :-1]], axis=1)
        return src, tgt_in, tgt

    torch.manual_seed(0)
    model = Translator(seq)
    train(
        model, lambda _: [torch.from_numpy(a) for a in pairs(train_text, 64, rng)], int(800 * scale), 3e-3, "translator"
    )
    src, tgt_in, _ = pairs(train_text, 64, np.random.default_rng(1))
    esrc, etgt_in, etgt = pairs(eval_text, 256, np.random.default_rng(2))
    print(f"translator: held-out next-byte accuracy {accuracy(model, {'s': esrc, 't': etgt_in}, etgt):.4f}")
    export(
        model,
        (torch.from_numpy(src[:2]), torch.from_numpy(tgt_in[:2])),
        ["src_ids", "tgt_ids"],
        ["logits"],
        out / "model.onnx",
    )
    write(
        out,
        "translation",
        "next-byte accuracy",
        {"src_ids": src, "tgt_ids": tgt_in},
        {"src_ids": esrc, "tgt_ids": etgt_in, "labels": etgt},
    )


# --- segmentation and detection: shapes on noise ----------------------------------------------------


def shapes(count: int, rng: np.random.Generator, size: int = 32):
    """Images with 1-3 discs (class 1) and squares (class 2) of random colours on noise; per-pixel
    labels and the shapes' (class, centre) list."""
    images = rng.normal(0.0, 0.25, (count, 3, size, size)).astype(np.float32)
    masks = np.zeros((count, size, size), np.int64)
    objects = []
    yy, xx = np.mgrid[:size, :size]
    for i in range(count):
        found = []
        for _ in range(rng.integers(1, 4)):
            kind = int(rng.integers(1, 3))
            r = int(rng.integers(3, 6))
            cy, cx = (int(v) for v in rng.integers(r, size - r, 2))
            if kind == 1:
                inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            else:
                inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
            colour = rng.uniform(-1, 1, 3).astype(np.float32) + (0.8 if kind == 1 else -0.8) * np.array([1, 0, -1])
            images[i][:, inside] += colour[:, None]
            masks[i][inside] = kind
            found.append((kind, cy, cx))
        objects.append(found)
    return images, masks, objects


class Segmenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.down1, self.down2 = nn.Conv2d(3, 16, 3, 2, 1), nn.Conv2d(16, 32, 3, 2, 1)
        self.mid = nn.Conv2d(32, 32, 3, 1, 1)
        self.up1, self.up2 = nn.ConvTranspose2d(32, 16, 2, 2), nn.ConvTranspose2d(32, 16, 2, 2)
        self.head = nn.Conv2d(16, 3, 1)

    def forward(self, image):
        a = F.relu(self.down1(image))  # 16 x 16
        b = F.relu(self.mid(F.relu(self.down2(a))))  # 8 x 8
        c = F.relu(self.up1(b))  # 16 x 16
        d = F.relu(self.up2(torch.cat([c, a], 1)))  # 32 x 32
        return self.head(d).permute(0, 2, 3, 1)

    def loss(self, images, masks):
        return F.cross_entropy(self(images).reshape(-1, 3), masks.reshape(-1))


def build_shapes_task(out, scale, make_model, seed, steps, labels_of, output, family, metric) -> None:
    """Train ``make_model()`` on :func:`shapes` images (seeded by ``seed``) against ``labels_of(masks,
    objects)`` and write it with 64 calibration and 256 held-out images (Conv/ConvTranspose opted in)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = make_model()

    def batch(_):
        images, masks, objects = shapes(32, rng)
        return torch.from_numpy(images), torch.from_numpy(labels_of(masks, objects))

    train(model, batch, int(steps * scale), 5e-3, out.name)
    calib, _, _ = shapes(64, np.random.default_rng(seed + 1))
    images, masks, objects = shapes(256, np.random.default_rng(seed + 2))
    labels = labels_of(masks, objects)
    print(f"{out.name}: held-out {metric} {accuracy(model, {'i': images}, labels):.4f}")
    export(model, (torch.from_numpy(calib[:2]),), ["image"], [output], out / "model.onnx")
    write(out, family, metric, {"image": calib}, {"image": images, "labels": labels}, {"op_types": CONV})


def build_segmenter(out: pathlib.Path, scale: float) -> None:
    labels = lambda masks, _: masks  # noqa: E731
    build_shapes_task(out, scale, Segmenter, 10, 600, labels, "scores", "segmentation", "pixel accuracy")


def centres(objects, count: int, grid: int = 4, size: int = 32) -> np.ndarray:
    cells = np.zeros((count, grid, grid), np.int64)
    for i, found in enumerate(objects):
        for kind, cy, cx in found:
            cells[i, cy * grid // size, cx * grid // size] = kind
    return cells


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(32, 48, 3, 2, 1),
            nn.ReLU(),
        )
        self.head = nn.Conv2d(48, 3, 1)

    def forward(self, image):
        return self.head(self.body(image)).permute(0, 2, 3, 1)  # [N, 4, 4, 3]: none, disc, square

    def loss(self, images, cells):
        return F.cross_entropy(self(images).reshape(-1, 3), cells.reshape(-1))


def build_detector(out: pathlib.Path, scale: float) -> None:
    def cells(_, objects):
        return centres(objects, len(objects))

    build_shapes_task(out, scale, Detector, 20, 800, cells, "cells", "detection", "per-cell accuracy (object centres)")


# --- diffusion: a DDPM UNet on scikit-learn's digits -------------------------------------------------

STEPS_T = 100
BETAS = np.linspace(1e-4, 0.05, STEPS_T)
ALPHA_BAR = np.cumprod(1.0 - BETAS)


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.time = nn.Sequential(nn.Linear(1, 32), nn.SiLU(), nn.Linear(32, 32))
        self.inp = nn.Conv2d(1, 16, 3, 1, 1)
        self.t1 = nn.Linear(32, 16)
        self.down = nn.Conv2d(16, 32, 3, 2, 1)  # 8 x 8
        self.t2 = nn.Linear(32, 32)
        self.norm, self.att = nn.LayerNorm(32), Attention(32, 4)
        self.up = nn.ConvTranspose2d(32, 16, 2, 2)  # 16 x 16
        self.mix = nn.Conv2d(32, 16, 3, 1, 1)
        self.out = nn.Conv2d(16, 1, 3, 1, 1)

    def forward(self, x_t, t):
        emb = self.time(t)
        a = F.silu(self.inp(x_t) + self.t1(emb)[:, :, None, None])
        b = F.silu(self.down(a) + self.t2(emb)[:, :, None, None])
        n, c, h, w = b.shape
        seq = b.flatten(2).transpose(1, 2)
        b = (seq + self.att(self.norm(seq))).transpose(1, 2).reshape(n, c, h, w)
        u = F.silu(self.up(b))
        return self.out(F.silu(self.mix(torch.cat([u, a], 1))))

    def loss(self, x_t, t, noise):
        return F.mse_loss(self(x_t, t), noise)


def noised(images: np.ndarray, rng: np.random.Generator):
    t = rng.integers(0, STEPS_T, len(images))
    noise = rng.standard_normal(images.shape).astype(np.float32)
    ab = ALPHA_BAR[t].astype(np.float32)[:, None, None, None]
    x_t = np.sqrt(ab) * images + np.sqrt(1 - ab) * noise
    return x_t.astype(np.float32), (t[:, None] / STEPS_T).astype(np.float32), noise


def build_unet(out: pathlib.Path, scale: float) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits().images.astype(np.float32) / 8.0 - 1.0  # [1797, 8, 8] in [-1, 1]
    images = digits.repeat(2, axis=1).repeat(2, axis=2)[:, None]  # 16 x 16
    train_set, held = images[:1500], images[1500:]
    rng = np.random.default_rng(30)
    torch.manual_seed(30)
    model = UNet()
    train(
        model,
        lambda _: [torch.from_numpy(a) for a in noised(train_set[rng.integers(0, 1500, 64)], rng)],
        int(1500 * scale),
        3e-3,
        "unet",
    )
    calib = noised(train_set[:64], np.random.default_rng(31))
    x_t, t, noise = noised(held[:256], np.random.default_rng(32))
    with torch.no_grad():
        mse = F.mse_loss(model(torch.from_numpy(x_t), torch.from_numpy(t)), torch.from_numpy(noise)).item()
    print(f"unet: held-out noise-prediction MSE {mse:.4f} (1.0 = predicting nothing)")
    export(
        model,
        (torch.from_numpy(calib[0][:2]), torch.from_numpy(calib[1][:2])),
        ["x_t", "t"],
        ["noise"],
        out / "model.onnx",
    )
    write(
        out,
        "diffusion",
        "mean cosine to FP32",
        {"x_t": calib[0], "t": calib[1]},
        {"x_t": x_t, "t": t},
        {"op_types": CONV},
    )


# --- classification: text topics and sounds --------------------------------------------------------


class TextClassifier(nn.Module):
    def __init__(self, classes: int, seq: int = 64, dim: int = 64):
        super().__init__()
        self.emb, self.pos = nn.Embedding(256, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(Layer(dim, 4, 128) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, input_ids):
        x = self.emb(input_ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(1))

    def loss(self, ids, labels):
        return F.cross_entropy(self(ids), labels)


def build_text_classifier(out: pathlib.Path, scale: float) -> None:
    texts = topics_text()
    top = sorted(texts, key=lambda n: -len(texts[n]))[:8]
    parts = [np.frombuffer(texts[n], np.uint8) for n in top]
    train_parts = [p[: len(p) * 4 // 5] for p in parts]
    eval_parts = [p[len(p) * 4 // 5 :] for p in parts]

    def windows(source, count, rng):
        labels = rng.integers(0, len(source), count)
        ids = np.stack([source[k][s : s + 64] for k in labels for s in [rng.integers(0, len(source[k]) - 64)]])
        return ids.astype(np.int64), labels.astype(np.int64)

    rng = np.random.default_rng(40)
    torch.manual_seed(40)
    model = TextClassifier(len(top))
    train(
        model,
        lambda _: [torch.from_numpy(a) for a in windows(train_parts, 64, rng)],
        int(2000 * scale),
        3e-3,
        "text-classifier",
    )
    calib, _ = windows(train_parts, 64, np.random.default_rng(41))
    ids, labels = windows(eval_parts, 256, np.random.default_rng(42))
    print(f"text-classifier: held-out accuracy {accuracy(model, {'i': ids}, labels):.4f} ({len(top)} topics)")
    export(model, (torch.from_numpy(calib[:2]),), ["input_ids"], ["logits"], out / "model.onnx", dynamo=True)
    write(out, "classification", "topic accuracy", {"input_ids": calib}, {"input_ids": ids, "labels": labels})


RATE, LENGTH = 8000, 2000  # 0.25 s at 8 kHz


def sounds(count: int, rng: np.random.Generator):
    t = np.arange(LENGTH) / RATE
    labels = rng.integers(0, 6, count)
    out = np.empty((count, 1, LENGTH), np.float32)
    for i, kind in enumerate(labels):
        f = rng.uniform(300, 1500)
        if kind == 0:
            wave = np.sin(2 * np.pi * f * t)
        elif kind == 1:
            wave = np.sin(2 * np.pi * (f * t + 1500 * t**2))  # chirp up
        elif kind == 2:
            wave = np.sin(2 * np.pi * (f * 2 * t - 1500 * t**2))  # chirp down
        elif kind == 3:
            wave = np.sin(2 * np.pi * f * t) + np.sin(2 * np.pi * f * 1.5 * t)
        elif kind == 4:
            wave = rng.standard_normal(LENGTH) * (np.abs(t - rng.uniform(0.05, 0.2)) < 0.03)
        else:
            wave = np.sin(2 * np.pi * f * t) * (np.sin(2 * np.pi * 12 * t) > 0)  # beeps
        out[i, 0] = rng.uniform(0.2, 1.0) * wave + rng.normal(0, 0.2, LENGTH)
    return out, labels.astype(np.int64)


class AudioClassifier(nn.Module):
    def __init__(self, dim: int = 48):
        super().__init__()
        self.front = nn.Sequential(
            nn.Conv1d(1, 16, 16, 4, 6),
            nn.GELU(),
            nn.Conv1d(16, 32, 8, 4, 2),
            nn.GELU(),
            nn.Conv1d(32, dim, 8, 4, 2),
            nn.GELU(),
        )
        self.layer = Layer(dim, 4, 96)
        self.head = nn.Linear(dim, 6)

    def forward(self, audio):
        x = self.front(audio).transpose(1, 2)  # [N, 31, dim]
        return self.head(self.layer(x).mean(1))

    def loss(self, audio, labels):
        return F.cross_entropy(self(audio), labels)


def build_audio_classifier(out: pathlib.Path, scale: float) -> None:
    rng = np.random.default_rng(50)
    torch.manual_seed(50)
    model = AudioClassifier()
    train(model, lambda _: [torch.from_numpy(a) for a in sounds(64, rng)], int(500 * scale), 3e-3, "audio-classifier")
    calib, _ = sounds(64, np.random.default_rng(51))
    audio, labels = sounds(256, np.random.default_rng(52))
    print(f"audio-classifier: held-out accuracy {accuracy(model, {'a': audio}, labels):.4f}")
    export(model, (torch.from_numpy(calib[:2]),), ["audio"], ["logits"], out / "model.onnx")
    write(out, "classification", "sound accuracy", {"audio": calib}, {"audio": audio, "labels": labels})


BUILDERS = {
    "translator": build_translator,
    "segmenter": build_segmenter,
    "detector": build_detector,
    "unet": build_unet,
    "text-classifier": build_text_classifier,
    "audio-classifier": build_audio_classifier,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "zoo")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="training steps relative to the defaults")
    ap.add_argument("--only", nargs="*", choices=list(BUILDERS), default=list(BUILDERS))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in args.only:
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        BUILDERS[name](folder, args.steps_scale)


if __name__ == "__main__":
    main()
