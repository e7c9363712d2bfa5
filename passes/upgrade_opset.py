"""Upgrade the default-domain opset to the one fp8onnx emits (21), computing what the original computed.

Why 21 and not 19 (where float8 QuantizeLinear first appeared): from opset 21 QuantizeLinear takes
an ``output_dtype`` attribute, so a float8 Q needs no zero-point input. onnxruntime's
ReluQuantRewrite (on at its default optimisation level) deletes a Relu feeding a QuantizeLinear
*with* a zero point, letting negative values through for float8 types; without one it leaves the
Relu alone. Models already at 21 or above are left as they are.

onnxscript's version converter (0.7) only relabels nodes, except for DFT, GridSample and
GroupNormalization: an attribute that became an input stays an attribute, and onnxruntime then
refuses the model ("Unrecognized attribute: axes for operator ReduceMean"). So every default-domain
op whose signature or semantics changed between opsets 7 and 21 has an adapter here (from the ONNX
operator changelog; each is tested by running the old and the upgraded graph on onnxruntime):

  since  op                                  rewrite
  9      BatchNormalization                  ``spatial=1`` dropped (0 is refused); unused training outputs dropped
  9      MeanVarianceNormalization-1         ``axes`` [0,2,3] (or [0,1,2,3] across channels); no variance: x - mean
  10     Slice                               starts/ends/axes attributes -> inputs
  10     TopK                                k attribute -> input
  10     Upsample (7: scales attr, 9: input) -> Resize, asymmetric coordinates, nearest rounds down
  10     ImageScaler, Scale, Affine,         (experimental, removed) -> Mul/Add/Tanh/Softplus chains
         ScaledTanh, ParametricSoftplus
  10     DynamicSlice (experimental)         -> Slice
  11     Resize-10                           (X, scales) -> (X, roi, scales), asymmetric; nearest rounds down on
                                             enlarged axes and up on shrunk ones (mixed: two Resizes)
  11     Pad                                 pads/value attributes -> inputs (value in the data's type)
  11     Clip                                min/max attributes -> inputs (in the data's type)
  11     Scatter                             -> ScatterElements (same semantics)
  12     Dropout                             ratio attribute -> input
  13     Resize-11                           roi dropped unless tf_crop_and_resize; tf_half_pixel_for_nn mapped
  13     ReduceSum                           axes attribute -> input
  13     Split                               split attribute -> input
  13     Squeeze, Unsqueeze                  axes attribute -> input
  13     Softmax, LogSoftmax, Hardmax        2-D coercion at ``axis`` -> Flatten, op on axis 1, Reshape
  16     RoiAlign                            coordinate_transformation_mode=output_half_pixel (the old behaviour)
  18     Reduce{L1,L2,LogSum,LogSumExp,      axes attribute -> input
         Max,Mean,Min,Prod,SumSquare}
  18     Split without split input           num_outputs = number of outputs
  refused: Scan-8, BatchNormalization spatial=0, Crop, GivenTensorFill, ConstantFill, GRUUnit, ATen
Then onnxscript's converter relabels every node and runs its three adapters (DFT-20 axis input,
GridSample-20 mode names, GroupNormalization-21 per-channel scale). onnx's own C++ converter is not
used: it serialises the whole model (< 2 GB) and gets Hardmax-13, Upsample/Resize coordinates and
Pad/Clip constants of float16 models wrong (checked by running its output).

Rewrite cases:
  opset < 21   -> adapted and relabelled; ``from_version`` records the old opset; IR version >= 10
  opset >= 21  -> unchanged (``modified`` is False)
  an op that cannot be expressed at 21 (e.g. BatchNormalization spatial=0, Scan-8, an op ONNX
  removed) -> UpgradeError naming the node and op

ensures: every default-domain node that ONNX defines at 21 has only attributes its schema knows
and at most its number of inputs (ops ONNX does not define, like onnxruntime's
SimplifiedLayerNormalization, are onnxruntime's to check: the model's session does).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.version_converter as version_converter

__all__ = ["TARGET_OPSET", "UpgradeError", "UpgradeOpsetPass", "UpgradeResult", "check_schemas", "default_opset"]

logger = logging.getLogger(__name__)
TARGET_OPSET = 21
MIN_IR_VERSION = 10  # what opset 21 requires


class UpgradeError(ValueError):
    """A node that cannot be upgraded; the message names it."""


def default_opset(model: ir.Model) -> int | None:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def _describe(node: ir.Node) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"an unnamed {node.op_type} node"


def _const(node: ir.Node, array: np.ndarray, tag: str) -> ir.Value:
    """A Constant node right before ``node`` (works in graphs, subgraphs and functions alike)."""
    const = ir.node("Constant", [], {"value": ir.tensor(array)}, name=f"{node.name}_{tag}_upgrade")
    const.outputs[0].name = f"{node.name}_{tag}_upgrade"
    node.graph.insert_before(node, const)
    return const.outputs[0]


def _cast_like(node: ir.Node, value: ir.Value, like: ir.Value, tag: str) -> ir.Value:
    cast = ir.node("CastLike", [value, like], name=f"{node.name}_{tag}_cast_upgrade")
    cast.outputs[0].name = f"{node.name}_{tag}_cast_upgrade"
    node.graph.insert_before(node, cast)
    return cast.outputs[0]


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
        value = _cast_like(node, value, node.inputs[0], attr)
    _set_input(node, index, value)


def _replace(node: ir.Node, new_nodes: list[ir.Node], outputs: list[ir.Value]) -> None:
    ir.convenience.replace_nodes_and_values(node.graph, node, [node], new_nodes, list(node.outputs), outputs)


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
        _set_input(node, 2, _cast_like(node, scalar, node.inputs[0], "value"))


def _clip(node: ir.Node) -> None:
    _attr_to_input(node, "min", 1, np.float32, like_input=True)
    _attr_to_input(node, "max", 2, np.float32, like_input=True)


def _dropout(node: ir.Node) -> None:
    _attr_to_input(node, "ratio", 1, np.float32)


def _becomes(op_type: str) -> Callable[[ir.Node], None]:
    """The same inputs and attributes under the op that took over (Scatter -> ScatterElements)."""

    def adapter(node: ir.Node) -> None:
        new = ir.node(op_type, list(node.inputs), dict(node.attributes), name=node.name)
        _replace(node, [new], list(new.outputs))

    return adapter


def _softmax_family(node: ir.Node) -> None:
    """Before 13, Softmax(axis=a) flattened its input to 2-D at a and normalised each row: the same
    as Flatten(axis=a) -> op(axis=1) -> Reshape to the input's shape. A last axis needs no reshape."""
    attr = node.attributes.pop("axis", None)
    axis = 1 if attr is None else attr.value
    x = node.inputs[0]
    rank = len(x.shape) if x.shape is not None else None
    if rank is not None and axis % max(rank, 1) == rank - 1:
        node.attributes["axis"] = ir.AttrInt64("axis", -1)
        return
    shape = ir.node("Shape", [x], name=f"{node.name}_shape_upgrade")
    flat = ir.node("Flatten", [x], {"axis": axis}, name=f"{node.name}_flatten_upgrade")
    op = ir.node(node.op_type, [flat.outputs[0]], {"axis": 1}, name=node.name)
    back = ir.node("Reshape", [op.outputs[0], shape.outputs[0]], name=f"{node.name}_reshape_upgrade")
    for new in (shape, flat, op):
        new.outputs[0].name = f"{new.name}_out"
    _replace(node, [shape, flat, op, back], list(back.outputs))


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
    new = ir.node("Resize", [node.inputs[0], None, scale_value], _resize_attributes(mode), name=node.name)
    _replace(node, [new], list(new.outputs))


