"""Graph preparation before any decision: load, upgrade the opset, lift constants, inline functions,
fold weight transforms, optional float16, unique names, and the types decisions need."""

from __future__ import annotations

import logging
import os

import onnx_ir as ir
import onnx_ir.passes.common

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph.cpu_ep import BFLOAT16_MARK
from fp8onnx.graph.model_io import EXTERNAL_META, load_model
from fp8onnx.graph.placement import no_cuda_kernel_in
from fp8onnx.passes import (
    ConvertFloat16Pass,
    Float16Error,
    FoldWeightTransformsPass,
    TieEmbeddingsPass,
    UpgradeError,
    UpgradeOpsetPass,
    default_opset,
)
from fp8onnx.passes.upgrade_opset import UpgradeResult
from fp8onnx.settings.choices import SUPPORTED_OP_TYPES, check_precision

__all__ = ["Float16Unsupported", "prepare_model"]


class Float16Unsupported(Fp8OnnxError):
    """--precision fp16 (or bf16) cannot convert this model."""


logger = logging.getLogger(__name__)


def prepare_model(path: str | os.PathLike, precision: str = "model") -> tuple[ir.Model, int | None, list[str]]:
    """Load the model and make its MatMul/Gemm weights visible; with ``precision="fp16"`` (``"bf16"``)
    convert the float32 graph to float16 (bfloat16, leaving in float32 what the CUDA EP has no bfloat16
    kernel for; inputs and outputs kept). Returns (model, original opset, what was
    done). Deterministic, so that `calibrate` and `quantize` agree on tensor names."""
    precision = check_precision(precision).value
    model = load_model(path)
    external = model.meta[EXTERNAL_META]
    upgrade = UpgradeOpsetPass()
    steps: list[tuple[ir.passes.PassBase, str | None]] = []  # (pass, what it did, when it did something)
    if model.ir_version is not None and model.ir_version < 4:
        # Before IR 4 every initializer had to be listed as a graph input too: they are weights.
        lifted = sum(1 for v in model.graph.inputs if v.is_initializer())
        steps.append(
            (
                ir.passes.common.RemoveInitializersFromInputsPass(),
                f"IR version {model.ir_version}: {lifted} initializers listed as graph inputs taken as weights",
            )
        )
    steps += [
        (upgrade, None),
        (ir.passes.common.LiftConstantsToInitializersPass(), "lifted Constant nodes to initializers"),
        (ir.passes.common.InlinePass(), "inlined model-local functions"),
        (FoldWeightTransformsPass(), "folded Identity/Cast/Transpose of weights into initializers"),
        (TieEmbeddingsPass(), "stored the tied input/output embedding table once"),
    ]
    if precision == "fp16":
        steps.append((ConvertFloat16Pass(), "converted the unquantized graph to float16 (inputs and outputs kept)"))
    elif precision == "bf16":
        steps.append((ir.passes.common.NameFixPass(), None))  # the nodes kept in float32 are named
        steps.append((_Bfloat16ForCuda(), "converted the unquantized graph to bfloat16 (inputs and outputs kept)"))
    # Decisions, statistics and reports refer to nodes and tensors by name: unnamed or duplicate names
    # get unique ones (NameFixPass: within a graph and its parents; then across sibling subgraphs).
    steps.append((ir.passes.common.NameFixPass(), None))
    done = []
    from_version = default_opset(model)
    for step, label in steps:
        try:
            result = step(model)
        except Float16Error as exc:
            raise Float16Unsupported(
                f"--precision {precision} cannot convert {str(path)!r}: {exc}. Use --precision model."
            ) from exc
        except (UpgradeError, ir.passes.PostconditionError) as exc:
            raise Fp8OnnxError(
                f"Model file {str(path)!r} cannot be upgraded from opset {from_version} to {upgrade.target}: {exc}"
            ) from exc
        model = result.model  # ConvertFloat16Pass returns a new model
        if isinstance(result, UpgradeResult) and result.modified and from_version is not None:  # upgrade's
            rewritten = f" ({result.rewritten} nodes rewritten)" if result.rewritten else ""
            done.append(f"upgraded opset {from_version} -> {upgrade.target}{rewritten}")
        elif result.modified and label:
            done.append(label)
    _unique_across_subgraphs(model)
    # Types of intermediate tensors decide what can be quantized and the scales' dtype. Not strict:
    # onnxruntime's own ops (contrib, or in the default domain) are unknown to ONNX's inference.
    ir.passes.common.ShapeInferencePass(strict_mode=False)(model)
    _types_from_partners(model)
    model.meta[EXTERNAL_META] = external  # ConvertFloat16Pass returns a new model
    return model, from_version, done


class _Bfloat16ForCuda(ir.passes.FunctionalPass):
    """ConvertFloat16Pass to bfloat16, leaving in float32 the nodes the CUDA EP has no bfloat16 kernel for
    (its kernel table, :mod:`fp8onnx.graph.placement`); those are logged."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ir.passes.common.ShapeInferencePass(strict_mode=False)(model)  # the types each node computes in
        keep = no_cuda_kernel_in(model, ir.DataType.BFLOAT16)
        if keep:
            ops = sorted({n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name in set(keep)})
            logger.info("bfloat16: %d nodes stay float32 (no bfloat16 CUDA kernel): %s", len(keep), ", ".join(ops))
        result = ConvertFloat16Pass(ir.DataType.BFLOAT16, keep=tuple(keep))(model)
        # fp8onnx's CPU sessions emulate bfloat16 in graphs that say they were written for the CUDA EP
        result.model.metadata_props[BFLOAT16_MARK] = "bfloat16 compute for onnxruntime's CUDA EP (--precision bf16)"
        return result


def _unique_across_subgraphs(model: ir.Model) -> None:
    """Sibling subgraphs (the two branches of an If, as in Optimum's merged decoders) may reuse tensor
    names; fp8onnx keys tensors by name, so a reused one is renamed (``<name>__<n>``). Main-graph names
    come first and never change."""
    graphs = [model.graph, *model.graph.subgraphs()]
    owner: dict[str, ir.Value] = {}
    for graph in graphs:
        values = [*graph.inputs, *graph.initializers.values(), *(v for n in graph for v in n.outputs)]
        for value in values:
            if value.name is None:
                continue
            if owner.setdefault(value.name, value) is not value:
                base, k = value.name, 1
                while f"{base}__{k}" in owner:
                    k += 1
                value.name = f"{base}__{k}"
                owner[value.name] = value


def _types_from_partners(model: ir.Model) -> None:
    """MatMul, Gemm, Conv and ConvTranspose take data and weight of one type T: where inference left
    one side untyped (downstream of an op ONNX does not know), it has the other side's type."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in SUPPORTED_OP_TYPES or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        a, b = node.inputs[0], node.inputs[1]
        if a is not None and b is not None and a.dtype is None and b.dtype is not None:
            a.dtype = b.dtype
        elif a is not None and b is not None and b.dtype is None and a.dtype is not None:
            b.dtype = a.dtype
