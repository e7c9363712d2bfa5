"""The main job: choose what to quantize, calibrate, insert float8 Q/DQ, check and write the model.

``quantize()`` is what ``fp8onnx quantize`` calls. The decisions are kept apart from the rewrite:
:func:`plan` looks at each MatMul/Gemm and returns, per node, either the inputs to quantize or the
reason it is left alone; scales come from :mod:`fp8onnx.scaling`; the graph is changed only by the
passes in :mod:`fp8onnx.passes`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import pathlib
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from . import __version__
from .calibration import WEIGHT_MEMORY, Stats, collect_amax, weight_amax
from .errors import Fp8OnnxError
from .formats import EMULATED_NOTE, Fp8Format, parse_format
from .guard import as_path, check_paths, model_reads, model_writes, side_file
from .model_io import EXTERNAL_META, load_model, save_model, write_text_atomic
from .passes import (
    ConvertFloat16Pass,
    FoldWeightTransformsPass,
    InsertQDQPass,
    LowerGemmFloat8Pass,
    ShieldBiasPass,
    TensorQuant,
    UpgradeError,
    UpgradeOpsetPass,
    bias_of,
    default_opset,
    is_quantized,
    output_channel_axis,
)
from .report import NodeReport, QuantizeReport, TensorReport
from .runtime import resolve_provider
from .scaling import DEFAULT_PERCENTILE, Scaling, amax_to_scale, clipping_amax, parse_scaling
from .targets import TARGETS, check_tensorrt

__all__ = ["QuantizeConfig", "plan", "quantize", "SUPPORTED_OP_TYPES"]

logger = logging.getLogger(__name__)
SUPPORTED_OP_TYPES = ("MatMul", "Gemm", "Conv", "ConvTranspose")
DEFAULT_OP_TYPES = ("MatMul", "Gemm")  # Conv is opt-in (SPEC §2)
_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_QUANTIZED_INPUTS = (0, 1)  # data and weight; the bias of Gemm/Conv stays in float


ACTIVATION_MODES = ("static", "dynamic")
PRECISIONS = ("model", "fp16")  # model: keep the model's own float types


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; validated on creation.

    ``format`` sets both ``weight_format`` and ``activation_format`` unless they are given.
    """

    format: Fp8Format | str = Fp8Format.E4M3FN
    weight_format: Fp8Format | str | None = None
    activation_format: Fp8Format | str | None = None
    scaling: Scaling | str = Scaling.AMAX
    margin: int = 0
    scale: float | None = None
    percentile: float | None = None
    activations: str = "static"
    per_channel: bool = False
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    exclude: tuple[str, ...] = ()
    activation_matmuls: bool = False
    precision: str = "model"
    native_gemm: bool = False
    target: str = "onnxruntime"

    def __post_init__(self):
        fmt = parse_format(self.format)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "weight_format", parse_format(self.weight_format or fmt))
        object.__setattr__(self, "activation_format", parse_format(self.activation_format or fmt))
        object.__setattr__(self, "scaling", parse_scaling(self.scaling))
        object.__setattr__(self, "op_types", tuple(self.op_types))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        unknown = [t for t in self.op_types if t not in SUPPORTED_OP_TYPES]
        if unknown or not self.op_types:
            raise Fp8OnnxError(
                f"Unsupported op type {unknown[0] if unknown else ''!r} in --op-types; supported: "
                f"{', '.join(SUPPORTED_OP_TYPES)}."
            )
        if self.precision not in PRECISIONS:
            raise Fp8OnnxError(f"Unknown --precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}.")
        if self.target not in TARGETS:
            raise Fp8OnnxError(f"Unknown --target {self.target!r}; choose one of {', '.join(TARGETS)}.")
        if self.target == "tensorrt":
            if Fp8Format.E4M3FN not in (self.weight_format, self.activation_format) or (
                self.weight_format != self.activation_format
            ):
                raise Fp8OnnxError("--target tensorrt takes e4m3fn only (TensorRT's FP8 format).")
            if self.activations == "dynamic" or self.native_gemm:
                raise Fp8OnnxError(
                    "--target tensorrt needs constant scales and standard Q/DQ: drop --activations dynamic and "
                    "--native-gemm."
                )
        if self.activations not in ACTIVATION_MODES:
            raise Fp8OnnxError(f"Unknown --activations {self.activations!r}; choose static or dynamic.")
        if self.scaling is Scaling.CONSTANT:
            amax_to_scale(1.0, self.weight_format, self.scaling, constant=self.scale)  # validates --scale
            if self.activations == "dynamic":
                raise Fp8OnnxError(
                    "--scaling constant contradicts --activations dynamic (one fixed scale vs one per batch)."
                )
            if self.per_channel:
                raise Fp8OnnxError("--scaling constant contradicts --per-channel (one scale for every tensor).")
        elif self.scale is not None:
            raise Fp8OnnxError("--scale only applies to --scaling constant.")
        if self.margin != int(self.margin):
            raise Fp8OnnxError(f"--margin must be an integer, got {self.margin!r}.")
        if self.margin and self.scaling is not Scaling.POW2:
            raise Fp8OnnxError("--margin only applies to --scaling pow2.")
        if self.percentile is not None:
            if self.scaling is not Scaling.PERCENTILE:
                raise Fp8OnnxError("--percentile only applies to --scaling percentile.")
            if not 0 < self.percentile <= 100:
                raise Fp8OnnxError(f"--percentile must be in (0, 100], got {self.percentile!r}.")
        if self.activations == "dynamic" and self.scaling not in (Scaling.AMAX,):
            raise Fp8OnnxError(
                f"--activations dynamic computes each batch's amax in the graph; --scaling {self.scaling.value} "
                "needs calibration (use --scaling amax or --activations static)."
            )

    @property
    def emulated(self) -> bool:
        return not (self.weight_format.deployable and self.activation_format.deployable)

    def to_json(self) -> dict:
        return {
            "weight_format": self.weight_format.value,
            "activation_format": self.activation_format.value,
            "scaling": self.scaling.value,
            "margin": self.margin,
            "scale": self.scale,
            "percentile": self.percentile
            if self.percentile is not None
            else (DEFAULT_PERCENTILE if self.scaling is Scaling.PERCENTILE else None),
            "activations": self.activations,
            "per_channel": self.per_channel,
            "op_types": list(self.op_types),
            "exclude": list(self.exclude),
            "activation_matmuls": self.activation_matmuls,
            "precision": self.precision,
            "native_gemm": self.native_gemm,
            "target": self.target,
            "emulated": self.emulated,
        }


