"""The per-op adapters of :mod:`.upgrade_opset`: each rewrites one node whose op changed signature
or semantics between opsets 6 and 21 into the form opset 21 defines (the table is in that module's
docstring). ``ADAPTERS`` maps an op to [(opset where the new form begins, adapter)]."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from .known import graph_of, required_input

__all__ = ["ADAPTERS", "MIN_IR_VERSION", "TARGET_OPSET", "UpgradeError", "default_opset", "describe"]

logger = logging.getLogger(__name__)
TARGET_OPSET = 21
MIN_IR_VERSION = 10  # what opset 21 requires


class UpgradeError(ValueError):
    """A node that cannot be upgraded; the message names it."""


def default_opset(model: ir.Model) -> int | None:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def describe(node: ir.Node) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"an unnamed {node.op_type} node"


def _const(node: ir.Node, array: np.ndarray, tag: str) -> ir.Value:
    """A Constant node right before ``node`` (works in graphs, subgraphs and functions alike)."""
    tape = ir.tape.Tape()
    const = tape.op("Constant", [], {"value": ir.tensor(array)}, name=f"{node.name}_{tag}_upgrade")
    const.name = f"{node.name}_{tag}_upgrade"
    graph_of(node).insert_before(node, tape.nodes)
    return const


def _cast_like(node: ir.Node, value: ir.Value, like: ir.Value, tag: str) -> ir.Value:
    tape = ir.tape.Tape()
    cast = tape.op("CastLike", [value, like], name=f"{node.name}_{tag}_cast_upgrade")
    cast.name = f"{node.name}_{tag}_cast_upgrade"
    graph_of(node).insert_before(node, tape.nodes)
    return cast


def _set_input(node: ir.Node, index: int, value: ir.Value | None) -> None:
    if len(node.inputs) <= index:
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)


def _attr_to_input(node: ir.Node, attr: str, index: int, dtype=np.int64, like_input: bool = False) -> None:
    """Move attribute ``attr`` to input ``index`` (absent attribute: absent input)."""
    found = node.attributes.pop(attr, None)
    if found is None:
        return
    value = _const(node, np.array(found.value, dtype=dtype), attr)
    if like_input:  # scalars that must have the data's own type (Pad value, Clip min/max)
        value = _cast_like(node, value, required_input(node, 0), attr)
    _set_input(node, index, value)


def _replace(node: ir.Node, tape: ir.tape.Tape, outputs: list[ir.Value]) -> None:
    """``node`` replaced by the nodes recorded on ``tape``, its outputs by ``outputs``."""
    ir.convenience.replace_nodes_and_values(graph_of(node), node, [node], list(tape.nodes), list(node.outputs), outputs)


def _reduce_axes(node: ir.Node) -> None:
    _attr_to_input(node, "axes", 1)


def _split_input(node: ir.Node) -> None:
    _attr_to_input(node, "split", 1)


def _split_num_outputs(node: ir.Node) -> None:
    if len(node.inputs) < 2 or node.inputs[1] is None:
        node.attributes["num_outputs"] = ir.AttrInt64("num_outputs", len(node.outputs))


def _slice(node: ir.Node) -> None:
    starts = node.attributes.pop("starts").value
    ends = node.attributes.pop("ends").value
    axes = node.attributes.pop("axes", None)
    _set_input(node, 1, _const(node, np.array(starts, np.int64), "starts"))
    _set_input(node, 2, _const(node, np.array(ends, np.int64), "ends"))
    if axes is not None:
        _set_input(node, 3, _const(node, np.array(axes.value, np.int64), "axes"))


def _topk(node: ir.Node) -> None:
    _set_input(node, 1, _const(node, np.array([node.attributes.pop("k").value], np.int64), "k"))


def _pad(node: ir.Node) -> None:
    _attr_to_input(node, "pads", 1)
    value = node.attributes.pop("value", None)
    if value is not None and value.value != 0.0:
        scalar = _const(node, np.array(value.value, np.float32), "value")
        _set_input(node, 2, _cast_like(node, scalar, required_input(node, 0), "value"))


def _clip(node: ir.Node) -> None:
    _attr_to_input(node, "min", 1, np.float32, like_input=True)
    _attr_to_input(node, "max", 2, np.float32, like_input=True)


def _dropout(node: ir.Node) -> None:
    _attr_to_input(node, "ratio", 1, np.float32)


def _becomes(op_type: str) -> Callable[[ir.Node], None]:
    """The same inputs and attributes under the op that took over (Scatter -> ScatterElements)."""

    def adapter(node: ir.Node) -> None:
        tape = ir.tape.Tape()
        new = tape.op(op_type, list(node.inputs), dict(node.attributes), name=node.name)
        _replace(node, tape, [new])

    return adapter


def _softmax_family(node: ir.Node) -> None:
    """Before 13, Softmax(axis=a) flattened its input to 2-D at a and normalised each row: the same
    as Flatten(axis=a) -> op(axis=1) -> Reshape to the input's shape. A last axis needs no reshape."""
    attr = node.attributes.pop("axis", None)
    axis = 1 if attr is None else attr.value
    x = required_input(node, 0)
    rank = len(x.shape) if x.shape is not None else None
    if rank is not None and axis % max(rank, 1) == rank - 1:
        node.attributes["axis"] = ir.AttrInt64("axis", -1)
        return
    tape = ir.tape.Tape()
    shape = tape.op("Shape", [x], name=f"{node.name}_shape_upgrade")
    flat = tape.op("Flatten", [x], {"axis": axis}, name=f"{node.name}_flatten_upgrade")
    op = tape.op(node.op_type, [flat], {"axis": 1}, name=node.name)
    back = tape.op("Reshape", [op, shape], name=f"{node.name}_reshape_upgrade")
    for produced in tape.nodes[:3]:  # Shape, Flatten, the op
        produced.outputs[0].name = f"{produced.name}_out"
    _replace(node, tape, [back])


