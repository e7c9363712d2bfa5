"""Small seeded ONNX models written by real exporters, for checking that fp8onnx takes models from the wild.

``CASES`` maps a short name to a :class:`Case`; ``build(name, folder)`` writes that case's model under
``folder/name`` and returns its path and a calibration feed keyed by the model's real input names. Weights are
random (seeded), so every build is deterministic, a few hundred kB, and done in seconds on a 2-core CPU. Heavy
packages are imported inside the builders only: ``available(name)`` tells whether a case's packages are installed.

Cases, and the packages they were built with (``pip show``, Python 3.11, CPU only, no hub access):

- ``torch-{llama,bert,vit,cnn}-o{11,13,14,17}``: ``torch.onnx.export(..., dynamo=False)`` (the TorchScript
  exporter) of hand-written tiny models: a Llama-style decoder (RMSNorm as x * rsqrt(mean(x^2)), rotary, causal
  attention, grouped KV heads, SwiGLU), a BERT-style encoder (LayerNorm, erf GELU, padding mask, pooler), a ViT
  (patch Conv, class token, position embeddings, ``nn.TransformerEncoder``) and a CNN (Conv+BatchNorm+ReLU,
  pooling, Linear head; eval mode, so the exporter folds BatchNorm into Conv). Dynamic batch (and sequence) axes.
  Needs torch==2.13.0. ``torch-vit-o11`` and ``torch-vit-o13`` do not exist: torch 2.13 cannot export
  ``nn.MultiheadAttention`` there (``aten::unflatten`` needs opset 13, ``aten::scaled_dot_product_attention``
  opset 14).
- ``torch-{llama,bert,vit,cnn}-dynamo``: the same modules through ``torch.onnx.export(..., dynamo=True)`` at its
  default opset (20 with torch 2.13) with ``dynamic_shapes``; it inlines everything (no ONNX functions), and needs
  onnxscript (0.7.2) as well.
- ``torch-llama-fn``: the TorchScript exporter at opset 17 with ``export_modules_as_functions``, so the decoder
  blocks are ONNX local functions (domain ``wild``) whose weights come in as function inputs. torch==2.13.0.
  Its main graph and weights are byte-identical from build to build; the function body's internal value names
  are not (torch picks either block instance to write it from).
- ``hf-gpt2``, ``hf-llama-past``: a random-init GPT-2 / Llama from a tiny config (transformers 4.57.6), saved with
  ``save_pretrained`` and exported offline by Optimum (``optimum.exporters.onnx.main_export``, optimum-onnx
  0.1.0 with optimum 2.1.0, torch 2.13.0): ``text-generation`` (no past) and ``text-generation-with-past``
  (inputs ``past_key_values.N.key/value``, fed with a 0-length past axis, outputs ``present.*``).
- ``hf-gpt2-merged``: Optimum's merged decoder (one ``If`` on ``use_cache_branch``, both branches holding the
  whole decoder). optimum-onnx 0.1 no longer merges by default, so this exports the decoder and the decoder with
  past with its ``export`` and fuses them with its own ``optimum.onnx.merge_decoders``, as optimum 1.x did.
  ``use_cache_branch`` has shape [1], so its calibration data is in feed layout (see ``Case.layout``): one feed
  takes each branch, both with an empty past.
- ``genai-llama``, ``genai-llama-dml``: onnxruntime-genai's model builder (onnxruntime-genai 0.15.2, the newest
  whose builder imports with transformers 4.57: 0.16+ import Qwen3.5 classes from transformers 5; the builder also
  needs transformers 4.57.6, torch 2.13.0 and tokenizers 0.22.2 for the tiny tokenizer it insists on) run on a
  saved tiny LlamaForCausalLM. ``-p fp32 -e cpu`` gives packed QKV MatMuls and GroupQueryAttention with rotary
  inside it (no RotaryEmbedding node on CPU), SimplifiedLayerNormalization in the default domain,
  SkipSimplifiedLayerNormalization, weights in external data (``model.onnx.data``); ``-p fp16 -e dml`` is a
  float16 graph with separate RotaryEmbedding nodes and a ``position_ids`` input, which the CPU EP also runs.
- ``tf-cnn-o13``, ``tf-cnn-o15``: a graph shaped the way tf2onnx writes a Keras CNN (built with onnx.helper;
  tensorflow is too big to install here): NHWC input ``images:0`` with an ``unk__`` batch dim, Transposes to NCHW
  around Conv, ReduceMean with ``axes`` attribute, MatMul+Add dense head, ``:0``-suffixed '/'-separated names, and
  an ``ai.onnx.ml`` LabelEncoder that turns the arg-max class into a string output. onnx only.
- ``paddle-cnn-o11``: a graph shaped the way paddle2onnx writes one (onnx.helper): opset 11, every weight a
  ``Constant`` node (no initializers), declared dims of ``dim_value: -1``, Conv+BatchNormalization+Relu,
  ConvTranspose, Reduce ops with ``axes`` attribute, Reshape to [-1, C], MatMul+Add, Softmax at its default axis.
- ``ir3-mlp-o8``: an IR-version-3 model at opset 8 (onnx.helper) as very old exporters wrote them: every
  initializer also listed as a graph input; Gemm (transB) and MatMul+Add.

Every case also used numpy 2.4.6, onnx 1.23.2 and onnxruntime 1.32.0 (CPU EP, default session options; none
needed anything special to run). A ``[wild]`` extra would be: torch==2.13.0, transformers==4.57.6,
optimum-onnx==0.1.0 (brings optimum 2.1.0), onnxruntime-genai==0.15.2 (tokenizers comes with transformers).

Run ``python tests/wild/corpus.py FOLDER`` to build every case whose packages are installed, run each on
onnxruntime's CPU EP with its calibration feed, and print one line per case.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import io
import math
import os
import pathlib
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CASES", "Case", "available", "build", "feeds", "run_onnxruntime"]

SEED = 0
BATCH = 8  # calibration samples in every feed
SEQ = 16  # calibration tokens per sample
IMAGE = 32  # calibration images are IMAGE x IMAGE, 3 channels
# The shape every tiny transformer shares.
VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS = 256, 64, 4, 2, 2
HEAD_DIM = D_MODEL // HEADS

Feed = dict[str, np.ndarray]
Builder = Callable[[pathlib.Path], tuple[pathlib.Path, Feed]]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model from the wild: who wrote it, at which opset, what it needs, and how to build it.

    ``layout`` is how its calibration data is laid out, in fp8onnx's terms: ``"batch"`` (each array has the
    input's rank, samples on axis 0) or ``"feed"`` (one extra leading axis; each slice is one complete feed).
    """

    exporter: str
    opset: int | None  # None: the exporter's default
    requires: tuple[str, ...]  # import names
    build: Builder
    layout: str = "batch"


