"""models/build_tasks.py: the zoo's six task models build, run on onnxruntime with their own data,
carry their family and options, and quantize with those options (Conv/ConvTranspose included)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import fp8onnx
from fp8onnx.experiments.zoo import find_models

from helpers import sqnr_db

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("torch")
    from fp8onnx.models import build_tasks

    out = tmp_path_factory.mktemp("tasks")
    for name, builder in build_tasks.BUILDERS.items():
        if name == "unet" and not _has("sklearn"):  # its digits come from scikit-learn
            continue
        (out / name).mkdir()
        builder(out / name, 0.005)  # a few training steps: structure and data, not accuracy
    return out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_each_model_runs_on_its_own_data_with_labels_where_it_has_a_task(built):
    families = {}
    for model in find_models(built):
        session = ort.InferenceSession(
            str(pathlib.Path(model.model) / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        data = dict(np.load(model.data))
        feed = {i.name: data[i.name][:5] for i in session.get_inputs()}
        out = session.run(None, feed)[0]
        assert out.shape[0] == 5 and np.isfinite(out).all()
        if "labels" in data:  # argmax over the last axis scores the labels (compare's task accuracy)
            assert out.shape[:-1] == data["labels"][:5].shape
        families[model.name] = model.family
        calib = dict(np.load(model.calib))
        assert set(calib) == {i.name for i in session.get_inputs()} and "labels" not in calib
    assert families["translator"] == "translation" and families["segmenter"] == "segmentation"
    assert families["detector"] == "detection" and families["text-classifier"] == "classification"
    dynamo = onnx.load(built / "text-classifier" / "model.onnx")
    assert dynamo.opset_import[0].version == 18  # torch.onnx.export(dynamo=True)


def test_the_segmenter_quantizes_its_convolutions_with_its_zoo_options(built, tmp_path):
    folder = built / "segmenter"
    options = json.loads((folder / "zoo.json").read_text())["options"]
    assert "ConvTranspose" in options["op_types"]
    out = tmp_path / "seg.onnx"
    fp8onnx.quantize(folder / "model.onnx", out, folder / "calib.npz", preset="none", **options)
    quantized = onnx.load(out)
    fed = {n.input[1] for n in quantized.graph.node if n.op_type in ("Conv", "ConvTranspose")}
    dq = {n.output[0] for n in quantized.graph.node if n.op_type == "DequantizeLinear"}
    assert fed and fed <= dq  # every Conv and ConvTranspose reads a dequantized float8 weight
    image = np.load(folder / "eval.npz")["image"][:16]
    ref = ort.InferenceSession(str(folder / "model.onnx")).run(None, {"image": image})[0]
    got = ort.InferenceSession(str(out)).run(None, {"image": image})[0]
    assert sqnr_db(ref, got) > 15.0
