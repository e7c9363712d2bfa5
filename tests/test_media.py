"""`fp8onnx data` from images (rendered here with Pillow) and audio (written here with soundfile):
the preprocessing computed by hand for one file, class subfolders as labels, layouts, resampling,
chunking with a mask, and bad files as one sentence with exit 2."""

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.cli import main

Image = pytest.importorskip("PIL.Image")
ImageDraw = pytest.importorskip("PIL.ImageDraw")


def _cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def _classifier(path, shape, layout="nchw"):
    """pixels -> per-channel mean over the image -> a 3 x 2 Gemm: logits for two classes."""
    axes = [2, 3] if layout == "nchw" else [1, 2]
    channels = shape[1] if layout == "nchw" else shape[3]
    nodes = [
        helper.make_node("ReduceMean", ["pixels"], ["m"], axes=axes, keepdims=0),
        helper.make_node("Gemm", ["m", "w", "b"], ["logits"]),
    ]
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        nodes,
        "cls",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", *shape[1:]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [
            numpy_helper.from_array(rng.standard_normal((channels, 2)).astype(np.float32), "w"),
            numpy_helper.from_array(np.zeros(2, np.float32), "b"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture()
def images(tmp_path):
    """Two classes of real PNG/JPEG files: red discs and blue squares, of several sizes."""
    root = tmp_path / "images"
    for cls, color, shape in (("discs", (220, 30, 30), "ellipse"), ("squares", (30, 40, 200), "rectangle")):
        (root / cls).mkdir(parents=True)
        for i, (w, h) in enumerate([(40, 30), (24, 24), (50, 64)]):
            im = Image.new("RGB", (w, h), (250, 250, 240))
            getattr(ImageDraw.Draw(im), shape)((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=color)
            im.save(root / cls / f"{i}.{'png' if i % 2 == 0 else 'jpg'}")
    return root


def test_a_folder_of_images_becomes_normalised_batches_with_class_labels(tmp_path, images):
    model = _classifier(tmp_path / "cls.onnx", [1, 3, 16, 16])
    out = tmp_path / "d.npz"
    r = _cli("data", model, images, "--mean", "0.5,0.4,0.3", "--std", "0.2,0.25,0.3", "-o", out)
    assert r.exit_code == 0, r.output
    data = np.load(out)
    assert data["pixels"].shape == (6, 3, 16, 16) and data["pixels"].dtype == np.float32
    np.testing.assert_array_equal(data["labels"], [0, 0, 0, 1, 1, 1])
    # by hand for the first file (40 x 30): shorter side to 16 -> 21 x 16, center crop 16 x 16
    im = Image.open(images / "discs" / "0.png").convert("RGB").resize((21, 16), Image.BILINEAR)
    pixels = np.asarray(im.crop((2, 0, 18, 16)), np.float32) / 255.0
    expected = ((pixels - [0.5, 0.4, 0.3]) / np.array([0.2, 0.25, 0.3], np.float32)).transpose(2, 0, 1)
    np.testing.assert_allclose(data["pixels"][0], expected, rtol=1e-6, atol=1e-6)
    assert "subfolder" in r.output and "nchw" in r.output


def test_nhwc_bgr_and_grey(tmp_path, images):
    nhwc = _classifier(tmp_path / "nhwc.onnx", [1, 8, 8, 3], layout="nhwc")
    assert _cli("data", nhwc, images / "discs", "-o", tmp_path / "a.npz").exit_code == 0
    rgb = np.load(tmp_path / "a.npz")["pixels"]
    assert rgb.shape == (3, 8, 8, 3) and "labels" not in np.load(tmp_path / "a.npz").files  # no class folders
    assert _cli("data", nhwc, images / "discs", "--channels", "bgr", "-o", tmp_path / "b.npz").exit_code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "b.npz")["pixels"], rgb[..., ::-1])
    grey = _classifier(tmp_path / "grey.onnx", [1, 1, 12, 12])
    assert _cli("data", grey, images, "-o", tmp_path / "g.npz").exit_code == 0
    assert np.load(tmp_path / "g.npz")["pixels"].shape == (6, 1, 12, 12)


def test_images_straight_to_calib_and_data(tmp_path, images):
    model = _classifier(tmp_path / "cls.onnx", [1, 3, 16, 16])
    r = _cli("quantize", model, "--calib", images, "-o", tmp_path / "q.onnx")
    assert r.exit_code == 0, r.output
    r = _cli("compare", model, tmp_path / "q.onnx", "--data", images)
    assert r.exit_code == 0 and "accuracy" in r.output, r.output


sf = pytest.importorskip("soundfile")