def build(name: str, folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    """Build case ``name`` into ``folder/name``; return the model's path and its calibration data."""
    out = pathlib.Path(folder) / name
    out.mkdir(parents=True, exist_ok=True)
    return CASES[name].build(out)


def available(name: str) -> bool:
    """Whether every package case ``name`` needs can be imported."""
    for module in CASES[name].requires:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except ModuleNotFoundError:
            return False
    return True


def feeds(data: Feed, layout: str) -> Iterator[Feed]:
    """The feeds that calibration data in ``layout`` stands for."""
    if layout == "batch":
        yield data
    else:
        for i in range(len(next(iter(data.values())))):
            yield {key: value[i] for key, value in data.items()}


def run_onnxruntime(path: pathlib.Path, data: Feed, layout: str = "batch") -> list[list[np.ndarray]]:
    """Run the model on onnxruntime's CPU EP at its default options, once per feed; float outputs must be finite."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    results = []
    for feed in feeds(data, layout):
        outputs = session.run(None, feed)
        for meta, value in zip(session.get_outputs(), outputs):
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise ValueError(f"{path}: output {meta.name} is not finite")
        results.append(outputs)
    return results


def _quietly(call: Callable, *args, **kwargs):
    """Exporters print progress and warn about tracing; the corpus only needs the file."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Calibration data


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds: IR < 4 models also list their initializers as inputs."""
    weights = {tensor.name for tensor in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in weights]


def _text_feed(path: pathlib.Path, *, padded: bool = False) -> Feed:
    """Token data for every input a text model declares, with an empty (0-length) past for KV-cache inputs."""
    model = onnx.load(path, load_external_data=False)
    rng = np.random.default_rng(SEED)
    mask = np.ones((BATCH, SEQ), np.int64)
    if padded:  # right padding, as a tokenizer pads a batch of sentences
        mask = (np.arange(SEQ) < rng.integers(SEQ // 2, SEQ + 1, (BATCH, 1))).astype(np.int64)
    feed = {}
    for value in _graph_inputs(model):
        name, tensor_type = value.name, value.type.tensor_type
        if name == "input_ids":
            array = rng.integers(0, VOCAB, (BATCH, SEQ))
        elif name == "attention_mask":
            array = mask
        elif name == "position_ids":
            array = np.broadcast_to(np.arange(SEQ), (BATCH, SEQ))
        elif name == "token_type_ids":
            array = (np.arange(SEQ) >= SEQ // 2).astype(np.int64)[None].repeat(BATCH, axis=0)
        elif name.startswith("past_key_values."):
            kv_heads = tensor_type.shape.dim[1].dim_value or KV_HEADS
            head_dim = tensor_type.shape.dim[3].dim_value or HEAD_DIM
            array = np.zeros((BATCH, kv_heads, 0, head_dim))
        elif name == "use_cache_branch":  # Optimum's merged decoder: one flag for the whole feed
            array = np.zeros(1, bool)
        else:
            raise KeyError(f"{path}: no calibration data for input {name}")
        feed[name] = np.ascontiguousarray(array, helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
    return feed


def _image_feed(name: str, shape: tuple[int, ...]) -> Feed:
    """Normalised-image-like data, samples on axis 0."""
    return {name: np.random.default_rng(SEED).standard_normal((BATCH, *shape)).astype(np.float32)}


def _pixel_feed(path: pathlib.Path) -> Feed:
    return _image_feed("pixel_values", (3, IMAGE, IMAGE))


# ---------------------------------------------------------------------------------------------------------------
# torch.onnx.export


@functools.cache
def _torch_modules() -> dict[str, type]:
    """The tiny torch models, defined on first use so that importing this file does not import torch."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float = 1e-6):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def split_heads(x, heads):
        batch, seq, _ = x.shape
        return x.reshape(batch, seq, heads, -1).transpose(1, 2)

    def merge_heads(x):
        batch, heads, seq, head_dim = x.shape
        return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)

    def attention(q, k, v, bias):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v

    def rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def repeat_kv(x):
        batch, _, seq, head_dim = x.shape
        return x[:, :, None].expand(batch, KV_HEADS, HEADS // KV_HEADS, seq, head_dim).reshape(batch, HEADS, seq, -1)

    class LlamaBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = RMSNorm(D_MODEL), RMSNorm(D_MODEL)
            self.q, self.o = (nn.Linear(D_MODEL, D_MODEL, bias=False) for _ in range(2))
            self.k, self.v = (nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM, bias=False) for _ in range(2))
            self.gate, self.up = (nn.Linear(D_MODEL, 2 * D_MODEL, bias=False) for _ in range(2))
            self.down = nn.Linear(2 * D_MODEL, D_MODEL, bias=False)

        def forward(self, x, cos, sin, bias):
            h = self.attn_norm(x)
            q = rotate(split_heads(self.q(h), HEADS), cos, sin)
            k = repeat_kv(rotate(split_heads(self.k(h), KV_HEADS), cos, sin))
            v = repeat_kv(split_heads(self.v(h), KV_HEADS))
            x = x + self.o(merge_heads(attention(q, k, v, bias)))
            h = self.mlp_norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    class TinyLlama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.blocks = nn.ModuleList(LlamaBlock() for _ in range(LAYERS))
            self.norm, self.lm_head = RMSNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB, bias=False)
            inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def forward(self, input_ids, attention_mask):
            pos = torch.arange(input_ids.shape[1])
            freqs = pos[:, None].float() * self.inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            masked = (pos[None, :] > pos[:, None])[None, None] | (attention_mask[:, None, None, :] == 0)
            bias = masked.float() * -1e9
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x, angles.cos(), angles.sin(), bias)
            return self.lm_head(self.norm(x))

    class EncoderBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.ff = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

        def forward(self, x, bias):
            q, k, v = (split_heads(t, HEADS) for t in self.qkv(x).chunk(3, dim=-1))
            x = self.norm1(x + self.out(merge_heads(attention(q, k, v, bias))))
            return self.norm2(x + self.ff(x))

    class TinyBert(nn.Module):
        def __init__(self, max_len: int = 64, labels: int = 3):
            super().__init__()
            self.word, self.position = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(max_len, D_MODEL)
            self.token_type, self.norm = nn.Embedding(2, D_MODEL), nn.LayerNorm(D_MODEL)
            self.blocks = nn.ModuleList(EncoderBlock() for _ in range(LAYERS))
            self.pooler, self.classifier = nn.Linear(D_MODEL, D_MODEL), nn.Linear(D_MODEL, labels)

        def forward(self, input_ids, attention_mask, token_type_ids):
            pos = torch.arange(input_ids.shape[1])
            x = self.norm(self.word(input_ids) + self.position(pos)[None] + self.token_type(token_type_ids))
            bias = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
            for block in self.blocks:
                x = block(x, bias)
            return x, self.classifier(torch.tanh(self.pooler(x[:, 0])))

    class TinyViT(nn.Module):
        def __init__(self, patch: int = 4, classes: int = 10):
            super().__init__()
            self.patch = nn.Conv2d(3, D_MODEL, patch, stride=patch)
            self.cls = nn.Parameter(torch.randn(1, 1, D_MODEL) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (IMAGE // patch) ** 2 + 1, D_MODEL) * 0.02)
            layer = nn.TransformerEncoderLayer(
                D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, classes)

        def forward(self, pixel_values):
            x = self.patch(pixel_values).flatten(2).transpose(1, 2)
            x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
            return self.head(self.norm(self.encoder(x))[:, 0])

    def conv_bn(cin, cout, stride=1):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    class SmallCNN(nn.Module):
        def __init__(self, classes: int = 10):
            super().__init__()
            self.features = nn.Sequential(conv_bn(3, 16), nn.MaxPool2d(2), conv_bn(16, 32, stride=2), conv_bn(32, 32))
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))

        def forward(self, pixel_values):
            return self.head(self.features(pixel_values))

    modules = {"llama": TinyLlama, "bert": TinyBert, "vit": TinyViT, "cnn": SmallCNN}
    modules["LlamaBlock"] = LlamaBlock  # exported as an ONNX function by torch-llama-fn
    for cls in modules.values():  # exporters name functions and scopes after module + qualname: make them stable
        cls.__module__, cls.__qualname__ = "wild", cls.__name__
    return modules