@dataclasses.dataclass
class _Decision:
    node: ir.Node
    inputs: list[tuple[int, str]]  # (input index, "weight" | "activation")
    reason: str | None = None


def _is_weight(value: ir.Value) -> bool:
    return value.const_value is not None and value.is_initializer() and not value.is_graph_input()


def _decide(node: ir.Node, config: QuantizeConfig) -> _Decision:
    for pattern in config.exclude:
        if fnmatch.fnmatchcase(node.name or "", pattern):
            return _Decision(node, [], f"excluded by --exclude {pattern!r}")
    inputs = []
    for index in _QUANTIZED_INPUTS:
        value = node.inputs[index] if index < len(node.inputs) else None
        if value is None:
            return _Decision(node, [], f"input {index} is missing")
        if value.dtype not in _FLOAT_TYPES:
            return _Decision(node, [], f"input {value.name!r} is {value.dtype}, not float32/float16/bfloat16")
        if is_quantized(value):
            return _Decision(
                node, [], f"already quantized: input {value.name!r} comes from DequantizeLinear or fp8onnx"
            )
        if value.is_initializer() and value.is_graph_input():
            return _Decision(node, [], f"weight {value.name!r} is also a graph input and can be overridden at run time")
        inputs.append((index, "weight" if _is_weight(value) else "activation"))
    if all(kind == "activation" for _, kind in inputs) and not config.activation_matmuls:
        return _Decision(
            node, [], "both inputs are activations (e.g. attention scores); opt in with --activation-matmuls"
        )
    return _Decision(node, inputs)