def _resize_10(node: ir.Node) -> None:
    """Resize-10 (X, scales) -> (X, roi, scales). Nearest rounds down on enlarged axes and up on shrunk
    ones: one Resize when every axis goes one way, else one Resize per direction (``axes``, opset 18)."""
    mode = node.attributes.get_string("mode", "nearest")
    x, scales = node.inputs[0], node.inputs[1]
    known = scales.const_value.numpy().astype(np.float64) if scales.const_value is not None else None
    if mode != "nearest" or known is None or (known >= 1).all() or (known <= 1).all():
        if mode == "nearest" and known is None:
            logger.warning("%s: scales are computed at run time; assumed enlarging (nearest rounds down)", node.name)
        nearest = "ceil" if known is not None and (known <= 1).all() and (known < 1).any() else "floor"
        new = ir.node("Resize", [x, None, scales], _resize_attributes(mode, nearest), name=node.name)
        _replace(node, [new], list(new.outputs))
        return
    down, up = np.flatnonzero(known < 1), np.flatnonzero(known > 1)
    first = ir.node(
        "Resize",
        [x, None, _const(node, known[down].astype(np.float32), "scales_down")],
        {**_resize_attributes(mode, "ceil"), "axes": down.tolist()},
        name=f"{node.name}_down_upgrade",
    )
    first.outputs[0].name = f"{node.name}_down_upgrade"
    second = ir.node(
        "Resize",
        [first.outputs[0], None, _const(node, known[up].astype(np.float32), "scales_up")],
        {**_resize_attributes(mode, "floor"), "axes": up.tolist()},
        name=node.name,
    )
    _replace(node, [first, second], list(second.outputs))


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
    x = out = node.inputs[0]
    new_nodes = []
    for i, (op, operand) in enumerate(steps):
        inputs = [out]
        if operand is not None:
            inputs.append(_cast_like(node, _const(node, operand.astype(np.float32), f"c{i}"), x, f"c{i}"))
        step = ir.node(op, inputs, name=node.name if i == len(steps) - 1 else f"{node.name}_{i}_upgrade")
        if i < len(steps) - 1:
            step.outputs[0].name = f"{node.name}_{i}_upgrade"
        new_nodes.append(step)
        out = step.outputs[0]
    _replace(node, new_nodes, [out])