@dataclasses.dataclass(frozen=True)
class _TorchModel:
    inputs: dict[str, dict[int, str]]  # input name -> its dynamic axes
    outputs: tuple[str, ...]
    feed: Callable[[pathlib.Path], Feed]


_TEXT_AXES = {0: "batch", 1: "sequence"}
_TORCH_MODELS = {
    "llama": _TorchModel({"input_ids": _TEXT_AXES, "attention_mask": _TEXT_AXES}, ("logits",), _text_feed),
    "bert": _TorchModel(
        dict.fromkeys(("input_ids", "attention_mask", "token_type_ids"), _TEXT_AXES),
        ("last_hidden_state", "logits"),
        functools.partial(_text_feed, padded=True),
    ),
    "vit": _TorchModel({"pixel_values": {0: "batch"}}, ("logits",), _pixel_feed),
    "cnn": _TorchModel({"pixel_values": {0: "batch"}}, ("logits",), _pixel_feed),
}


def _torch_module(arch: str):
    """The seeded, eval-mode module; BatchNorm gets non-trivial running statistics to fold."""
    import torch

    torch.manual_seed(SEED)
    module = _torch_modules()[arch]()
    for layer in module.modules():
        if isinstance(layer, torch.nn.BatchNorm2d):
            for stat, low, high in ((layer.running_mean, -0.5, 0.5), (layer.running_var, 0.5, 2.0)):
                stat.uniform_(low, high)
            torch.nn.init.uniform_(layer.weight, 0.5, 1.5)
            torch.nn.init.uniform_(layer.bias, -0.2, 0.2)
    return module.eval()


