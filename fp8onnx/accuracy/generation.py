"""Greedy generation over an export's ONNX models, with plain onnxruntime sessions.

One engine serves two jobs: the calibration data of every model of an export folder (a decoder with
past sees the KV caches its own prefill wrote; the decoder of an encoder-decoder sees the encoder's
real outputs), and generation fidelity in ``compare`` (tokens before the first divergence from FP32).

The roles a model can play (see :mod:`fp8onnx.workflows.exports` for how a folder's files map to them):

- ``decoder``: token ids in, ``logits`` out; with ``past_key_values.*`` inputs it is also the decode
  step (onnxruntime-genai's model, Optimum's ``model.onnx`` with past), without them every step
  reruns the whole sequence (a plain causal LM);
- ``decoder_with_past``: the decode step of a split export (Optimum's ``decoder_with_past_model``);
- ``decoder_merged``: both in one model, told apart by its ``use_cache_branch`` input;
- ``encoder``: run once on the prompt; its ``last_hidden_state`` and the prompt's attention mask
  become the decoder's ``encoder_hidden_states`` / ``encoder_attention_mask``.

Inputs are filled by name: ``input_ids``, ``attention_mask`` (all ones: prompts are unpadded windows
of equal length), ``position_ids``, ``past_key_values.X`` from the previous step's ``present.X``
(empty, with a 0-length past axis, before the first), ``use_cache_branch``, the encoder's outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
from collections.abc import Callable

import numpy as np

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.feeds import InputSpec
from fp8onnx.data.kv_cache import past_shape

__all__ = ["ROLES", "Generator", "agreement"]

logger = logging.getLogger(__name__)
ROLES = ("encoder", "decoder", "decoder_with_past", "decoder_merged")
_PAST = re.compile(r"^past_key_values\.")
_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def session_specs(session) -> list[InputSpec]:
    specs = []
    for arg in session.get_inputs():
        if arg.type not in _TYPES:
            raise Fp8OnnxError(f"Model input {arg.name!r} has type {arg.type}, which generation cannot fill.")
        dims = tuple(d if isinstance(d, int) and d > 0 else None for d in arg.shape)
        names = tuple(d if isinstance(d, str) else None for d in arg.shape)
        specs.append(InputSpec(arg.name, np.dtype(_TYPES[arg.type]), dims, names))
    return specs


@dataclasses.dataclass
class _State:
    past: dict[str, np.ndarray] | None = None  # past_key_values.* of the next step
    length: int = 0  # positions seen (the past's length)
    ids: np.ndarray | None = None  # every token so far, for a decoder without past
    encoder: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class Generator:
    """Steps of greedy decoding over ``sessions`` (role -> onnxruntime session). ``record(role, feed)``,
    when given, sees every feed each model is run with (calibration data). ``cache_sizes``: sizes of
    the KV cache's named axes that the models leave open (``kv_heads``, ``head_size``; from the
    folder's config, see :func:`fp8onnx.data.kv_cache.cache_sizes`)."""

    def __init__(
        self,
        sessions: dict,
        *,
        start_token: int | None = None,
        cache_sizes: dict[str, int] | None = None,
        record: Callable[[str, dict], None] | None = None,
        where: str = "the export",
    ):
        unknown = set(sessions) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}")
        if not {"decoder", "decoder_merged"} & set(sessions):
            raise Fp8OnnxError(f"{where} has no decoder model to generate with.")
        self.sessions = sessions
        self.specs = {role: session_specs(s) for role, s in sessions.items()}
        self.outputs = {role: [o.name for o in s.get_outputs()] for role, s in sessions.items()}
        self.start_token = start_token
        self.sizes = cache_sizes or {}
        self.record = record
        self.where = where
        if "encoder" in sessions and start_token is None:
            raise Fp8OnnxError(f"{where}: an encoder-decoder needs decoder_start_token_id (config.json).")

    @property
    def encoder_decoder(self) -> bool:
        return "encoder" in self.sessions

    def _has_past(self, role: str) -> bool:
        return any(_PAST.match(s.name) for s in self.specs[role])

    def _run(self, role: str, feed: dict) -> dict[str, np.ndarray]:
        if self.record is not None:
            self.record(role, feed)
        try:
            values = self.sessions[role].run(None, feed)
        except Exception as exc:
            raise Fp8OnnxError(f"The {role} model of {self.where} failed to run: {str(exc).splitlines()[0]}") from exc
        return dict(zip(self.outputs[role], values))

    def _empty_past(self, spec: InputSpec, batch: int) -> np.ndarray:
        return np.zeros(past_shape(spec, batch, self.sizes), spec.dtype)

    def _feed(self, role: str, ids: np.ndarray, state: _State) -> dict[str, np.ndarray]:
        batch, new = ids.shape
        total = state.length + new
        feed = {}
        for spec in self.specs[role]:
            name = spec.name
            if name in ("input_ids", "decoder_input_ids"):
                feed[name] = ids.astype(spec.dtype)
            elif name in ("attention_mask", "decoder_attention_mask"):
                feed[name] = np.ones((batch, total), spec.dtype)
            elif name == "position_ids":
                feed[name] = np.broadcast_to(np.arange(state.length, total, dtype=spec.dtype), (batch, new)).copy()
            elif name == "use_cache_branch":
                dims = tuple(d for d in spec.shape if d is not None)
                feed[name] = np.full(
                    dims if spec.shape and len(dims) == len(spec.shape) else (1,), state.past is not None
                )
            elif name in state.encoder:
                feed[name] = state.encoder[name].astype(spec.dtype)
            elif _PAST.match(name):
                past = None if state.past is None else state.past.get(name)
                feed[name] = past if past is not None else self._empty_past(spec, batch)
            else:
                raise Fp8OnnxError(
                    f"Input {name!r} ({spec.describe()}) of the {role} model of {self.where} is not one that "
                    "generation knows how to fill (input ids, masks, position ids, KV caches, encoder outputs)."
                )
        return feed

    @property
    def decodes_apart(self) -> bool:
        """Whether decode steps run a model (or an If branch) of their own, not the prefill's nodes."""
        return bool({"decoder_with_past", "decoder_merged"} & set(self.sessions))

    @property
    def cached(self) -> bool:
        """Whether the decode steps run on a KV cache (else each step reruns the whole sequence)."""
        return any(self._has_past(role) for role in self.sessions if role != "encoder")

    def _step(self, ids: np.ndarray, state: _State) -> np.ndarray:
        """Run one step on the new tokens ``ids`` [batch, n]; logits of the last position [batch, vocab]."""
        if state.past is not None and "decoder_with_past" in self.sessions:
            role = "decoder_with_past"
        elif "decoder_merged" in self.sessions:
            role = "decoder_merged"
        else:
            role = "decoder"
        if not self.cached:  # no KV cache: the whole sequence every step
            state.ids = ids if state.ids is None else np.concatenate([state.ids, ids], axis=1)
            ids, state.length = state.ids, 0
        out = self._run(role, self._feed(role, ids, state))
        if "logits" not in out:
            raise Fp8OnnxError(f"The {role} model of {self.where} has no 'logits' output.")
        if self.cached:
            past = dict(state.past or {})
            for name, value in out.items():
                if not name.startswith("present."):
                    continue
                key = "past_key_values." + name[len("present.") :]
                # Cross-attention caches are the encoder's, fixed after the first step (a merged
                # decoder's cache branch returns placeholders for them; a with-past one, nothing).
                if ".encoder." not in key or key not in past:
                    past[key] = value
            state.past = past
        state.length += ids.shape[1]
        return out["logits"][:, -1, :]

    def _start(self, prompt: np.ndarray) -> tuple[_State, np.ndarray]:
        """The state after the prompt, and the decoder tokens to run first."""
        state = _State()
        if not self.encoder_decoder:
            return state, prompt
        feed = {}
        for spec in self.specs["encoder"]:
            if spec.name == "input_ids":
                feed[spec.name] = prompt.astype(spec.dtype)
            elif spec.name == "attention_mask":
                feed[spec.name] = np.ones(prompt.shape, spec.dtype)
            else:
                raise Fp8OnnxError(f"Input {spec.name!r} of the encoder of {self.where} cannot be made from token ids.")
        out = self._run("encoder", feed)
        hidden = out.get("last_hidden_state", next(iter(out.values())))
        state.encoder = {"encoder_hidden_states": hidden, "encoder_attention_mask": np.ones(prompt.shape, np.int64)}
        return state, np.full((prompt.shape[0], 1), self.start_token, np.int64)

    def greedy(self, prompt: np.ndarray, tokens: int, *, teacher: np.ndarray | None = None) -> np.ndarray:
        """``tokens`` greedy tokens [batch, tokens] after ``prompt`` [batch, n] (an encoder-decoder:
        the encoder's input; its decoder starts from ``start_token``). ``teacher``: decoder tokens of
        an encoder-decoder fed before generating (calibration: the decoder's prefill sees a sequence)."""
        state, first = self._start(np.asarray(prompt, np.int64))
        if teacher is not None and self.encoder_decoder:
            first = np.concatenate([first, np.asarray(teacher, np.int64)], axis=1)
        logits = self._step(first, state)
        out = []
        for i in range(tokens):
            out.append(np.argmax(logits, axis=-1).astype(np.int64))
            if i + 1 < tokens:
                logits = self._step(out[-1][:, None], state)
        return np.stack(out, axis=1) if out else np.zeros((prompt.shape[0], 0), np.int64)


def agreement(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """Generation fidelity of ``candidate`` [prompts, n] against ``reference``: mean tokens before
    the first divergence, the share of positions that agree, the share of prompts whose text is
    identical."""
    same = reference == candidate
    n = same.shape[1]
    first = np.where(same.all(axis=1), n, np.argmin(same, axis=1))
    return {
        "tokens_before_divergence": float(first.mean()) if len(first) else float("nan"),
        "token_agreement": float(same.mean()) if same.size else float("nan"),
        "identical": float(same.all(axis=1).mean()) if len(first) else float("nan"),
        "tokens": int(n),
        "prompts": int(same.shape[0]),
    }


def start_token(folder: pathlib.Path) -> int | None:
    """The decoder start token of an encoder-decoder export (config.json / generation_config.json)."""
    import json

    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            try:
                value = json.loads(path.read_text(encoding="utf-8")).get("decoder_start_token_id")
            except (OSError, ValueError):
                continue
            if isinstance(value, int):
                return value
    return None
