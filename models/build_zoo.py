"""Assemble a zoo of twelve models built here, for ``fp8onnx zoo`` (see docs/scale-out.md).

Writes ``models/zoo/`` (not committed) and the list ``models/zoo/zoo.txt``; each model's folder has a
``zoo.json`` with its task family (and the options the zoo quantizes it with). Six come from
elsewhere:

- ``decoder``: the sample decoder (``models/decoder``: CPython-docs text, next-byte labels);
- ``minilm``: all-MiniLM-L6-v2 with its real weights (``models/minilm``, from
  ``models/export_minilm.py``; left out when absent), 200 calibration and 256 held-out sentences;
- ``cnn``: the digits CNN trained here (``models/cnn``, from ``models/build_cnn.py``; left out when
  absent), Conv layers quantized too is not the zoo's default (MatMul/Gemm only);
- ``vit``: the exporter corpus's ViT-style encoder, TorchScript at opset 17 (random init, seeded);
- ``llama-small``: the ~1B random Llama's small sibling (``models/build_llama.py``: 2 layers, d 256);
- ``bert-dynamo``: the exporter corpus's BERT-style encoder through ``torch.onnx.export(dynamo=True)``.

The three generated ones get seeded random inputs (64 to calibrate, 256 to evaluate, different
seeds), so their metric is agreement with FP32, not a task. The other six are trained here by
``models/build_tasks.py`` (translator, segmenter, detector, diffusion UNet, text and audio
classifiers; built when their folder has no model.onnx yet, about 3 minutes on 2 cores). Needs torch
(the ``[wild]`` extra) and scikit-learn.

Usage: python models/build_zoo.py [--out models/zoo]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import onnx
from onnx import helper

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "wild"))
SEQ = 16


def _inputs(path: pathlib.Path) -> list[onnx.ValueInfoProto]:
    model = onnx.load(path, load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in weights]


def random_data(path: pathlib.Path, count: int, seed: int, vocab: int = 256) -> dict[str, np.ndarray]:
    """Inputs for every input of a corpus model: token ids, padding masks, images."""
    rng = np.random.default_rng(seed)
    feed = {}
    for value in _inputs(path):
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "input_ids":
            array = rng.integers(0, vocab, (count, SEQ))
        elif value.name == "attention_mask":  # right padding, as a tokenizer pads sentences
            array = np.arange(SEQ) < rng.integers(SEQ // 2, SEQ + 1, (count, 1))
        elif value.name == "token_type_ids":
            array = (np.arange(SEQ) >= SEQ // 2)[None].repeat(count, axis=0)
        elif len(dims) == 4:  # images
            array = rng.standard_normal((count, *dims[1:]))
        else:
            raise SystemExit(f"{path}: no data rule for input {value.name}")
        feed[value.name] = np.ascontiguousarray(array, dtype)
    return feed


# name -> (task family, what its metric is, quantize options for every configuration)
FAMILIES = {
    "decoder": ("language modelling", "next-byte accuracy (trained on CPython's docs)", {}),
    "minilm": ("text encoder", "mean cosine to FP32 (real weights)", {}),
    "cnn": ("classification", "digit accuracy (trained)", {"op_types": ["MatMul", "Gemm", "Conv", "ConvTranspose"]}),
    "vit": ("classification", "top-1 agreement with FP32 (random weights)", {}),
    "bert-dynamo": ("text encoder", "mean cosine to FP32 (random weights)", {}),
    "llama-small": ("text generation", "top-1 agreement with FP32 (random weights)", {}),
}


def _about(folder: pathlib.Path, family: str, metric: str, options: dict) -> None:
    doc = {"family": family, "metric": metric, "options": options}
    (folder / "zoo.json").write_text(json.dumps(doc, indent=1) + "\n")


def _link(target: pathlib.Path, link: pathlib.Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "zoo")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, folder, model, evals in (
        ("decoder", HERE / "decoder", "decoder.onnx", "eval.npz"),
        ("minilm", HERE / "minilm", "minilm.onnx", "eval_search.npz"),
        ("cnn", HERE / "cnn", "cnn.onnx", "eval.npz"),
    ):
        if not (folder / model).is_file():
            print(f"{name}: {folder / model} is missing; left out")
            continue
        dest = out / name
        dest.mkdir(exist_ok=True)
        _link(folder / model, dest / "model.onnx")
        _link(folder / "calib.npz", dest / "calib.npz")
        _link(folder / evals, dest / "eval.npz")
        _about(dest, *FAMILIES[name])
        entries.append(f"{name}/model.onnx")

    import corpus  # tests/wild: the exporter corpus

    for name, case in (("vit", "torch-vit-o17"), ("bert-dynamo", "torch-bert-dynamo")):
        path, _ = corpus.build(case, out / "_corpus")
        dest = out / name
        dest.mkdir(exist_ok=True)
        onnx.save(onnx.load(path), dest / "model.onnx")  # one self-contained file
        np.savez(dest / "calib.npz", **random_data(dest / "model.onnx", 64, seed=1))
        np.savez(dest / "eval.npz", **random_data(dest / "model.onnx", 256, seed=2))
        _about(dest, *FAMILIES[name])
        entries.append(f"{name}/model.onnx")

    import build_llama

    dest = out / "llama-small"
    build_llama.build(dest, layers=2, dim=256, heads=4, ffn=704, vocab=4096)
    build_llama.write_data(dest, 4096, 64, 32, 64)
    _about(dest, *FAMILIES["llama-small"])
    entries.append("llama-small/llama-small.onnx")

    import build_tasks

    for name, builder in build_tasks.BUILDERS.items():
        dest = out / name
        if not (dest / "model.onnx").is_file():
            dest.mkdir(exist_ok=True)
            builder(dest, 1.0)  # writes its own zoo.json
        entries.append(f"{name}/model.onnx")
    (out / "zoo.txt").write_text("# models/build_zoo.py\n" + "\n".join(entries) + "\n")
    print(f"wrote {out / 'zoo.txt'}: {len(entries)} models")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