def _torch_example(spec: _TorchModel) -> tuple:
    """Example arguments for tracing: batch 2, 8 tokens; a dynamic axis must not be traced at size 1."""
    import torch

    torch.manual_seed(SEED)
    example = {
        "input_ids": torch.randint(0, VOCAB, (2, 8)),
        "attention_mask": torch.ones(2, 8, dtype=torch.int64),
        "token_type_ids": torch.zeros(2, 8, dtype=torch.int64),
        "pixel_values": torch.randn(2, 3, IMAGE, IMAGE),
    }
    return tuple(example[name] for name in spec.inputs)


def _build_torch(
    arch: str, opset: int | None, folder: pathlib.Path, *, dynamo: bool = False, functions: bool = False
) -> tuple[pathlib.Path, Feed]:
    import torch

    spec, path = _TORCH_MODELS[arch], folder / "model.onnx"
    names = {"input_names": list(spec.inputs), "output_names": list(spec.outputs)}
    if dynamo:
        dims = {}  # one Dim per axis name, shared by every input that has it
        shapes = {
            name: {axis: dims.setdefault(dim, torch.export.Dim(dim, max=64)) for axis, dim in axes.items()}
            for name, axes in spec.inputs.items()
        }
        options = {"dynamo": True, "dynamic_shapes": shapes, "external_data": False, **names}
    else:
        options = {"dynamo": False, "dynamic_axes": spec.inputs, "opset_version": opset, **names}
        if functions:
            # One class only: with several, the function bodies depend on the order of a set of strings (hash seed).
            options["export_modules_as_functions"] = {_torch_modules()["LlamaBlock"]}
    _quietly(torch.onnx.export, _torch_module(arch), _torch_example(spec), path, **options)
    return path, spec.feed(path)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face transformers + Optimum, onnxruntime-genai


