"""Nearest-neighbour agreement of sentence embeddings: does each quantized model retrieve, for every
evaluation sentence, the same nearest other sentence as the FP32 model?

For a model with one output of shape [batch, dim] (e.g. all-MiniLM-L6-v2's ``sentence_embedding``):
embeddings of every sample of DATA are L2-normalised; each sample's neighbour is the other sample
of highest cosine. Printed per candidate: the share of samples whose neighbour is FP32's, and the
mean cosine of its embeddings to FP32's.

Usage: python tests/bench/neighbours.py REFERENCE.onnx DATA.npz CANDIDATE.onnx [...]
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import onnxruntime as ort


def embeddings(model: pathlib.Path, data: dict[str, np.ndarray], batch: int = 32) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    n = len(data[names[0]])
    out = np.concatenate(
        [session.run(None, {k: data[k][s : s + batch] for k in names})[0] for s in range(0, n, batch)]
    ).astype(np.float64)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def neighbours(emb: np.ndarray) -> np.ndarray:
    sim = emb @ emb.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", type=pathlib.Path)
    ap.add_argument("data", type=pathlib.Path)
    ap.add_argument("candidates", type=pathlib.Path, nargs="+")
    args = ap.parse_args()
    with np.load(args.data) as f:
        data = {k: f[k] for k in f.files if not k.startswith("_")}
    ref = embeddings(args.reference, data)
    want = neighbours(ref)
    print(f"{len(ref)} samples; reference {args.reference.name}")
    print(f"{'model':40} {'NN agreement':>12} {'mean cosine':>11}")
    for path in args.candidates:
        emb = embeddings(path, data)
        agree = float((neighbours(emb) == want).mean())
        print(f"{path.name:40} {agree:12.4f} {float((emb * ref).sum(1).mean()):11.5f}")


if __name__ == "__main__":
    main()
