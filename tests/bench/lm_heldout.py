"""Next-token accuracy, perplexity and top-1 agreement with FP32 of language models on held-out windows,
with onnxruntime's CPU EP at its default optimisation (4 windows a run), counted exactly.

The data is an ``.npz`` with ``input_ids``, ``attention_mask`` and ``labels`` [n, seq] (the next token
at each position), as ``models/build_smollm2.py`` writes it; the reference's argmax is kept beside the
data (``<data>.fp32argmax.npy``) so that later runs compare with it. ``fp8onnx compare`` gives the
same accuracy and agreement plus generation; this is the quick form for many models on 32,768 tokens
(SmolLM2-135M: 37 s a model on the 2-core development machine).

Usage: python tests/bench/lm_heldout.py DATA.npz FP32.onnx [MODEL.onnx ...]
Prints one JSON line a model: accuracy, correct tokens, perplexity, agreement with FP32's argmax, and
one standard error of the accuracy's difference from FP32's (``compare``'s ±).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import onnxruntime as ort

from fp8onnx.accuracy.metrics import difference_se


def scores(path: str, data: dict, batch: int = 4) -> tuple[np.ndarray, float]:
    """The argmax at every position, and exp(mean cross-entropy) against the labels."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ids, mask, labels = data["input_ids"], data["attention_mask"], data["labels"]
    argmax, nll = [], 0.0
    for i in range(0, len(ids), batch):
        logits = session.run(["logits"], {"input_ids": ids[i : i + batch], "attention_mask": mask[i : i + batch]})[0]
        logits = logits.astype(np.float64)
        peak = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]
        nll += float((logz - np.take_along_axis(logits, labels[i : i + batch, :, None], -1)[..., 0]).sum())
        argmax.append(logits.argmax(-1))
    return np.concatenate(argmax), float(np.exp(nll / labels.size))


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    data_path, reference, *models = sys.argv[1:]
    data = dict(np.load(data_path))
    cache = pathlib.Path(data_path + ".fp32argmax.npy")
    for path in [reference, *models]:
        argmax, ppl = scores(path, data)
        if path == reference:
            np.save(cache, argmax)
        ref = np.load(cache)
        correct = int((argmax == data["labels"]).sum())
        row = {"model": path, "accuracy": correct / data["labels"].size, "correct": correct, "perplexity": ppl}
        row["agreement"] = float((argmax == ref).mean())
        # one standard error of accuracy - FP32's, paired over windows (the jackknife), as `compare` shows it
        per_window = {"labelled": np.full(len(ref), float(ref.shape[1]))}
        mine = {"correct": (argmax == data["labels"]).sum(1).astype(float), **per_window}
        theirs = {"correct": (ref == data["labels"]).sum(1).astype(float), **per_window}
        row["accuracy_noise"] = difference_se("accuracy", mine, theirs)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