def _experimental(node: ir.Node) -> None:
    """The experimental ops ONNX removed at opset 10, as the ops they stood for (onnxruntime's semantics)."""
    get = node.attributes.get_float
    op = node.op_type
    if op == "ImageScaler":
        bias = node.attributes.get_floats("bias", None)
        steps = [("Mul", np.array(get("scale", 1.0)))]
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
    if node.attributes.get_int("normalize_variance", 1):
        new = ir.node("MeanVarianceNormalization", [node.inputs[0]], {"axes": axes}, name=node.name)
        _replace(node, [new], list(new.outputs))
        return
    mean = ir.node(
        "ReduceMean",
        [node.inputs[0], _const(node, np.array(axes, np.int64), "axes")],
        {"keepdims": 1},
        name=f"{node.name}_mean_upgrade",
    )
    mean.outputs[0].name = f"{node.name}_mean_upgrade"
    sub = ir.node("Sub", [node.inputs[0], mean.outputs[0]], name=node.name)
    _replace(node, [mean, sub], list(sub.outputs))


def _batch_norm(node: ir.Node) -> None:
    spatial = node.attributes.pop("spatial", None)
    if spatial is not None and spatial.value != 1:
        raise UpgradeError(
            f"{_describe(node)} normalises per element (spatial=0), which BatchNormalization no longer "
            "expresses after opset 8; cannot upgrade it."
        )
    node.attributes.pop("is_test", None)
    node.attributes.pop("consumed_inputs", None)
    extra = [v for v in node.outputs[1:] if v.uses() or v.is_graph_output()]
    if extra:
        raise UpgradeError(
            f"{_describe(node)} has training outputs ({extra[0].name!r}) in use; inference BatchNormalization "
            "at opset 14+ does not compute them."
        )
    node.resize_outputs(1)


def _refuse(reason: str) -> Callable[[ir.Node], None]:
    def adapter(node: ir.Node) -> None:
        raise UpgradeError(f"{_describe(node)} {reason}; fp8onnx cannot upgrade it to opset {TARGET_OPSET}.")

    return adapter


