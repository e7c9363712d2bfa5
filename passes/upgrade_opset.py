"""Upgrade the default-domain opset to the one fp8onnx emits (21), computing what the original computed.

Why 21 and not 19 (where float8 QuantizeLinear first appeared): from opset 21 QuantizeLinear takes
an ``output_dtype`` attribute, so a float8 Q needs no zero-point input. onnxruntime's
ReluQuantRewrite (on at its default optimisation level) deletes a Relu feeding a QuantizeLinear
*with* a zero point, letting negative values through for float8 types; without one it leaves the
Relu alone. Models already at 21 or above are left as they are.

onnxscript's version converter (0.7) only relabels nodes, except for DFT, GridSample and
GroupNormalization: an attribute that became an input stays an attribute, and onnxruntime then
refuses the model ("Unrecognized attribute: axes for operator ReduceMean"). So every default-domain
op whose signature or semantics changed between opsets 6 and 21 has an adapter here (from the ONNX
operator changelog; each is tested by running the old and the upgraded graph on onnxruntime):

  since  op                                  rewrite
  7      Gemm, Add, Sub, Mul, Div, Pow, And,  ``broadcast``/``axis`` dropped (numpy broadcasting); a B aligned
         Or, Xor, Equal, Greater, Less       at ``axis`` gets trailing ones (Reshape)
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
GridSample-20 mode names, GroupNormalization-21 per-channel scale). Where no node needs one of those
three, :func:`relabel` does the same steps with onnx_ir's passes alone (inline, relabel, remove what is
unused) and onnxscript is not imported (0.15-0.4 s of a run's start-up). onnx's own C++ converter is not
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

import onnx
import onnx_ir as ir

from .opset_adapters import ADAPTERS, MIN_IR_VERSION, TARGET_OPSET, UpgradeError, default_opset, describe

__all__ = [
    "TARGET_OPSET",
    "UpgradeError",
    "UpgradeOpsetPass",
    "UpgradeResult",
    "check_schemas",
    "default_opset",
    "relabel",
]

logger = logging.getLogger(__name__)


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


# The nodes onnxscript's version converter rewrites (op -> the first opset of the new form); every other
# node it only relabels.
_CONVERTER_ADAPTERS = {"DFT": 20, "GridSample": 20, "GroupNormalization": 21}


def relabel(model: ir.Model, target: int = TARGET_OPSET) -> None:
    """onnxscript's ``convert_version(model, target)`` (0.7: inline the model's functions, drop unused
    functions and opsets, relabel every default-domain node, run its adapters, drop unused nodes), with
    onnx_ir's passes alone where none of its adapters applies; else onnxscript's converter itself."""
    common = ir.passes.common
    ir.passes.Sequential(common.InlinePass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass())(
        model
    )
    current = model.opset_imports.get("")
    if current != target:
        nodes = [n for graph, _ in _graphs(model) for n in graph if n.domain == ""]
        if any(
            (n.version or current or target) < _CONVERTER_ADAPTERS.get(n.op_type, 0) <= target for n in nodes
        ) or any(attr.is_ref() for n in nodes for attr in n.attributes.values()):
            import onnxscript.version_converter  # 0.15-0.4 s to import: only where needed

            onnxscript.version_converter.convert_version(model, target)
            return
        for node in nodes:
            node.version = target
        for function in model.functions.values():
            function.opset_imports[""] = target
        model.opset_imports[""] = target
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass()
    )(model)


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
                raise UpgradeError(f"{describe(node)} is deprecated at opset {target} and was not converted.")
            unknown = sorted(set(node.attributes) - set(schema.attributes))
            if unknown:
                raise UpgradeError(
                    f"{describe(node)} still has attribute {unknown[0]!r}, which {node.op_type}-"
                    f"{schema.since_version} does not take."
                )
            variadic = schema.inputs and schema.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
            if not variadic and len(node.inputs) > len(schema.inputs):
                raise UpgradeError(
                    f"{describe(node)} has {len(node.inputs)} inputs; {node.op_type}-{schema.since_version} "
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
            relabel(model, self.target)
        model.ir_version = max(model.ir_version or 0, MIN_IR_VERSION)
        logger.info("upgraded default opset %s -> %d (%d nodes rewritten)", current, self.target, rewritten)
        return UpgradeResult(model, True, current, rewritten)

    def ensures(self, model: ir.Model) -> None:
        if (default_opset(model) or 0) < self.target:
            raise ir.passes.PostconditionError(f"opset is still below {self.target} after the upgrade")
        try:
            check_schemas(model, self.target)
        except UpgradeError as exc:
            raise ir.passes.PostconditionError(str(exc)) from exc