def plan(model: ir.Model, config: QuantizeConfig) -> tuple[list[_Decision], list[NodeReport]]:
    """Per MatMul/Gemm of the model: the inputs to quantize, or why it is left alone."""
    decisions, skipped = [], []
    # If/Loop/Scan bodies included: their activations get dynamic scales (see in_main_graph).
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in SUPPORTED_OP_TYPES or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type not in config.op_types:
            reason = f"{node.op_type} is not in --op-types"
            if node.op_type in ("Conv", "ConvTranspose"):
                reason += f" (opt in with --op-types MatMul,Gemm,{node.op_type})"
            skipped.append(NodeReport(node.name, node.op_type, False, reason))
            continue
        decision = _decide(node, config)
        if decision.reason:
            skipped.append(NodeReport(node.name, node.op_type, False, decision.reason))
        else:
            decisions.append(decision)
    for function in model.functions.values():  # left after inlining: none unless inlining was impossible
        for node in function:
            if node.op_type in SUPPORTED_OP_TYPES:
                skipped.append(
                    NodeReport(node.name, node.op_type, False, f"inside function {function.name!r}: not quantized yet")
                )
    return decisions, skipped


def in_main_graph(value: ir.Value, model: ir.Model) -> bool:
    """Whether calibration can see ``value``: onnxruntime can return main-graph tensors only, not
    tensors computed inside If/Loop/Scan bodies (those get a dynamic scale)."""
    producer = value.producer()
    return (producer.graph if producer is not None else value.graph) is model.graph


def activation_tensors(decisions: Iterable[_Decision], model: ir.Model) -> list[str]:
    """The activation tensors static calibration measures (those of the main graph)."""
    names = []
    for d in decisions:
        for i, kind in d.inputs:
            value = d.node.inputs[i]
            if kind == "activation" and in_main_graph(value, model):
                names.append(value.name)
    return list(dict.fromkeys(names))


def candidate_activations(model: ir.Model) -> list[str]:
    """Every float activation input of every MatMul/Gemm/Conv: what ``fp8onnx calibrate`` records, so
    that one statistics file serves any later choice of --op-types, --exclude or --activation-matmuls."""
    config = QuantizeConfig(activation_matmuls=True, op_types=SUPPORTED_OP_TYPES)
    return activation_tensors(plan(model, config)[0], model)


def prepare_model(path: str | os.PathLike, precision: str = "model") -> tuple[ir.Model, int | None, list[str]]:
    """Load the model and make its MatMul/Gemm weights visible; with ``precision="fp16"`` convert the
    float32 graph to float16 (inputs and outputs kept). Returns (model, original opset, what was
    done). Deterministic, so that `calibrate` and `quantize` agree on tensor names."""
    if precision not in PRECISIONS:
        raise Fp8OnnxError(f"Unknown --precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    model = load_model(path)
    external = model.meta[EXTERNAL_META]
    upgrade = UpgradeOpsetPass()
    steps = []
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
    ]
    if precision == "fp16":
        steps.append((ConvertFloat16Pass(), "converted the unquantized graph to float16 (inputs and outputs kept)"))
    # Decisions, statistics and reports refer to nodes and tensors by name: unnamed or duplicate names
    # get unique ones (NameFixPass: within a graph and its parents; then across sibling subgraphs).
    steps.append((ir.passes.common.NameFixPass(), None))
    done = []
    from_version = default_opset(model)
    for step, label in steps:
        try:
            result = step(model)
        except (UpgradeError, ir.passes.PostconditionError) as exc:
            raise Fp8OnnxError(
                f"Model file {str(path)!r} cannot be upgraded from opset {from_version} to {upgrade.target}: {exc}"
            ) from None
        model = result.model  # ConvertFloat16Pass returns a new model
        if step is upgrade and result.modified and from_version is not None:
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
        if a is not None and b is not None and (a.dtype is None) != (b.dtype is None):
            (a if a.dtype is None else b).dtype = a.dtype or b.dtype