_REDUCE_18 = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin")
_REDUCE_18 += ("ReduceProd", "ReduceSumSquare")
# op -> [(opset where the new signature begins, adapter)], applied in order when the node is older
ADAPTERS: dict[str, list[tuple[int, Callable[[ir.Node], None]]]] = {
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


def _graphs(model: ir.Model):
    """(graph or function, its default opset) for the main graph, every subgraph and every function."""
    opset = default_opset(model)
    yield model.graph, opset
    for sub in model.graph.subgraphs():
        yield sub, opset
    for function in model.functions.values():
        fn_opset = function.opset_imports.get("", opset)
        yield function, fn_opset
        for node in function:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    yield attr.value, fn_opset
                elif attr.type == ir.AttributeType.GRAPHS:
                    for g in attr.value:
                        yield g, fn_opset


def adapt(model: ir.Model, target: int = TARGET_OPSET) -> int:
    """Apply every adapter a node older than ``target`` needs; returns how many nodes were rewritten."""
    rewritten = 0
    for graph, opset in list(_graphs(model)):
        for node in list(graph):
            if node.domain not in ("", "ai.onnx"):
                continue
            version = node.version or opset or target
            for since, adapter in ADAPTERS.get(node.op_type, []):
                if version < since <= target:
                    adapter(node)
                    rewritten += 1
                    if node.graph is None:  # replaced by nodes already in the new form
                        break
    return rewritten


def check_schemas(model: ir.Model, target: int = TARGET_OPSET) -> None:
    """Every default-domain node that ONNX defines at ``target`` is one its schema accepts."""
    for graph, _ in _graphs(model):
        for node in graph:
            if node.domain not in ("", "ai.onnx"):
                continue
            try:
                schema = onnx.defs.get_schema(node.op_type, target, "")
            except onnx.defs.SchemaError:
                continue  # not an ONNX op (e.g. onnxruntime's ops in the default domain)
            if schema.deprecated:
                raise UpgradeError(f"{_describe(node)} is deprecated at opset {target} and was not converted.")
            unknown = sorted(set(node.attributes) - set(schema.attributes))
            if unknown:
                raise UpgradeError(
                    f"{_describe(node)} still has attribute {unknown[0]!r}, which {node.op_type}-"
                    f"{schema.since_version} does not take."
                )
            variadic = schema.inputs and schema.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
            if not variadic and len(node.inputs) > len(schema.inputs):
                raise UpgradeError(
                    f"{_describe(node)} has {len(node.inputs)} inputs; {node.op_type}-{schema.since_version} "
                    f"takes at most {len(schema.inputs)}."
                )


@dataclasses.dataclass
class UpgradeResult(ir.passes.PassResult):
    """The opset the model had (None: no default-domain import) and how many nodes were rewritten."""

    from_version: int | None = None
    rewritten: int = 0


class UpgradeOpsetPass(ir.passes.InPlacePass):
    """requires: nothing (any opset; a model already at the target is left alone); ensures: the
    default opset is the target, and every default-domain node fits its schema there.
    Results are returned per call (:class:`UpgradeResult`), not kept on the instance."""

    def __init__(self, target: int = TARGET_OPSET):
        super().__init__()
        self.target = target

    def call(self, model: ir.Model) -> UpgradeResult:
        current = default_opset(model)
        if current is not None and current >= self.target:
            return UpgradeResult(model, False, current)
        rewritten = 0
        if current is None:
            # A graph of custom-domain ops only: declaring the default domain is all it needs.
            model.opset_imports[""] = self.target
        else:
            rewritten = adapt(model, self.target)
            version_converter.convert_version(model, self.target)
        model.ir_version = max(model.ir_version or 0, MIN_IR_VERSION)
        logger.info("upgraded default opset %s -> %d (%d nodes rewritten)", current, self.target, rewritten)
        return UpgradeResult(model, True, current, rewritten)

    def ensures(self, model: ir.Model) -> None:
        if (default_opset(model) or 0) < self.target:
            raise ir.passes.PostconditionError(f"opset is still below {self.target} after the upgrade")
        try:
            check_schemas(model, self.target)
        except UpgradeError as exc:
            raise ir.passes.PostconditionError(str(exc)) from None