def _hf_causal_lm(kind: str, folder: pathlib.Path):
    """A random-init tiny causal LM from a config written here, saved as a local Hugging Face folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may wait on the hub
    import torch
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=D_MODEL,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=D_MODEL,
            intermediate_size=2 * D_MODEL,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=128,
            bos_token_id=1,
            eos_token_id=2,
        )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    source = folder / "source"
    model.save_pretrained(source)
    return model, source


def _build_optimum(kind: str, task: str, folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    _, source = _hf_causal_lm(kind, folder)
    from optimum.exporters.onnx import main_export

    _quietly(main_export, str(source), folder, task=task, do_validation=False)
    return folder / "model.onnx", _text_feed(folder / "model.onnx")


def _build_optimum_merged(folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    model, _ = _hf_causal_lm("gpt2", folder)
    from optimum.exporters.onnx import export
    from optimum.exporters.onnx.model_configs import GPT2OnnxConfig
    from optimum.onnx import merge_decoders

    parts = []
    for name, task, past_in_inputs in (
        ("decoder_model", "text-generation", False),
        ("decoder_with_past_model", "text-generation-with-past", True),
    ):
        config = GPT2OnnxConfig(model.config, task=task, use_past=True, use_past_in_inputs=past_in_inputs)
        parts.append(folder / f"{name}.onnx")
        _quietly(export, model, config, parts[-1])
    path = folder / "decoder_model_merged.onnx"
    merge_decoders(*parts, save_path=path)
    # Feed layout: use_cache_branch is one flag per feed, not per sample; one feed per branch.
    data = {name: np.stack([value, value]) for name, value in _text_feed(path).items()}
    data["use_cache_branch"] = np.array([[False], [True]])
    return path, data


def _build_genai(precision: str, provider: str, folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    _, source = _hf_causal_lm("llama", folder)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The builder copies the tokenizer next to the model for onnxruntime-genai; a word-level one will do.
    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<0>", bos_token="<1>", eos_token="<2>"
    ).save_pretrained(source)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(folder)]
    command += ["-p", precision, "-e", provider, "-c", str(folder / "cache")]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise RuntimeError(f"onnxruntime-genai builder failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return folder / "model.onnx", _text_feed(folder / "model.onnx")


# ---------------------------------------------------------------------------------------------------------------
# Graphs written with onnx.helper the way other exporters write them


def _weights(rng: np.random.Generator, **shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Seeded float32 weights, scaled by fan-in like a trained layer's."""
    return {
        name: (rng.standard_normal(shape) / math.sqrt(max(1, math.prod(shape[1:])))).astype(np.float32)
        for name, shape in shapes.items()
    }


def _save(
    graph: onnx.GraphProto,
    folder: pathlib.Path,
    producer: str,
    ir_version: int,
    opsets: dict[str, int],
    *,
    full_check: bool = True,
) -> pathlib.Path:
    model = helper.make_model(
        graph,
        producer_name=producer,
        ir_version=ir_version,
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opsets.items()],
    )
    onnx.checker.check_model(model, full_check=full_check)
    path = folder / "model.onnx"
    onnx.save(model, path)
    return path