def quantize(
    model: str | os.PathLike,
    output: str | os.PathLike,
    calib=None,
    *,
    config: QuantizeConfig | None = None,
    stats: str | os.PathLike | Stats | None = None,
    batch_size: int = 16,
    provider: str = "auto",
    report: str | os.PathLike | None = None,
    progress: bool = False,
    weight_memory: int = WEIGHT_MEMORY,
    **options,
) -> QuantizeReport:
    """Quantize the MatMul/Gemm nodes of ``model`` to float8 and write the result to ``output``.

    ``calib`` is a ``.npz`` file, a folder of them, or an iterable of feed dicts; ``stats`` a
    statistics file from :func:`fp8onnx.calibrate` (or a :class:`Stats`) used instead of running
    calibration. A model with more than ``weight_memory`` bytes of weights is calibrated layer by
    layer (see :mod:`fp8onnx.segments`). Keyword ``options`` build a :class:`QuantizeConfig` when
    ``config`` is not given.
    """
    config = config or QuantizeConfig(**options)
    if calib is not None and stats is not None:
        raise Fp8OnnxError("Give either --calib or --stats, not both.")
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", as_path(calib)), ("the statistics file", as_path(stats))],
        model_writes("the output model", output) + [("the report", report)],
    )
    out = pathlib.Path(output)
    provider = resolve_provider(provider)
    ir_model, from_opset, prepared = prepare_model(model, config.precision)
    decisions, skipped = plan(ir_model, config)
    act_names = activation_tensors(decisions, ir_model)

    run = {"batch_size": batch_size, "provider": provider, "progress": progress, "weight_memory": weight_memory}
    calibration = _activation_stats(ir_model, act_names, config, calib, stats, run)
    quant: dict[str, TensorQuant] = {}
    amax: dict[str, float | np.ndarray | None] = {}  # what each scale was derived from, for the report
    targets = []
    for d in decisions:
        for index, kind in d.inputs:
            value = d.node.inputs[index]
            if value.name not in quant:
                if kind == "weight":
                    quant[value.name], amax[value.name] = _weight_quant(d.node, index, value, config)
                else:
                    visible = in_main_graph(value, ir_model)
                    quant[value.name] = _activation_quant(value.name, calibration, config, visible)
                    amax[value.name] = None if calibration is None else calibration.amax.get(value.name)
            targets.append((d.node, index))
    _keep_conv_bias_in_int32_range(decisions, quant)
    nodes = [
        NodeReport(
            d.node.name,
            d.node.op_type,
            True,
            None,
            [_tensor_report(d.node.inputs[i].name, kind, quant, amax) for i, kind in d.inputs],
        )
        for d in decisions
    ]
    shielded = _bias_overflows(decisions, quant)
    if shielded:
        ShieldBiasPass(shielded)(ir_model)
        prepared.append(f"reshaped {len(shielded)} biases to [1, N] (onnxruntime would clip them as int32)")
    modified = InsertQDQPass(targets, quant)(ir_model).modified
    lowering = None
    if modified and config.native_gemm:
        lowering = LowerGemmFloat8Pass()(ir_model)
    if modified:
        ir_model.metadata_props["fp8onnx"] = json.dumps({"version": __version__, **config.to_json()}, sort_keys=True)
        if config.emulated:
            ir_model.metadata_props["fp8onnx_emulated"] = EMULATED_NOTE
            logger.warning("%s", EMULATED_NOTE)
    else:
        # Nothing to quantize: the output is the input graph as it was, not a rewritten copy.
        ir_model, prepared = load_model(model), []
    target_problems = check_tensorrt(ir_model) if config.target == "tensorrt" else []
    # GemmFloat8 has only a CUDA kernel: such a model is loaded for checking on the CUDA EP, if any.
    check_on = "cpu" if not (lowering and lowering.lowered) else ("cuda" if provider == "cuda" else None)
    # Weights that came in a side file go out in one too: written tensor by tensor, never whole.
    save_model(ir_model, out, provider=check_on, external_data=ir_model.meta.get(EXTERNAL_META, False))
    result = QuantizeReport(
        model=str(model),
        output=str(out),
        config=config.to_json(),
        opset_from=from_opset,
        opset_to=ir_model.opset_imports.get(""),
        prepared=prepared,
        nodes=nodes + skipped,
        calibration=None
        if calibration is None
        else {
            "batches": calibration.num_batches,
            "samples": calibration.num_samples,
            "source": _source(stats) if stats is not None else _source(calib, "feeds"),
        },
        input_bytes=_file_size(model),
        output_bytes=_file_size(out),
        modified=modified,
        lowered=list(lowering.lowered) if lowering else [],
        not_lowered=dict(lowering.skipped) if lowering else {},
        runtime_checked=check_on,
        target_problems=target_problems,
    )
    if report is not None:
        write_text_atomic(report, json.dumps(result.to_json(), indent=1) + "\n")
    return result


