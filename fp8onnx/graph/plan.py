"""The per-node decision: which inputs of each MatMul/Gemm/Conv/ConvTranspose to quantize, or the
reason it is left alone. Decisions only; the graph is changed by the passes."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
from collections.abc import Iterable

import onnx_ir as ir
import onnx_ir.passes.common

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph import known
from fp8onnx.passes import (
    is_quantized,
)
from fp8onnx.settings.choices import SUPPORTED_OP_TYPES
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.report import NodeReport

__all__ = [
    "INTEGER_OPS",
    "VOCAB_SIZE",
    "Decision",
    "activation_tensors",
    "candidate_activations",
    "in_main_graph",
    "integer_quantized",
    "plan",
    "vocabulary_projections",
]

logger = logging.getLogger(__name__)


_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_QUANTIZED_INPUTS = (0, 1)  # data and weight; the bias of Gemm/Conv stays in float


@dataclasses.dataclass
class Decision:
    node: ir.Node
    inputs: list[tuple[int, str]]  # (input index, "weight" | "activation")
    reason: str | None = None


def _is_weight(value: ir.Value) -> bool:
    return value.const_value is not None and value.is_initializer() and not value.is_graph_input()


def _outer_product(node: ir.Node) -> bool:
    """A MatMul of a constant left operand over a reduction axis of length 1 (``C[.., M, 1] @ x[.., 1, N]``):
    a dynamo export's rotary angles (``inv_freq @ positions``, the constant ``inv_freq`` looking like a
    weight), which FP8 would round for nothing: no sum to speed up. Exporters put a layer's weight on the
    right, so a dense layer with one input feature (``x[.., 1] @ W[1, N]``) is not one."""
    if node.op_type != "MatMul":
        return False
    a = node.inputs[0]
    if a is None or a.const_value is None or a.shape is None or len(a.shape) < 2:
        return False
    return a.shape[-1] == 1


def _decide(node: ir.Node, config: QuantizeConfig, late: frozenset[str] = frozenset()) -> Decision:
    kept = node.name in config.keep_float
    if kept and config.fallback == "nodes":
        return Decision(node, [], "kept in float for --accuracy-target (among the most sensitive nodes)")
    for pattern in config.exclude:
        if fnmatch.fnmatchcase(node.name or "", pattern):
            return Decision(node, [], f"excluded by --exclude {pattern!r}")
    inputs = []
    for index in _QUANTIZED_INPUTS:
        value = node.inputs[index] if index < len(node.inputs) else None
        if value is None:
            return Decision(node, [], f"input {index} is missing")
        if value.dtype not in _FLOAT_TYPES:
            return Decision(node, [], f"input {value.name!r} is {value.dtype}, not float32/float16/bfloat16")
        if is_quantized(value):
            return Decision(node, [], f"already quantized: input {value.name!r} comes from DequantizeLinear or fp8onnx")
        if value.is_initializer() and value.is_graph_input():
            return Decision(node, [], f"weight {value.name!r} is also a graph input and can be overridden at run time")
        inputs.append((index, "weight" if _is_weight(value) else "activation"))
    if _outer_product(node):
        return Decision(node, [], "an outer product (K = 1, e.g. rotary position angles): FP8 would only round it")
    if config.activations == "none":  # weight-only FP8
        inputs = [(i, kind) for i, kind in inputs if kind == "weight"]
        if not inputs:
            return Decision(node, [], "no constant weight (--activations none quantizes weights only)")
        return Decision(node, inputs)
    if kept or node.name in late or any(fnmatch.fnmatchcase(node.name or "", p) for p in config.float_activations):
        inputs = [(i, kind) for i, kind in inputs if kind == "weight"]  # W8A16: FP8 weights, float activations
        if not inputs:
            return Decision(node, [], "its activations stay in float (W8A16) and it has no weight")
        return Decision(node, inputs)
    if all(kind == "activation" for _, kind in inputs) and not config.activation_matmuls:
        return Decision(
            node, [], "both inputs are activations (e.g. attention scores); opt in with --activation-matmuls"
        )
    return Decision(node, inputs)


def plan(model: ir.Model, config: QuantizeConfig) -> tuple[list[Decision], list[NodeReport]]:
    """Per MatMul/Gemm of the model: the inputs to quantize, or why it is left alone."""
    decisions, skipped = [], []
    vocab_nodes = {}
    if config.float_vocab:
        candidates = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type in ("MatMul", "Gemm")]
        by_name = {n.name: n for n in candidates}
        vocab_nodes = {by_name[name]: why for name, why in vocabulary_projections(model, candidates).items()}
    stem = stem_convolutions(model) if config.float_stem else set()
    late = last_layers(model, config.float_last_layers)
    # If/Loop/Scan bodies included: their activations get dynamic scales (see in_main_graph).
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in SUPPORTED_OP_TYPES or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type not in config.op_types:
            reason = f"{node.op_type} is not in --op-types"
            if node.op_type in ("Conv", "ConvTranspose"):
                reason += f" (opt in with --op-types MatMul,Gemm,{node.op_type})"
            skipped.append(NodeReport(known.name(node), node.op_type, False, reason))
            continue
        decision = _decide(node, config, late)
        if not decision.reason and config.float_vocab and node in vocab_nodes:
            decision = Decision(node, [], f"kept in float: {vocab_nodes[node]} (--float-vocab)")
        if not decision.reason and node in stem:
            decision = Decision(node, [], "kept in float: a stem convolution, it reads the input (--float-stem)")
        if decision.reason:
            skipped.append(NodeReport(known.name(node), node.op_type, False, decision.reason))
        else:
            decisions.append(decision)
    for function in model.functions.values():  # left after inlining: none unless inlining was impossible
        for node in function:
            if node.op_type in SUPPORTED_OP_TYPES:
                skipped.append(
                    NodeReport(
                        known.name(node), node.op_type, False, f"inside function {function.name!r}: not quantized yet"
                    )
                )
    return decisions, skipped


_LINEAR = ("MatMul", "Gemm", "Conv", "ConvTranspose")
# A decoder layer's index in a node name, as torch, Optimum and onnxruntime-genai's builder write it
# ("/model/layers.29/mlp/up_proj/MatMul", "/layers.1/q"; BERT's "layer.N", GPT-2's "h.N", "blocks.N")
_LAYER = re.compile(r"(?:^|[/.])(?:layers|layer|h|blocks)\.(\d+)(?=[/.])")


def last_layers(model: ir.Model, count: int) -> frozenset[str]:
    """The names of the MatMul/Gemm nodes in the model's last ``count`` layers, told by the layer index in
    their names (none when no name has one: a warning says so)."""
    if count <= 0:
        return frozenset()
    index = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node_name = node.name or ""
        found = _LAYER.search(node_name) if node.op_type in ("MatMul", "Gemm") else None
        if found:
            index[node_name] = int(found.group(1))
    if not index:
        logger.warning("--float-last-layers %d: no MatMul/Gemm is named like 'layers.N/'; none kept in float", count)
        return frozenset()
    top = sorted(set(index.values()))[-count:]
    return frozenset(name for name, i in index.items() if i in top)


def stem_convolutions(model: ir.Model) -> set[ir.Node]:
    """The Conv/ConvTranspose nodes of the main graph with no MatMul/Gemm/Conv/ConvTranspose before
    them: those that see the model's input (pixels, features) through elementwise steps at most. Their
    few input channels carry the whole signal and their weights are tiny: keeping them in float costs
    almost no size (the usual practice for a CNN's first layer)."""
    behind_linear: set[ir.Value] = set()  # values computed from some linear layer's output
    stem = set()
    for node in model.graph:  # topological order
        after = any(v in behind_linear for v in node.inputs if v is not None)
        if node.op_type in ("Conv", "ConvTranspose") and not after:
            stem.add(node)
        if after or node.op_type in _LINEAR:
            behind_linear.update(node.outputs)
    return stem


def in_main_graph(value: ir.Value, model: ir.Model) -> bool:
    """Whether calibration can see ``value``: onnxruntime can return main-graph tensors only, not
    tensors computed inside If/Loop/Scan bodies (those get a dynamic scale)."""
    producer = value.producer()
    return (producer.graph if producer is not None else value.graph) is model.graph


def activation_tensors(decisions: Iterable[Decision], model: ir.Model) -> list[str]:
    """The activation tensors static calibration measures (those of the main graph)."""
    names = []
    for d in decisions:
        for i, kind in d.inputs:
            value = known.required_input(d.node, i)
            if kind == "activation" and in_main_graph(value, model):
                names.append(known.name(value))
    return list(dict.fromkeys(names))


def candidate_activations(model: ir.Model) -> list[str]:
    """Every float activation input of every MatMul/Gemm/Conv: what ``fp8onnx calibrate`` records, so
    that one statistics file serves any later choice of --op-types, --exclude or --activation-matmuls."""
    config = QuantizeConfig(activation_matmuls=True, op_types=SUPPORTED_OP_TYPES)
    return activation_tensors(plan(model, config)[0], model)


# Ops of a model quantized to integers already (onnxruntime.quantization's dynamic and static INT8,
# its 4-bit MatMulNBits): fp8onnx takes float models.
INTEGER_OPS = (
    "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", "DynamicQuantizeLSTM", "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat", "QLinearMatMul", "QLinearConv", "QGemm", "QAttention", "MatMulNBits",
    "GatherBlockQuantized", "QLinearAdd", "QLinearMul",
)  # fmt: skip


def integer_quantized(model: ir.Model) -> dict[str, int]:
    """op type -> count of the integer-quantization ops the model has (every graph)."""
    found: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type in INTEGER_OPS:
            found[node.op_type] = found.get(node.op_type, 0) + 1
    return found


VOCAB_SIZE = 16384  # output channels from which a projection counts as vocabulary-sized


def vocabulary_projections(model: ir.Model, nodes: list[ir.Node]) -> dict[str | None, str]:
    """Node name (None: an unnamed node of a model inspected as it is) -> why it is a vocabulary-sized
    projection, for MatMul/Gemm nodes with a constant
    weight whose output channels match the rows of an embedding table (a Gather over a constant
    2-D tensor) or number at least ``VOCAB_SIZE``. Weights behind a DequantizeLinear count."""
    tables = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        table = _constant_2d(node.inputs[0]) if node.op_type == "Gather" and node.inputs else None
        if table is not None:  # a tied table is gathered along axis 1 of the projection's weight
            rows = table[node.attributes.get_int("axis", 0)]
            if isinstance(rows, int):
                tables.add(int(rows))
    risks = {}
    for node in nodes:
        weight = _constant_2d(node.inputs[1]) if node.op_type in ("MatMul", "Gemm") and len(node.inputs) > 1 else None
        if weight is None:
            continue
        transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0
        channels = weight[0 if transposed else 1]
        if not isinstance(channels, int):  # a constant's shape is static
            raise Fp8OnnxError(f"The weight of {node.op_type} node {node.name!r} has a symbolic shape {weight}.")
        if channels in tables and channels >= 1000:
            risks[node.name] = f"vocabulary projection ({channels} outputs, the rows of an embedding table)"
        elif channels >= VOCAB_SIZE:
            risks[node.name] = f"vocabulary-sized projection ({channels} outputs)"
    return risks


def _constant_2d(value: ir.Value | None) -> ir.Shape | None:
    """The shape of ``value`` (or of the float8 constant its DequantizeLinear reads) when it is a constant
    2-D tensor."""
    producer = value.producer() if value is not None else None
    if producer is not None and producer.op_type == "DequantizeLinear":
        value = producer.inputs[0]
    if value is None or value.const_value is None or value.shape is None or len(value.shape) != 2:
        return None
    return value.shape