def _build_tf2onnx(opset: int, folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    """Keras Conv2D(relu) -> GlobalAveragePooling2D -> Dense(softmax), then class-id -> name, as tf2onnx writes it."""
    classes, labels = 5, ["cat", "dog", "bird", "fish", "frog"]
    w = _weights(np.random.default_rng(SEED), conv=(16, 3, 3, 3), conv_b=(16,), dense=(16, classes), dense_b=(classes,))
    init = [
        numpy_helper.from_array(w["conv"], "model/conv2d/Conv2D/ReadVariableOp:0"),
        numpy_helper.from_array(w["conv_b"], "model/conv2d/BiasAdd/ReadVariableOp:0"),
        numpy_helper.from_array(w["dense"], "model/dense/MatMul/ReadVariableOp:0"),
        numpy_helper.from_array(w["dense_b"], "model/dense/BiasAdd/ReadVariableOp:0"),
    ]
    node = helper.make_node
    nodes = [
        node("Transpose", ["images:0"], ["model/conv2d/Conv2D__6:0"], "model/conv2d/Conv2D__6", perm=[0, 3, 1, 2]),
        node(
            "Conv",
            ["model/conv2d/Conv2D__6:0", init[0].name, init[1].name],
            ["model/conv2d/BiasAdd:0"],
            "model/conv2d/BiasAdd",
            kernel_shape=[3, 3],
            strides=[1, 1],
            pads=[1, 1, 1, 1],
            dilations=[1, 1],
        ),
        node("Relu", ["model/conv2d/BiasAdd:0"], ["model/conv2d/Relu:0"], "model/conv2d/Relu"),
        node(
            "Transpose", ["model/conv2d/Relu:0"], ["model/conv2d/Relu__8:0"], "model/conv2d/Relu__8", perm=[0, 2, 3, 1]
        ),
        node(
            "ReduceMean",
            ["model/conv2d/Relu__8:0"],
            ["model/global_average_pooling2d/Mean:0"],
            "model/global_average_pooling2d/Mean",
            axes=[1, 2],
            keepdims=0,
        ),
        node(
            "MatMul",
            ["model/global_average_pooling2d/Mean:0", init[2].name],
            ["model/dense/MatMul:0"],
            "model/dense/MatMul",
        ),
        node("Add", ["model/dense/MatMul:0", init[3].name], ["model/dense/BiasAdd:0"], "model/dense/BiasAdd"),
        node("Softmax", ["model/dense/BiasAdd:0"], ["probabilities:0"], "model/dense/Softmax", axis=-1),
        node("ArgMax", ["probabilities:0"], ["model/ArgMax:0"], "model/ArgMax", axis=-1, keepdims=0),
        node(
            "LabelEncoder",
            ["model/ArgMax:0"],
            ["label:0"],
            "model/LabelEncoder",
            domain="ai.onnx.ml",
            keys_int64s=list(range(classes)),
            values_strings=labels,
            default_string="unknown",
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "tf2onnx",
        [helper.make_tensor_value_info("images:0", TensorProto.FLOAT, ["unk__19", IMAGE, IMAGE, 3])],
        [
            helper.make_tensor_value_info("probabilities:0", TensorProto.FLOAT, ["unk__20", classes]),
            helper.make_tensor_value_info("label:0", TensorProto.STRING, ["unk__21"]),
        ],
        init,
    )
    ir_version = {13: 7, 15: 8}[opset]  # what tf2onnx 1.17 stamps at these opsets
    path = _save(graph, folder, "tf2onnx", ir_version, {"": opset, "ai.onnx.ml": 2})
    return path, _image_feed("images:0", (IMAGE, IMAGE, 3))


def _build_paddle2onnx(folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    """Conv-BN-ReLU trunk with a classifier head and an upsampling head, as paddle2onnx writes it at opset 11."""
    classes, channels = 10, 16
    weights = _weights(
        np.random.default_rng(SEED),
        **{
            "conv2d_0.w_0": (channels, 3, 3, 3),
            "batch_norm_0.w_0": (channels,),
            "batch_norm_0.b_0": (channels,),
            "batch_norm_0.w_1": (channels,),
            "conv2d_transpose_0.w_0": (channels, 4, 2, 2),
            "linear_0.w_0": (channels, classes),
            "linear_0.b_0": (classes,),
        },
    )
    weights["batch_norm_0.w_0"] += 1.0  # scale near 1
    weights["batch_norm_0.w_2"] = np.linspace(0.5, 2.0, channels, dtype=np.float32)  # running variance > 0
    weights["reshape2_0.shape"] = np.array([-1, channels], np.int64)
    node = helper.make_node
    nodes = [
        node("Constant", [], [name], value=numpy_helper.from_array(value, name)) for name, value in weights.items()
    ]
    nodes += [
        node("Conv", ["x", "conv2d_0.w_0"], ["conv2d_0.tmp_0"], "p2o.Conv.0", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        node(
            "BatchNormalization",
            ["conv2d_0.tmp_0", "batch_norm_0.w_0", "batch_norm_0.b_0", "batch_norm_0.w_1", "batch_norm_0.w_2"],
            ["batch_norm_0.tmp_2"],
            "p2o.BatchNormalization.0",
            epsilon=1e-5,
            momentum=0.9,
        ),
        node("Relu", ["batch_norm_0.tmp_2"], ["relu_0.tmp_0"], "p2o.Relu.0"),
        node(
            "ConvTranspose",
            ["relu_0.tmp_0", "conv2d_transpose_0.w_0"],
            ["conv2d_transpose_0.tmp_0"],
            "p2o.ConvTranspose.0",
            kernel_shape=[2, 2],
            strides=[2, 2],
        ),
        node("ReduceMean", ["relu_0.tmp_0"], ["pool2d_0.tmp_0"], "p2o.ReduceMean.0", axes=[2, 3], keepdims=1),
        node("Reshape", ["pool2d_0.tmp_0", "reshape2_0.shape"], ["reshape2_0.tmp_0"], "p2o.Reshape.0"),
        node("MatMul", ["reshape2_0.tmp_0", "linear_0.w_0"], ["linear_0.tmp_0"], "p2o.MatMul.0"),
        node("Add", ["linear_0.tmp_0", "linear_0.b_0"], ["linear_0.tmp_1"], "p2o.Add.0"),
        node("Softmax", ["linear_0.tmp_1"], ["softmax_0.tmp_0"], "p2o.Softmax.0"),
        node("ReduceMax", ["softmax_0.tmp_0"], ["reduce_max_0.tmp_0"], "p2o.ReduceMax.0", axes=[1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "paddle2onnx",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, -1])],
        [
            helper.make_tensor_value_info("softmax_0.tmp_0", TensorProto.FLOAT, [-1, classes]),
            helper.make_tensor_value_info("reduce_max_0.tmp_0", TensorProto.FLOAT, [-1]),
            helper.make_tensor_value_info("conv2d_transpose_0.tmp_0", TensorProto.FLOAT, [-1, 4, -1, -1]),
        ],
    )
    # Shape inference rejects dim_value -1 (it infers its own unknown dims), so only the plain check runs here.
    path = _save(graph, folder, "PaddlePaddle", 6, {"": 11}, full_check=False)
    return path, _image_feed("x", (3, IMAGE, IMAGE))


def _build_ir3(folder: pathlib.Path) -> tuple[pathlib.Path, Feed]:
    """A two-layer MLP at IR version 3, initializers repeated as graph inputs as pre-IR-4 exporters required."""
    features, hidden, classes = 32, 64, 10
    w = _weights(
        np.random.default_rng(SEED),
        fc1_w=(hidden, features),
        fc1_b=(hidden,),
        fc2_w=(hidden, classes),
        fc2_b=(classes,),
    )
    init = [numpy_helper.from_array(value, name) for name, value in w.items()]
    nodes = [
        helper.make_node("Gemm", ["data", "fc1_w", "fc1_b"], ["fc1"], "fc1", transB=1),
        helper.make_node("Relu", ["fc1"], ["relu1"], "relu1"),
        helper.make_node("MatMul", ["relu1", "fc2_w"], ["fc2_mm"], "fc2_mm"),
        helper.make_node("Add", ["fc2_mm", "fc2_b"], ["fc2"], "fc2"),
        helper.make_node("Softmax", ["fc2"], ["prob"], "prob"),
    ]
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["N", features])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in init]
    graph = helper.make_graph(
        nodes, "ir3", inputs, [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", classes])], init
    )
    path = _save(graph, folder, "onnx.helper (IR 3)", 3, {"": 8})
    return path, {"data": np.random.default_rng(SEED).standard_normal((BATCH, features)).astype(np.float32)}


# ---------------------------------------------------------------------------------------------------------------
# The registry

_TORCH = ("torch",)
_HF = ("torch", "transformers", "optimum.exporters.onnx")
_GENAI = ("torch", "transformers", "tokenizers", "onnxruntime_genai")
# torch 2.13 cannot export nn.MultiheadAttention below opset 14 (aten::unflatten, aten::scaled_dot_product_attention).
_TORCH_SKIPPED = {("vit", 11), ("vit", 13)}

CASES: dict[str, Case] = {
    f"torch-{arch}-o{opset}": Case(
        "torch.onnx.export (TorchScript)", opset, _TORCH, functools.partial(_build_torch, arch, opset)
    )
    for arch in _TORCH_MODELS
    for opset in (11, 13, 14, 17)
    if (arch, opset) not in _TORCH_SKIPPED
}
CASES |= {
    f"torch-{arch}-dynamo": Case(
        "torch.onnx.export (dynamo)",
        None,
        (*_TORCH, "onnxscript"),
        functools.partial(_build_torch, arch, None, dynamo=True),
    )
    for arch in _TORCH_MODELS
}
CASES |= {
    "torch-llama-fn": Case(
        "torch.onnx.export (TorchScript, functions)",
        17,
        _TORCH,
        functools.partial(_build_torch, "llama", 17, functions=True),
    ),
    "hf-gpt2": Case("optimum main_export", None, _HF, functools.partial(_build_optimum, "gpt2", "text-generation")),
    "hf-llama-past": Case(
        "optimum main_export", None, _HF, functools.partial(_build_optimum, "llama", "text-generation-with-past")
    ),
    "hf-gpt2-merged": Case("optimum export + merge_decoders", None, _HF, _build_optimum_merged, layout="feed"),
    "genai-llama": Case("onnxruntime-genai builder", 21, _GENAI, functools.partial(_build_genai, "fp32", "cpu")),
    "genai-llama-dml": Case("onnxruntime-genai builder", 21, _GENAI, functools.partial(_build_genai, "fp16", "dml")),
    "tf-cnn-o13": Case("tf2onnx-style onnx.helper", 13, ("onnx",), functools.partial(_build_tf2onnx, 13)),
    "tf-cnn-o15": Case("tf2onnx-style onnx.helper", 15, ("onnx",), functools.partial(_build_tf2onnx, 15)),
    "paddle-cnn-o11": Case("paddle2onnx-style onnx.helper", 11, ("onnx",), _build_paddle2onnx),
    "ir3-mlp-o8": Case("onnx.helper IR 3", 8, ("onnx",), _build_ir3),
}


# ---------------------------------------------------------------------------------------------------------------
# python tests/wild/corpus.py FOLDER


def _graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every subgraph below it (If/Loop/Scan bodies)."""
    pending = [model.graph]
    while pending:
        graph = pending.pop()
        yield graph
        for node in graph.node:
            for attribute in node.attribute:
                pending.extend([attribute.g] if attribute.HasField("g") else attribute.graphs)


def _op_counts(path: pathlib.Path) -> collections.Counter:
    model = onnx.load(path, load_external_data=False)
    nodes = [node for graph in _graphs(model) for node in graph.node]
    nodes += [node for function in model.functions for node in function.node]
    return collections.Counter(node.op_type for node in nodes)


def _summary(name: str, path: pathlib.Path, seconds: float) -> str:
    model = onnx.load(path, load_external_data=False)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    counts = _op_counts(path)
    size = sum(f.stat().st_size for f in path.parent.iterdir() if f.name.startswith(path.name))
    ops = " ".join(f"{counts[op]:>3}" for op in ("MatMul", "Gemm", "Conv", "ConvTranspose"))
    return (
        f"{name:<18} {CASES[name].exporter:<42} {opset:>5} {model.ir_version:>3} {ops} {seconds:6.1f} {size / 1e3:7.0f}"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python corpus.py FOLDER", file=sys.stderr)
        return 2
    folder = pathlib.Path(argv[0])
    print(f"{'case':<18} {'exporter':<42} opset  ir  MM Gem Cnv CvT  build s    kB")
    total = time.perf_counter()
    for name, case in CASES.items():
        if not available(name):
            print(f"{name:<18} skipped: needs {', '.join(case.requires)}")
            continue
        start = time.perf_counter()
        path, data = build(name, folder)
        seconds = time.perf_counter() - start
        run_onnxruntime(path, data, case.layout)
        print(_summary(name, path, seconds), flush=True)
    print(f"total {time.perf_counter() - total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