def _activation_stats(model, names, config, calib, stats, run: dict) -> Stats | None:
    """Calibration statistics for static activation scales, or None when none are needed."""
    if config.activations == "dynamic":
        if stats is not None or calib is not None:
            raise Fp8OnnxError("--activations dynamic needs no calibration; drop --calib/--stats (they contradict it).")
        return None
    if not names or config.scaling is Scaling.CONSTANT:
        return None
    hist = config.scaling.needs_histogram
    if stats is not None:
        loaded = stats if isinstance(stats, Stats) else Stats.load(stats)
        known = {v.name for n in ir.traversal.RecursiveGraphIterator(model.graph) for v in n.outputs}
        known.update(v.name for v in model.graph.inputs)
        stranger = next((n for n in loaded.amax if n not in known), None)
        if stranger is not None:
            raise Fp8OnnxError(
                f"Statistics {_source(stats)!r} have an entry for tensor {stranger!r}, which this model does not "
                "have; was it made for another model (or another --precision)?"
            )
        missing = [n for n in names if n not in loaded.amax or (hist and n not in loaded.hist)]
        if missing:
            what = "histogram" if missing[0] in loaded.amax else "entry"
            raise Fp8OnnxError(
                f"Statistics {_source(stats)!r} have no {what} for tensor {missing[0]!r}; rerun `fp8onnx calibrate` "
                "on this model."
            )
        return loaded
    if calib is None:
        raise Fp8OnnxError(
            "Activation scales need calibration: pass --calib DATA or --stats FILE "
            "(or --activations dynamic, or --scaling constant)."
        )
    return collect_amax(model, names, calib, histograms=hist, **run)


def _source(source, what: str = "statistics") -> str:
    """How reports and messages name calibration input: the file, or what was given in memory."""
    return str(source) if as_path(source) is not None else f"{what} given in memory"


def _activation_quant(name: str, stats: Stats | None, config: QuantizeConfig, visible: bool) -> TensorQuant:
    fmt = config.activation_format
    if config.activations == "dynamic" or (not visible and config.scaling is not Scaling.CONSTANT):
        return TensorQuant(fmt, None)
    if config.scaling is Scaling.CONSTANT:
        return TensorQuant(fmt, amax_to_scale(0.0, fmt, config.scaling, constant=config.scale))
    amax = stats.amax[name]
    clip = clipping_amax(
        amax,
        stats.hist.get(name),
        fmt,
        config.scaling,
        percentile=config.percentile if config.percentile is not None else DEFAULT_PERCENTILE,
    )
    return TensorQuant(fmt, amax_to_scale(clip, fmt, config.scaling, margin=config.margin))