def _resize_attributes(mode: str, nearest: str = "floor") -> dict:
    # Upsample and Resize-10 map output to input coordinates as x_in = x_out / scale ("asymmetric");
    # onnxruntime picks the nearest pixel by rounding down when enlarging and up when shrinking.
    attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric"}
    if mode == "nearest":
        attrs["nearest_mode"] = nearest
    return attrs


def _upsample(node: ir.Node) -> None:
    mode = node.attributes.get_string("mode", "nearest")
    scales = node.attributes.pop("scales", None)
    scale_value = _const(node, np.array(scales.value, np.float32), "scales") if scales is not None else node.inputs[1]
    tape = ir.tape.Tape()
    new = tape.op("Resize", [node.inputs[0], None, scale_value], _resize_attributes(mode), name=node.name)
    _replace(node, tape, [new])


def _resize_10(node: ir.Node) -> None:
    """Resize-10 (X, scales) -> (X, roi, scales). Nearest rounds down on enlarged axes and up on shrunk
    ones: one Resize when every axis goes one way, else one Resize per direction (``axes``, opset 18)."""
    mode = node.attributes.get_string("mode", "nearest")
    x, scales = node.inputs[0], required_input(node, 1)
    known = scales.const_value.numpy().astype(np.float64) if scales.const_value is not None else None
    if mode != "nearest" or known is None or (known >= 1).all() or (known <= 1).all():
        if mode == "nearest" and known is None:
            logger.warning("%s: scales are computed at run time; assumed enlarging (nearest rounds down)", node.name)
        nearest = "ceil" if known is not None and (known <= 1).all() and (known < 1).any() else "floor"
        tape = ir.tape.Tape()
        new = tape.op("Resize", [x, None, scales], _resize_attributes(mode, nearest), name=node.name)
        _replace(node, tape, [new])
        return
    down, up = np.flatnonzero(known < 1), np.flatnonzero(known > 1)
    tape = ir.tape.Tape()
    first = tape.op(
        "Resize",
        [x, None, _const(node, known[down].astype(np.float32), "scales_down")],
        {**_resize_attributes(mode, "ceil"), "axes": down.tolist()},
        name=f"{node.name}_down_upgrade",
    )
    first.name = f"{node.name}_down_upgrade"
    second = tape.op(
        "Resize",
        [first, None, _const(node, known[up].astype(np.float32), "scales_up")],
        {**_resize_attributes(mode, "floor"), "axes": up.tolist()},
        name=node.name,
    )
    _replace(node, tape, [second])


