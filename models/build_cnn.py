"""Train a small real CNN on handwritten digits and export it to ONNX, for measuring FP8 on Conv layers.

Data: scikit-learn's bundled digits (``sklearn.datasets.load_digits``: 1,797 real 8x8 grey-scale scans
of handwritten digits, shipped inside the package, no download), upsampled to 32x32 (bilinear,
``torch.nn.functional.interpolate``) and normalised to mean 0 / std 1 with the train split's statistics.
One seeded permutation (seed 0) gives a train split (1,077 images, 60%) and a test split (720 images);
the 200 calibration images are taken from the train split, so calibration never sees a test image.
The test split is halved (``models/split_eval.py``): choose a setting on ``eval_search.npz``, verify it
on ``eval_holdout.npz``.

Model: six 3x3 Conv2d (widths 16, 16, 32, 32, 64, 64; BatchNorm and ReLU after each, max-pool after
every second), global average pooling, then Linear(64, 64) + ReLU and Linear(64, 10). Trained with
AdamW and a one-cycle schedule, seeded (``torch.manual_seed(0)``), deterministic, on 2 threads.
Exported with the TorchScript exporter (``dynamo=False``, opset 17): BatchNorm is folded into the
convolutions, giving 6 Conv and 2 Gemm nodes; input ``pixels`` float32 [batch, 1, 32, 32] (dynamic
batch), output ``logits`` [batch, 10].

Writes to ``models/cnn/`` (not committed; about 2 MB):
  cnn.onnx  calib.npz (200 images, ``pixels``)  eval.npz (720 test images, ``pixels`` and ``labels``
  int64 [N])  eval_search.npz (first 360)  eval_holdout.npz (last 360)

Measured (2 CPU cores, torch 2.13.0 CPU, scikit-learn 1.9.1): 12 epochs train in about 6 s, whole run
10 s; test accuracy 0.9944 (torch and onnxruntime); two runs write byte-identical files.

Usage: pip install -e ".[cpu,models]" && python models/build_cnn.py [--epochs N]
Then:  fp8onnx quantize models/cnn/cnn.onnx --calib models/cnn/calib.npz --op-types MatMul,Gemm,Conv -o x.onnx
       fp8onnx compare models/cnn/cnn.onnx x.onnx --data models/cnn/eval.npz
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import time
import warnings

import numpy as np
import torch
from split_eval import split
from torch import nn
from torch.nn import functional as F

OUT = pathlib.Path(__file__).resolve().parent / "cnn"
SIZE, TEST, CALIB, SEED = 32, 720, 200, 0


def load_data() -> dict[str, np.ndarray]:
    """Digits upsampled to SIZE x SIZE, normalised on the train split, split by one seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1)  # [1797, 1, 8, 8], 0..16
    images = F.interpolate(images, size=(SIZE, SIZE), mode="bilinear", align_corners=False).numpy()
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(labels))
    train, test = order[: len(order) - TEST], order[len(order) - TEST :]
    mean, std = images[train].mean(), images[train].std()
    images = ((images - mean) / std).astype(np.float32)
    return {
        "x_train": images[train],
        "y_train": labels[train],
        "x_test": images[test],
        "y_test": labels[test],
        "calib": images[train[:CALIB]],
    }


def block(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *block(1, 16), *block(16, 16), nn.MaxPool2d(2),  # 16x16
            *block(16, 32), *block(32, 32), nn.MaxPool2d(2),  # 8x8
            *block(32, 64), *block(64, 64), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(pixels))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, batch: int = 64) -> float:
    """Train in place; return the wall time in seconds."""
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    steps = epochs * ((len(x) + batch - 1) // batch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.2)
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.time()
    model.train()
    for epoch in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            loss = F.cross_entropy(model(x_t[idx]), y_t[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        print(f"epoch {epoch + 1:2d}  loss {total / len(x):.4f}  {time.time() - t0:.1f}s", flush=True)
    model.eval()
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=12)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)

    data = load_data()
    print(f"train {len(data['y_train'])}, test {len(data['y_test'])}, calibration {len(data['calib'])} images")
    model = CNN()
    seconds = train(model, data["x_train"], data["y_train"], args.epochs)
    acc = accuracy(model, data["x_test"], data["y_test"])
    print(f"train time {seconds:.1f}s; test accuracy (torch FP32) {acc:.4f}")

    OUT.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", "You are using the legacy TorchScript", DeprecationWarning)
    torch.onnx.export(
        model,
        (torch.from_numpy(data["calib"][:2]),),
        str(OUT / "cnn.onnx"),
        input_names=["pixels"],
        output_names=["logits"],
        dynamic_axes={"pixels": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    np.savez_compressed(OUT / "calib.npz", pixels=data["calib"])
    np.savez_compressed(OUT / "eval.npz", pixels=data["x_test"], labels=data["y_test"])
    split(OUT)

    import onnx
    import onnxruntime as ort

    ops = collections.Counter(node.op_type for node in onnx.load(str(OUT / "cnn.onnx")).graph.node)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
    sess = ort.InferenceSession(str(OUT / "cnn.onnx"), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"pixels": data["x_test"]})[0]
    with torch.no_grad():
        ref = model(torch.from_numpy(data["x_test"])).numpy()
    onnx_acc = float((got.argmax(1) == data["y_test"]).mean())
    print("ONNX nodes: " + ", ".join(f"{op} {n}" for op, n in sorted(ops.items())))
    print(f"ONNX vs torch max abs diff: {np.abs(ref - got).max():.2e}; test accuracy (onnxruntime) {onnx_acc:.4f}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