def _bias_overflows(decisions: list[_Decision], quant: dict[str, TensorQuant]) -> list[ir.Node]:
    """Quantized Gemm nodes (and MatMul + Add, which ORT fuses into one) whose constant 1-D bias
    onnxruntime's BiasQuantization would saturate: it stores it as int32 with scale
    scale_A * scale_B (see ``passes.shield_bias``)."""
    nodes = []
    for d in decisions:
        node = d.node
        found = bias_of(node)
        if found is None or len(d.inputs) < 2:
            continue
        a, b = (quant[node.inputs[i].name] for i in (0, 1))
        if not (a.format.deployable and b.format.deployable):
            continue  # emulated: no DequantizeLinear for ORT to match
        if a.scale is None or b.scale is None:
            nodes.append(node)  # scales computed at run time: cannot rule it out
            continue
        holder, index = found
        bias = holder.inputs[index].const_value.numpy().astype(np.float64)
        if np.max(np.abs(bias), initial=0.0) >= float(np.min(a.scale) * np.min(b.scale)) * (2**31 - 1):
            nodes.append(node)
    return nodes


def _keep_conv_bias_in_int32_range(decisions: list[_Decision], quant: dict[str, TensorQuant]) -> None:
    """onnxruntime's BiasQuantization also stores a Conv's bias as int32 with scale scale_X * scale_W.
    A Conv's B must be 1-D (no [1, N] trick as for Gemm), so the weight scale is raised where needed:
    then max|B| / (scale_X * scale_W) < 2**30. It only triggers when X and W are so small that their
    product is negligible next to the bias."""
    for d in decisions:
        node = d.node
        if node.op_type != "Conv" or len(node.inputs) < 3 or node.inputs[2] is None or len(d.inputs) < 2:
            continue
        bias = node.inputs[2].const_value
        x, w = quant[node.inputs[0].name], quant[node.inputs[1].name]
        if bias is None or x.scale is None or w.scale is None or not w.format.deployable:
            continue  # a scale computed at run time is not constant: the rewrite does not apply
        need = np.abs(bias.numpy().astype(np.float64)) / (float(np.min(x.scale)) * 2.0**30)
        if np.ndim(w.scale):
            raised = np.maximum(w.scale, need)
        else:
            raised = max(float(w.scale), float(need.max(initial=0.0)))
        if np.any(np.asarray(raised) > np.asarray(w.scale)):
            logger.info("raised the weight scale of Conv %r to keep its bias representable as int32", node.name)
            quant[node.inputs[1].name] = TensorQuant(w.format, raised, w.axis)


def _weight_quant(node: ir.Node, index: int, value: ir.Value, config: QuantizeConfig):
    """(TensorQuant, amax) of a weight: its max is read once, per tensor or per output channel."""
    fmt = config.weight_format
    # Weights know their every value: percentile/mse clip activations only, weights keep their max.
    method = config.scaling if config.scaling in (Scaling.POW2, Scaling.CONSTANT) else Scaling.AMAX
    axis = output_channel_axis(node, index, len(value.shape)) if config.per_channel else None
    amax = weight_amax(value, axis)
    if axis is None:
        return TensorQuant(fmt, amax_to_scale(amax, fmt, method, margin=config.margin, constant=config.scale)), amax
    scales = np.array([amax_to_scale(a, fmt, method, margin=config.margin) for a in amax], dtype=np.float64)
    return TensorQuant(fmt, scales, axis), amax


def _tensor_report(name: str, kind: str, quant: dict[str, TensorQuant], amax: dict) -> TensorReport:
    tq = quant[name]
    return TensorReport(name, kind, tq.format.value, _jsonable(tq.scale), _jsonable(amax[name]), tq.axis)


def _jsonable(x):
    return x.tolist() if isinstance(x, np.ndarray) else x


def _file_size(path) -> int:
    path = pathlib.Path(path)
    data = side_file(path)
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
