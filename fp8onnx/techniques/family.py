"""Which family a model belongs to, told from its graph alone, and the preset measured best for it
(``--preset auto``).

The rules, in order:

- **decoder LLM**: token ids in (an integer ``*input_ids`` input) and a vocabulary projection out
  (a MatMul/Gemm as wide as an embedding table, or at least 16384 outputs), or an output of scores
  over the whole vocabulary at every position; KV-cache inputs or a causal mask (``Trilu``,
  GroupQueryAttention) make it certain, and are named. Preset
  ``llm-weight-only`` (float8 weights, activations in float): on SmolLM2-135M every recipe with FP8
  activations lost ~1% of FP16's next-token accuracy, below the FP8 LLM paper's 99.5%; the summary
  says so and names ``--preset llm``. With ``--native-gemm`` (FP8 GEMMs need FP8 activations with
  one static scale per tensor, what GemmFloat8 takes) a decoder or an encoder gets ``--preset none``.
- **encoder**: token ids in, no vocabulary projection (sentence embeddings, classifiers). Preset
  ``encoder``.
- **CNN / vision**: Conv nodes at least as many as MatMul/Gemm nodes. Preset ``cnn``.
- **speech / audio**: a float input named like audio (``input_values``, ``input_features``,
  ``audio``, ``waveform``, ``mel``, ``speech``) or 1-D convolutions: plain per-tensor amax on
  MatMul/Gemm only, Conv layers kept in float (a vocoder's Conv stack can collapse in FP8): what is
  safe.
- **other**: plain per-tensor static amax (``--preset none``, the FP8 LLM paper's method).
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir

from fp8onnx.data.text import PAST as _PAST
from fp8onnx.data.text import vocabulary_size
from fp8onnx.graph import known
from fp8onnx.graph.plan import vocabulary_projections
from fp8onnx.settings.config import PRESETS

__all__ = ["Family", "detect_family"]

_AUDIO = re.compile(r"input_values|input_features|audio|waveform|wav|mel|speech|fbank", re.IGNORECASE)
_INTEGER = (ir.DataType.INT64, ir.DataType.INT32)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # "decoder LLM", "encoder", "CNN", "speech", "other"
    preset: str | None  # the PRESETS entry applied, or None for plain per-tensor amax
    why: str  # what in the graph said so

    def describe(self) -> str:
        recipe = f"--preset {self.preset}" if self.preset else "--preset none (plain per-tensor static amax)"
        line = f"model family: {self.name} ({self.why}); applied {recipe}"
        if self.preset == "llm-weight-only":
            line += (
                "; activations stay in float (FP8 activations kept ~99.0% of FP16's next-token accuracy on "
                "SmolLM2-135M, below 99.5%; --preset llm gives them, per token)"
            )
        if self.name == "speech":
            line += "; Conv layers stay in float (a vocoder's Conv stack can collapse in FP8)"
        return line

    def to_json(self) -> dict:
        return {
            "summary": self.describe(),
            "family": self.name,
            "why": self.why,
            "preset": self.preset or "none",
            "recipe_measured": PRESETS[self.preset]["why"] if self.preset else None,
        }


def detect_family(model: ir.Model, fp8_gemm: bool = False) -> Family:
    """``model``'s family and preset; ``fp8_gemm``: the user asked for FP8 GEMMs (``--native-gemm``),
    which take static per-tensor FP8 activations, so a decoder or an encoder gets plain amax (None)."""

    graph = model.graph
    inputs = [v for v in graph.inputs if v.const_value is None]
    nodes = list(ir.traversal.RecursiveGraphIterator(graph))
    ops = [n.op_type for n in nodes]
    matmuls = [n for n in nodes if n.op_type in ("MatMul", "Gemm")]
    convs = [n for n in nodes if n.op_type in ("Conv", "ConvTranspose")]
    tokens = [known.name(v) for v in inputs if "input_ids" in known.name(v) and v.dtype in _INTEGER]
    if tokens:
        vocab = vocabulary_projections(model, matmuls)
        signs = []
        past = [known.name(v) for v in inputs if _PAST.search(known.name(v))]
        if past:
            signs.append(f"{len(past)} KV-cache inputs")
        if "Trilu" in ops or "GroupQueryAttention" in ops:
            signs.append("a causal mask" if "Trilu" in ops else "GroupQueryAttention")
        logits = [v.name for v in graph.outputs if v.name == "logits"]
        rows = vocabulary_size(model, tokens[0])  # scores over the vocabulary at every position: an LM head
        per_token = [
            v.name for v in graph.outputs if rows and v.shape is not None and len(v.shape) == 3 and v.shape[-1] == rows
        ]
        if vocab:
            head, why = next(iter(vocab.items()))
            signs.append(f"{head}: {why}")
        elif per_token:  # a small vocabulary: its scores at every position say it
            signs.append(f"{per_token[0]!r}: scores over the {rows}-token vocabulary at every position")
        elif signs and logits:  # a small vocabulary (bytes): the causal structure and its logits say it
            signs.append("a 'logits' output")
        if vocab or per_token or (signs and logits):
            why = f"token input {tokens[0]!r}, " + ", ".join(signs)
            return Family("decoder LLM", None if fp8_gemm else "llm-weight-only", why + _gemm(fp8_gemm))
        why = f"token input {tokens[0]!r}, no vocabulary projection"
        return Family("encoder", None if fp8_gemm else "encoder", why + _gemm(fp8_gemm))
    audio = [known.name(v) for v in inputs if _AUDIO.search(known.name(v)) and v.dtype not in _INTEGER]
    conv1d = [n for n in convs if (w := n.inputs[1]) is not None and w.shape is not None and len(w.shape) == 3]
    if audio or (conv1d and len(conv1d) * 2 >= len(convs)):
        why = f"audio input {audio[0]!r}" if audio else f"{len(conv1d)} 1-D convolutions"
        return Family("speech", None, why)
    if convs and len(convs) >= len(matmuls):
        return Family("CNN", "cnn", f"{len(convs)} Conv/ConvTranspose nodes, {len(matmuls)} MatMul/Gemm")
    return Family("other", None, f"{len(matmuls)} MatMul/Gemm nodes, no token or image input recognised")


def _gemm(fp8_gemm: bool) -> str:
    return "; --native-gemm: GemmFloat8 takes static per-tensor scales" if fp8_gemm else ""