def _audio_model(path, samples="samples"):
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["input_values", "mf"], ["x"]),
            helper.make_node("MatMul", ["x", "w"], ["features"]),
        ],
        "speech",
        [
            helper.make_tensor_value_info("input_values", TensorProto.FLOAT, ["batch", samples]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", samples]),
        ],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.ones((1600, 4), np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_wav_and_flac_are_mixed_down_resampled_and_chunked(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    t8 = np.arange(8000) / 8000
    sf.write(clips / "a.wav", np.sin(2 * np.pi * 440 * t8).astype(np.float32), 8000)  # 1 s at 8 kHz
    t44 = np.arange(22050) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 220 * t44), np.zeros_like(t44)], axis=1)
    sf.write(clips / "b.flac", stereo, 44100)  # 0.5 s stereo at 44.1 kHz
    model = _audio_model(tmp_path / "speech.onnx")
    out = tmp_path / "a.npz"
    r = _cli("data", model, clips, "--sample-rate", 16000, "--chunk", 1600, "-o", out)
    assert r.exit_code == 0, r.output
    data = np.load(out)
    # a.wav: 16,000 samples -> 10 chunks; b.flac: 8,000 samples -> 5 chunks
    assert data["input_values"].shape == (15, 1600) and data["attention_mask"].shape == (15, 1600)
    assert data["attention_mask"].all()
    peak = np.abs(data["input_values"][10:]).max()
    assert 0.45 < peak < 0.55  # mono = the mean of the channels: half of a full-scale left channel
    np.testing.assert_allclose(np.abs(data["input_values"][:10]).max(), 1.0, atol=0.02)
    r = _cli("data", model, clips / "a.wav", "--sample-rate", 16000, "--chunk", 1500, "-o", tmp_path / "c.npz")
    mask = np.load(tmp_path / "c.npz")["attention_mask"]
    assert len(mask) == 11 and mask[-1].sum() == 16000 - 10 * 1500 and (mask[-1][1000:] == 0).all()


@pytest.mark.parametrize(
    "case, message",
    [
        ("broken-image", "cannot be decoded"),
        ("broken-audio", "cannot be decoded"),
        ("rate", "is at 500 Hz"),
        ("empty-folder", "is not a text file (.txt, .jsonl), images"),
        ("no-pillow", "pip install 'fp8onnx[image]'"),
        ("no-soundfile", "pip install 'fp8onnx[audio]'"),
        ("wrong-input", "needs one float input of rank 4 for images"),
    ],
)
def test_bad_media_is_one_sentence_and_exit_2(tmp_path, monkeypatch, case, message):
    folder = tmp_path / "src"
    folder.mkdir()
    model = _classifier(tmp_path / "cls.onnx", [1, 3, 8, 8])
    if case == "broken-image":
        Image.new("RGB", (8, 8)).save(folder / "ok.png")
        (folder / "zz.png").write_bytes(b"\x89PNG not really")
    elif case in ("broken-audio", "rate", "no-soundfile"):
        model = _audio_model(tmp_path / "speech.onnx")
        if case == "broken-audio":
            (folder / "x.wav").write_bytes(b"RIFF....WAVEfmt garbage")
        else:
            sf.write(
                folder / "x.wav",
                np.zeros(500 if case == "rate" else 1600, np.float32),
                500 if case == "rate" else 16000,
            )
    elif case in ("no-pillow", "wrong-input"):
        Image.new("RGB", (8, 8)).save(folder / "ok.png")
        if case == "wrong-input":
            model = _audio_model(tmp_path / "speech.onnx")
    if case == "no-pillow":
        monkeypatch.setitem(__import__("sys").modules, "PIL", None)
    if case == "no-soundfile":
        monkeypatch.setitem(__import__("sys").modules, "soundfile", None)
    r = _cli("data", model, folder, "-o", tmp_path / "out.npz")
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.count("\n") == 1, r.output
    assert not (tmp_path / "out.npz").exists() and not list(tmp_path.glob(".*"))


def test_an_export_folders_preprocessor_config_gives_the_defaults(tmp_path, images):
    import json

    folder = tmp_path / "export"
    folder.mkdir()
    _classifier(folder / "model.onnx", [1, 3, 8, 8])
    config = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25], "size": {"shortest_edge": 10}}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    assert _cli("data", folder, images, "-o", tmp_path / "a.npz").exit_code == 0
    assert _cli("data", folder / "model.onnx", images, "-o", tmp_path / "b.npz").exit_code == 0  # no folder: no config
    a, b = np.load(tmp_path / "a.npz")["pixels"], np.load(tmp_path / "b.npz")["pixels"]
    # b is in [0, 1], cropped from a 8-pixel shorter side; a is (x - 0.5) / 0.25 of a 10-pixel one, cropped
    assert b.min() >= 0 and b.max() <= 1 and a.min() < 0 and not np.allclose(a, (b - 0.5) / 0.25)
    im = Image.open(images / "discs" / "0.png").convert("RGB").resize((13, 10), Image.BILINEAR)
    pixels = np.asarray(im.crop((2, 1, 10, 9)), np.float32) / 255.0
    np.testing.assert_allclose(a[0], ((pixels - 0.5) / 0.25).transpose(2, 0, 1), rtol=1e-6, atol=1e-6)