def _resize_13(node: ir.Node) -> None:
    """Resize-11/12: roi and scales became optional at 13 and ``tf_half_pixel_for_nn`` left the spec."""
    ctm = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    if ctm != "tf_crop_and_resize" and len(node.inputs) > 1:
        node.replace_input_with(1, None)
    scales = node.inputs[2] if len(node.inputs) > 2 else None
    if scales is not None and scales.const_value is not None and scales.const_value.size == 0:
        node.replace_input_with(2, None)
    if ctm == "tf_half_pixel_for_nn":
        nearest = node.attributes.get_string("nearest_mode", "round_prefer_floor")
        exact = {"floor": "round_prefer_ceil", "round_prefer_floor": "ceil"}  # x_in = (x+0.5)/s vs half_pixel
        if node.attributes.get_string("mode", "nearest") == "nearest" and nearest in exact:
            node.attributes["coordinate_transformation_mode"] = ir.AttrString(
                "coordinate_transformation_mode", "half_pixel"
            )
            node.attributes["nearest_mode"] = ir.AttrString("nearest_mode", exact[nearest])
        else:
            logger.warning("%s: tf_half_pixel_for_nn kept (onnxruntime still runs it)", node.name)


def _roi_align(node: ir.Node) -> None:
    # RoiAlign-16's default half_pixel shifts every sample by half a pixel; RoiAlign-10 had none.
    if "coordinate_transformation_mode" not in node.attributes:
        node.attributes["coordinate_transformation_mode"] = ir.AttrString(
            "coordinate_transformation_mode", "output_half_pixel"
        )


def _chain(node: ir.Node, steps: list[tuple[str, np.ndarray | None]]) -> None:
    """Replace ``node`` by a chain of unary steps on its input: (op, None) or (op, constant operand
    cast like the input)."""
    x = out = required_input(node, 0)
    tape = ir.tape.Tape()
    for i, (op, operand) in enumerate(steps):
        inputs = [out]
        if operand is not None:
            inputs.append(_cast_like(node, _const(node, operand.astype(np.float32), f"c{i}"), x, f"c{i}"))
        out = tape.op(op, inputs, name=node.name if i == len(steps) - 1 else f"{node.name}_{i}_upgrade")
        if i < len(steps) - 1:
            out.name = f"{node.name}_{i}_upgrade"
    _replace(node, tape, [out])


def _experimental(node: ir.Node) -> None:
    """The experimental ops ONNX removed at opset 10, as the ops they stood for (onnxruntime's semantics)."""
    get = node.attributes.get_float
    op = node.op_type
    if op == "ImageScaler":
        bias = node.attributes.get_floats("bias", None)
        steps: list[tuple[str, np.ndarray | None]] = [("Mul", np.array(get("scale", 1.0)))]
        if bias is not None:
            steps.append(("Add", np.array(bias).reshape(1, -1, 1, 1)))
    elif op == "Scale":
        steps = [("Mul", np.array(get("scale", 1.0)))]
    elif op == "Affine":
        steps = [("Mul", np.array(get("alpha", 1.0))), ("Add", np.array(get("beta", 0.0)))]
    else:  # ScaledTanh, ParametricSoftplus: alpha * f(beta * x)
        f = "Tanh" if op == "ScaledTanh" else "Softplus"
        steps = [("Mul", np.array(get("beta", 1.0))), (f, None), ("Mul", np.array(get("alpha", 1.0)))]
    _chain(node, steps)


def _mvn_1(node: ir.Node) -> None:
    """MeanVarianceNormalization-1 (experimental): statistics over N,H,W (or N,C,H,W across channels)."""
    across = node.attributes.get_int("across_channels", 0)
    axes = [0, 1, 2, 3] if across else [0, 2, 3]
    tape = ir.tape.Tape()
    if node.attributes.get_int("normalize_variance", 1):
        new = tape.op("MeanVarianceNormalization", [node.inputs[0]], {"axes": axes}, name=node.name)
        _replace(node, tape, [new])
        return
    mean = tape.op(
        "ReduceMean",
        [node.inputs[0], _const(node, np.array(axes, np.int64), "axes")],
        {"keepdims": 1},
        name=f"{node.name}_mean_upgrade",
    )
    mean.name = f"{node.name}_mean_upgrade"
    sub = tape.op("Sub", [node.inputs[0], mean], name=node.name)
    _replace(node, tape, [sub])


