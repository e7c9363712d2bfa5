"""The graph's rewrite once every scale is known: biases shielded from onnxruntime's int32 clipping,
float8 Q/DQ inserted, embedding tables stored in float8, and the fast form (GemmFloat8 or
MatMulBlockQuantizedFp8Weight) written; the model's metadata says how it was made. Every change is a
pass of :mod:`fp8onnx.passes`; this module only chooses them and their order."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TypeVar

import onnx_ir as ir

from fp8onnx.base.version import __version__
from fp8onnx.graph.plan import vocabulary_projections
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.formats import EMULATED_NOTE
from fp8onnx.passes import (
    BlockFp8MatMulPass,
    BlockFp8Result,
    EmbeddingsResult,
    HalfTablesPass,
    HalfTablesResult,
    InsertQDQPass,
    LowerGemmFloat8Pass,
    LoweringResult,
    QuantizeEmbeddingsPass,
    ShieldBiasPass,
    TensorQuant,
    block_fp8_reason,
)
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.techniques.scales import bias_overflows

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Rewritten:
    """What the rewrite did: ``modified`` (anything quantized), the GemmFloat8 lowering's and the
    block-fp8 fast form's results (None where not asked)."""

    modified: bool
    lowering: LoweringResult | None = None
    written: BlockFp8Result | None = None

    @property
    def lowered(self) -> bool:
        return bool(self.lowering and self.lowering.lowered)

    def report_fields(self) -> dict:
        """The QuantizeReport fields this step fills."""
        return {
            "modified": self.modified,
            "lowered": list(self.lowering.lowered) if self.lowering else [],
            "not_lowered": dict(self.lowering.skipped) if self.lowering else {},
            "fast_form": None if self.written is None else self.written.summary(),
        }


def rewrite(
    model: ir.Model, decisions, quant: dict[str, TensorQuant], config: QuantizeConfig, run: RunOptions, prepared: list
) -> Rewritten:
    """Rewrite ``model`` in place for ``decisions`` with the scales ``quant``; ``prepared`` gets a line
    for each change beyond the Q/DQ pairs.

    requires: every quantized input of ``decisions`` has its TensorQuant in ``quant``.
    ensures: the model carries fp8onnx's metadata when anything was quantized (``modified``)."""
    shielded = bias_overflows(decisions, quant)
    if shielded:
        ShieldBiasPass(shielded)(model)
        prepared.append(f"reshaped {len(shielded)} biases to [1, N] (onnxruntime would clip them as int32)")
    node_inputs = [(d.node, index) for d in decisions for index, _ in d.inputs]
    fast = _fast_form_weights(decisions, config)
    inserted = InsertQDQPass(node_inputs, quant, per_axis_blocks=_per_axis_blocks(config, run), blocked=fast)(model)
    modified = inserted.modified
    left_float: list[str] = []  # embedding tables that stay in float
    if config.embeddings == "fp8":
        embedded = _quantize_embeddings(model, config, inserted.dequantized, prepared)
        modified |= embedded.modified
        left_float = [name for name, why in embedded.skipped.items() if "fewer than" not in why]
    if not modified:
        return Rewritten(False)
    if not config.wide_tables:
        _half_tables(model, left_float, prepared)
    lowering = _run(LowerGemmFloat8Pass(), model, LoweringResult) if config.gemm_op == "gemm-float8" else None
    written = _run(BlockFp8MatMulPass(), model, BlockFp8Result) if config.gemm_op == "block-fp8" else None
    model.metadata_props["fp8onnx"] = json.dumps({"version": __version__, **config.to_json()}, sort_keys=True)
    if config.emulated:
        model.metadata_props["fp8onnx_emulated"] = EMULATED_NOTE
        logger.warning("%s", EMULATED_NOTE)
    return Rewritten(True, lowering, written)


def _quantize_embeddings(model: ir.Model, config: QuantizeConfig, dequantized, prepared: list) -> EmbeddingsResult:
    """Embedding tables in float8 with per-row scales (a tied table gathered from its projection's
    weight); ``prepared`` says which, and which stayed float and why."""
    embedded = _run(QuantizeEmbeddingsPass(config.weight_format, dequantized=dequantized), model, EmbeddingsResult)
    fmt = config.weight_format.value
    if embedded.quantized:
        prepared.append(
            f"stored {len(embedded.quantized)} embedding tables as {fmt} codes with "
            f"per-row scales ({', '.join(embedded.quantized[:3])})"
        )
    prepared += [
        f"tied embedding table {name!r} gathered from its projection's {fmt} weight" for name in embedded.shared
    ]
    prepared += [f"embedding table {name!r} left in float: {why}" for name, why in embedded.skipped.items()]
    return embedded


def _half_tables(model: ir.Model, tables: list[str], prepared: list) -> None:
    """The float32 weights of vocabulary projections left in float (an lm_head under --float-vocab,
    with its tied table) and the large embedding ``tables`` left in float, stored in 16 bits;
    ``prepared`` says which (--wide-tables keeps them in 32)."""
    graph = model.graph
    gemms = [n for n in graph if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx")]
    by_name = {n.name: n for n in gemms}
    weights = [by_name[name].inputs[1] for name in vocabulary_projections(model, gemms)]
    names = [w.name for w in weights if w is not None and w.name is not None and w.name in graph.initializers] + tables
    names = [n for n in dict.fromkeys(names) if graph.initializers[n].dtype == ir.DataType.FLOAT]
    if not names:
        return
    stored = _run(HalfTablesPass(names), model, HalfTablesResult).stored
    for name, dtype in stored.items():
        prepared.append(
            f"float table {name!r} stored as {dtype} (read through a Cast to float32; --wide-tables: 32 bits)"
        )


R = TypeVar("R", bound=ir.passes.PassResult)


def _run(pass_: ir.passes.PassBase, model: ir.Model, kind: type[R]) -> R:
    """``pass_`` called as a whole on ``model`` (requires, call, ensures): onnx_ir types the result as a
    PassResult; each of these passes returns its own subclass, checked here."""
    result = pass_(model)
    if not isinstance(result, kind):
        raise TypeError(f"{type(pass_).__name__} returned {type(result).__name__}, not {kind.__name__}")
    return result


def _fast_form_weights(decisions, config: QuantizeConfig) -> set[str]:
    """The weights that --gemm-op block-fp8 will read from a blocked DequantizeLinear (the rest of a
    CUDA model keeps the per-axis form)."""
    if config.gemm_op != "block-fp8":
        return set()
    return {d.node.inputs[1].name for d in decisions if block_fp8_reason(d.node, config.weight_format) is None}


def _per_axis_blocks(config: QuantizeConfig, run: RunOptions) -> bool:
    """Block-scaled weights in the per-axis form: for onnxruntime's CUDA EP, which has no blocked float8
    DequantizeLinear (--target onnxruntime-cuda, or a run on it)."""
    if not config.weight_block_size:
        return False
    cuda = config.target == "onnxruntime-cuda" or run.provider == "cuda"
    if cuda and config.gemm_op != "block-fp8":  # there the fast form's weights stay blocked (its summary says)
        logger.info("block scales in the per-axis form (the CUDA EP has no blocked float8 DequantizeLinear)")
    return cuda
