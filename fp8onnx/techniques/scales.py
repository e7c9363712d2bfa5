"""Scales for every quantized tensor: calibration statistics (or none, for dynamic/constant scales),
weight maxima, and the two onnxruntime bias workarounds (int32 bias overflow for Gemm and Conv)."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph import known
from fp8onnx.graph.guard import as_path
from fp8onnx.graph.plan import Decision, in_main_graph
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.scaling import DEFAULT_PERCENTILE, Scaling, amax_to_scale, amax_to_scales, clipping_amax
from fp8onnx.passes import (
    TensorQuant,
    bias_of,
    output_channel_axis,
)
from fp8onnx.pipeline.calibration import Stats, block_amax, ranges_stats, weight_amax
from fp8onnx.pipeline.statistics import Ranges, measure
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.report import NodeReport, TensorReport

__all__ = [
    "activation_quant",
    "activation_ranges",
    "activation_stats",
    "assign_scales",
    "bias_overflows",
    "describe_source",
    "keep_conv_bias_in_int32_range",
    "tensor_report",
    "weight_quant",
]

logger = logging.getLogger(__name__)
# power-of-two dynamic scales computed in the graph: rounded up (pow2) or OCP MX's rule (mx)
_POW2_MODE = {Scaling.POW2: True, Scaling.MX: "mx"}


def assign_scales(
    decisions: list[Decision], model: ir.Model, config: QuantizeConfig, calibration: Stats | None, weights=None
):
    """(tensor name -> TensorQuant, tensor name -> the amax its scale came from) for every tensor the
    decisions quantize; each tensor once, however many nodes read it. ``weights``: the weights'
    (TensorQuant, amax) where already computed (:func:`weight_quant`)."""
    weights = weights or {}
    quant: dict[str, TensorQuant] = {}
    amax: dict[str, float | np.ndarray | None] = {}
    pow2 = _POW2_MODE.get(config.scaling, False)  # dynamic scales too
    for d in decisions:
        for index, kind in d.inputs:
            value = known.required_input(d.node, index)
            name = known.name(value)
            if name in quant:
                continue
            if kind == "weight":
                computed = weights.get(name)
                quant[name], amax[name] = computed or weight_quant(d.node, index, value, config)
            elif config.activations == "dynamic-per-token" and _per_token(value):
                quant[name] = TensorQuant(config.activation_format, None, axis=-1, pow2=pow2)
                amax[name] = None
            elif config.activations == "dynamic-per-group" and _per_token(value):
                group = config.group_size
                quant[name] = TensorQuant(config.activation_format, None, -1, group, pow2=pow2)
                amax[name] = None
            else:
                visible = in_main_graph(value, model)
                quant[name] = activation_quant(name, calibration, config, visible)
                amax[name] = None if calibration is None else calibration.amax.get(name)
    return quant, amax


def _per_token(value: ir.Value) -> bool:
    """Whether every MatMul/Gemm reading ``value`` reduces over its last axis (MatMul input A, Gemm
    input A without transA), so that one scale per row of ``value`` is one scale per output row.
    Others (Conv inputs, MatMul B inputs, transposed Gemm) get one dynamic scale per tensor."""
    uses = [(u.node, u.idx) for u in value.uses()]
    return bool(uses) and all(
        (node.op_type == "MatMul" and idx == 0)
        or (node.op_type == "Gemm" and idx == 0 and not node.attributes.get_int("transA", 0))
        or node.op_type not in ("MatMul", "Gemm", "Conv", "ConvTranspose")
        for node, idx in uses
    )


def activation_stats(model, names, config, calib, stats, run: RunOptions) -> Stats | None:
    """Calibration statistics for static activation scales, or None when none are needed."""
    ranges = activation_ranges(model, names, config, calib, stats)
    if not isinstance(ranges, Ranges):
        return ranges
    return ranges_stats(ranges, measure(model, [ranges], calib, run, "calibration"))


def activation_ranges(model, names, config, calib, stats) -> Stats | Ranges | None:
    """What static activation scales need: the statistics loaded from ``stats``, the
    :class:`~fp8onnx.pipeline.statistics.Ranges` to measure on ``calib``, or None when none are needed."""
    if config.activations.dynamic or config.activations == "none":
        # with --weight-rounding gptq the calibration data serves the weights' Hessians only
        unread = calib is not None and not config.weights_need_data
        if unread and stats is None and config.preset not in (None, "none") and "activations" not in config.explicit:
            # the preset chose these activations, not the user: the data given is not needed, not wrong
            logger.warning(
                "the calibration data is not read: --preset %s's --activations %s needs none",
                config.preset,
                config.activations.value,
            )
            return None
        if stats is not None or unread:
            raise Fp8OnnxError(
                f"--activations {config.activations.value} needs no calibration; drop --calib/--stats (they "
                "contradict it)."
            )
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
                f"Statistics {describe_source(stats)!r} have an entry for tensor {stranger!r}, which this model "
                "does not have; was it made for another model (or another --precision)?"
            )
        missing = [n for n in names if n not in loaded.amax or (hist and n not in loaded.hist)]
        if missing:
            what = "histogram" if missing[0] in loaded.amax else "entry"
            raise Fp8OnnxError(
                f"Statistics {describe_source(stats)!r} have no {what} for tensor {missing[0]!r}; rerun "
                "`fp8onnx calibrate` on this model."
            )
        return loaded
    if calib is None:
        raise Fp8OnnxError(
            "Activation scales need calibration: pass --calib DATA or --stats FILE "
            "(or --activations dynamic, or --scaling constant)."
        )
    return Ranges(names, histograms=hist)


def describe_source(source, what: str = "statistics") -> str:
    """How reports and messages name calibration input: the file, or what was given in memory."""
    return str(source) if as_path(source) is not None else f"{what} given in memory"


def activation_quant(name: str, stats: Stats | None, config: QuantizeConfig, visible: bool) -> TensorQuant:
    fmt = config.activation_format
    if config.activations.dynamic or (not visible and config.scaling is not Scaling.CONSTANT):
        return TensorQuant(fmt, None, pow2=_POW2_MODE.get(config.scaling, False))
    if config.scaling is Scaling.CONSTANT:
        return TensorQuant(fmt, amax_to_scale(0.0, fmt, config.scaling, constant=config.scale))
    if stats is None:
        raise Fp8OnnxError(f"Tensor {name!r} needs a static scale, and no calibration statistics were given for it.")
    amax = stats.amax[name]
    clip = clipping_amax(
        amax,
        stats.hist.get(name),
        fmt,
        config.scaling,
        percentile=config.percentile if config.percentile is not None else DEFAULT_PERCENTILE,
    )
    return TensorQuant(fmt, amax_to_scale(clip * config.headroom, fmt, config.scaling, margin=config.margin))


def bias_overflows(decisions: list[Decision], quant: dict[str, TensorQuant]) -> list[ir.Node]:
    """Quantized Gemm nodes (and MatMul + Add, which ORT fuses into one) whose constant 1-D bias
    onnxruntime's BiasQuantization would saturate: it stores it as int32 with scale
    scale_A * scale_B (see ``passes.shield_bias``)."""
    nodes = []
    for d in decisions:
        node = d.node
        found = bias_of(node)
        if found is None or len(d.inputs) < 2:
            continue
        a, b = (quant[known.name(known.required_input(node, i))] for i in (0, 1))
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


def keep_conv_bias_in_int32_range(decisions: list[Decision], quant: dict[str, TensorQuant]) -> None:
    """onnxruntime's BiasQuantization also stores a Conv's bias as int32 with scale scale_X * scale_W.
    A Conv's B must be 1-D (no [1, N] trick as for Gemm), so the weight scale is raised where needed:
    then max|B| / (scale_X * scale_W) < 2**30. It only triggers when X and W are so small that their
    product is negligible next to the bias."""
    for d in decisions:
        node = d.node
        if node.op_type != "Conv" or len(node.inputs) < 3 or (held := node.inputs[2]) is None or len(d.inputs) < 2:
            continue
        bias = held.const_value
        weight = known.name(known.required_input(node, 1))
        x, w = quant[known.name(known.required_input(node, 0))], quant[weight]
        if bias is None or x.scale is None or w.scale is None or not w.format.deployable or w.block_size:
            continue  # a scale computed at run time is not constant, blocks are reshaped before the Conv:
            # no quantized Conv for onnxruntime to form, no int32 bias
        need = np.abs(bias.numpy().astype(np.float64)) / (float(np.min(x.scale)) * 2.0**30)
        if np.ndim(w.scale):
            raised = np.maximum(w.scale, need)
        else:
            raised = max(float(w.scale), float(need.max(initial=0.0)))
        if np.any(np.asarray(raised) > np.asarray(w.scale)):
            logger.info("raised the weight scale of Conv %r to keep its bias representable as int32", node.name)
            quant[weight] = TensorQuant(w.format, raised, w.axis)


def block_axis(node: ir.Node, index: int, rank: int) -> int | None:
    """The reduction axis (K) of a MatMul/Gemm weight, along which its block scales run; for a Conv
    weight [M, C/group, *kernel], axis 1 of its view as [M, C/group x kernel] (the reduction of each
    output channel: its input channels times the kernel, flattened); for a ConvTranspose weight
    [C, M/group, *kernel], axis 0 of its view as [C, M/group x kernel] (blocks of input channels, the
    reduction, at each output channel and kernel tap); None for others and for a MatMul/Gemm weight
    that is not 2-D."""
    if index != 1:
        return None
    if node.op_type in ("Conv", "ConvTranspose") and rank >= 3:
        return 1 if node.op_type == "Conv" else 0
    if rank != 2 or node.op_type not in ("MatMul", "Gemm"):
        return None
    return 1 if node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0 else 0


def weight_quant(node: ir.Node, index: int, value: ir.Value, config: QuantizeConfig):
    """(TensorQuant, amax) of a weight: its max is read once, per tensor, per output channel or, with
    ``--weight-block-size``, per block of K (MatMul/Gemm)."""
    fmt = config.weight_format
    # Weights know their every value: percentile/mse clip activations only, weights keep their max.
    method = config.scaling if config.scaling in (Scaling.POW2, Scaling.MX, Scaling.CONSTANT) else Scaling.AMAX
    axis = block_axis(node, index, len(known.value_shape(value))) if config.weight_block_size else None
    if axis is not None:
        amax = block_amax(value, axis, config.weight_block_size)
        scales = amax_to_scales(amax, fmt, method, margin=config.margin)
        return TensorQuant(fmt, scales, axis, config.weight_block_size), amax
    axis = (
        output_channel_axis(node, index, len(known.value_shape(value)))
        if config.weight_per_channel(node.op_type)
        else None
    )
    amax = weight_amax(value, axis)
    if axis is None:
        return TensorQuant(fmt, amax_to_scale(amax, fmt, method, margin=config.margin, constant=config.scale)), amax
    return TensorQuant(fmt, amax_to_scales(amax, fmt, method, margin=config.margin), axis), amax


def tensor_report(name: str, kind: str, quant: dict[str, TensorQuant], amax: dict) -> TensorReport:
    tq = quant[name]
    return TensorReport(name, kind, tq.format.value, tq.scale, amax[name], tq.axis, tq.block_size)


def node_report(decision: Decision, quant: dict[str, TensorQuant], amax: dict) -> NodeReport:
    """The report's line for a quantized node: each quantized input's format, scale and amax."""
    node = decision.node
    tensors = [
        tensor_report(known.name(known.required_input(node, i)), kind, quant, amax) for i, kind in decision.inputs
    ]
    return NodeReport(known.name(node), node.op_type, True, None, tensors)