def _batch_norm(node: ir.Node) -> None:
    spatial = node.attributes.pop("spatial", None)
    if spatial is not None and spatial.value != 1:
        raise UpgradeError(
            f"{describe(node)} normalises per element (spatial=0), which BatchNormalization no longer "
            "expresses after opset 8; cannot upgrade it."
        )
    node.attributes.pop("is_test", None)
    node.attributes.pop("consumed_inputs", None)
    extra = [v for v in node.outputs[1:] if v.uses() or v.is_graph_output()]
    if extra:
        raise UpgradeError(
            f"{describe(node)} has training outputs ({extra[0].name!r}) in use; inference BatchNormalization "
            "at opset 14+ does not compute them."
        )
    node.resize_outputs(1)


def _broadcast_7(node: ir.Node) -> None:
    """Opset 7 replaced ``broadcast``/``axis`` with numpy's rule. Gemm's C broadcasts to [M, N] anyway;
    an element-wise B aligned at ``axis`` of A gets trailing ones (a Reshape) so that numpy's rule,
    which aligns the last axes, puts it there; without ``axis`` the old rule already aligned the last."""
    broadcast = node.attributes.pop("broadcast", None)
    axis = node.attributes.pop("axis", None)
    if node.op_type == "Gemm" or broadcast is None or not broadcast.value or axis is None:
        return
    a, b = required_input(node, 0), required_input(node, 1)
    if a.shape is None or b.shape is None:
        raise UpgradeError(
            f"{describe(node)} broadcasts B at axis {axis.value} (opset 6) and the ranks of its inputs are "
            f"unknown, so fp8onnx cannot align it for opset {TARGET_OPSET}"
        )
    extra = len(a.shape) - axis.value - len(b.shape)
    if extra <= 0:
        return
    shape = _const(node, np.array([0] * len(b.shape) + [1] * extra, np.int64), "broadcast_shape")
    tape = ir.tape.Tape()
    reshaped = tape.op("Reshape", [b, shape], name=f"{node.name}_broadcast_upgrade")
    reshaped.name = f"{node.name}_broadcast_upgrade"
    graph_of(node).insert_before(node, tape.nodes)
    node.replace_input_with(1, reshaped)


def _refuse(reason: str) -> Callable[[ir.Node], None]:
    def adapter(node: ir.Node) -> None:
        raise UpgradeError(f"{describe(node)} {reason}; fp8onnx cannot upgrade it to opset {TARGET_OPSET}.")

    return adapter


_REDUCE_18: tuple[str, ...] = (
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
)
_REDUCE_18 += ("ReduceProd", "ReduceSumSquare")
# op -> [(opset where the new signature begins, adapter)], applied in order when the node is older
ADAPTERS: dict[str, list[tuple[int, Callable[[ir.Node], None]]]] = {
    **{
        op: [(7, _broadcast_7)]
        for op in ("Gemm", "Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less")
    },
    **{op: [(18, _reduce_axes)] for op in _REDUCE_18},
    "ReduceSum": [(13, _reduce_axes)],
    "Split": [(13, _split_input), (18, _split_num_outputs)],
    "Squeeze": [(13, _reduce_axes)],
    "Unsqueeze": [(13, _reduce_axes)],
    "Slice": [(10, _slice)],
    "TopK": [(10, _topk)],
    "Pad": [(11, _pad)],
    "Clip": [(11, _clip)],
    "Dropout": [(12, _dropout)],
    "Scatter": [(11, _becomes("ScatterElements"))],
    "Softmax": [(13, _softmax_family)],
    "LogSoftmax": [(13, _softmax_family)],
    "Hardmax": [(13, _softmax_family)],
    "Upsample": [(10, _upsample)],
    "Resize": [(11, _resize_10), (13, _resize_13)],
    "RoiAlign": [(16, _roi_align)],
    **{op: [(10, _experimental)] for op in ("ImageScaler", "Scale", "Affine", "ScaledTanh", "ParametricSoftplus")},
    "MeanVarianceNormalization": [(9, _mvn_1)],
    "DynamicSlice": [(10, _becomes("Slice"))],
    "BatchNormalization": [(9, _batch_norm)],
    "Scan": [(9, _refuse("is a Scan-8 (batch axis and sequence_lens), whose form changed at opset 9"))],
    **{
        op: [(10, _refuse("is an experimental op that ONNX removed at opset 10"))]
        for op in ("Crop", "GivenTensorFill", "ConstantFill", "GRUUnit", "ATen")
    },
}
