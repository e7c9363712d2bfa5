"""The KV cache of a decoder's export, from its folder: the sizes its config states and the shape of an
empty (prefill) cache input, past length 0."""

from __future__ import annotations

import json
import pathlib
import re

import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.feeds import InputSpec
from fp8onnx.graph.model_io import SOURCE_META

__all__ = ["cache_sizes", "model_folder", "past_shape"]


def model_folder(model: ir.Model | None) -> pathlib.Path | None:
    source = model.meta.get(SOURCE_META) if model is not None else None
    return pathlib.Path(source).parent if source else None


def cache_sizes(folder: pathlib.Path | None) -> dict[str, int]:
    """KV-cache sizes an export folder's config states (``kv_heads``, ``head_size``), for cache inputs
    that declare them as named dimensions: onnxruntime-genai's ``genai_config.json`` or a Hugging Face
    ``config.json``."""
    out: dict[str, int] = {}
    if folder is None:
        return out
    for name in ("config.json", "genai_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        cfg = cfg.get("model", {}).get("decoder", cfg) if name == "genai_config.json" else cfg
        heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or cfg.get("n_head")
        hidden = cfg.get("hidden_size") or cfg.get("n_embd")
        size = cfg.get("head_size") or cfg.get("head_dim")
        if size is None and hidden and (cfg.get("num_attention_heads") or cfg.get("n_head")):
            size = hidden // (cfg.get("num_attention_heads") or cfg.get("n_head"))
        if heads:
            out["kv_heads"] = int(heads)
        if size:
            out["head_size"] = int(size)
    return out


def past_shape(spec: InputSpec, batch: int, sizes: dict[str, int] | None = None) -> tuple[int, ...]:
    """[batch, ..., 0 past positions, ...]: the first axis is the batch; fixed axes keep their size.
    The past-length axis is the one other dynamic axis, or the one whose name says past/sequence;
    a further dynamic axis of a rank-4 cache [batch, kv_heads, past, head_size] takes its size from
    the export folder's config (``cache_sizes``)."""
    if spec.rank < 2:
        raise Fp8OnnxError(f"Cache input {spec.name!r} is {spec.describe()}; expected [batch, ..., past, ...].")
    dynamic = [i for i, d in enumerate(spec.shape[1:], 1) if d is None]
    names = spec.dim_names or (None,) * spec.rank
    if len(dynamic) > 1:
        named = [i for i in dynamic if (name := names[i]) and re.search("past|seq|len", name, re.IGNORECASE)]
        past = named[0] if len(named) == 1 else None
    else:
        past = dynamic[0] if dynamic else None
    # every dynamic axis is set below (or refused): 0 holds its place
    shape = [batch if spec.shape[0] is None else spec.shape[0], *(0 if d is None else d for d in spec.shape[1:])]
    sizes = sizes or {}
    by_axis = {1: sizes.get("kv_heads"), 3: sizes.get("head_size")} if spec.rank == 4 else {}
    for axis in dynamic:
        if axis == past:
            shape[axis] = 0
        elif size := by_axis.get(axis):
            shape[axis] = size
        else:
            raise Fp8OnnxError(
                f"Cache input {spec.name!r} is {spec.describe()}: cannot tell the size of axis {axis}"
                + (f" ({names[axis]})" if names[axis] else "")
                + " (no config.json or genai_config.json beside the model says it); give it in an .npz."
            )
    return tuple(shape)
