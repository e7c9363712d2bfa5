"""Where onnxruntime will run each node of a model, predicted without running it.

A node runs on an execution provider when the provider registers a kernel for its (domain, op type,
opset version) whose type constraints admit the node's input and output types. Otherwise the CUDA EP
hands the node to the CPU EP (when the CPU EP has a kernel), and a node no provider has a kernel for
fails when the session is created ("Could not find an implementation for ..."). Some nodes are placed
and then fail at Run: a float8 DequantizeLinear/QuantizeLinear with ``block_size`` on the CUDA EP (its
block kernels are int4-only: "Unsupported quantization type").

The kernel tables are :mod:`fp8onnx.graph.kernels`' (the CPU EP's from the installed onnxruntime, the
CUDA EP's read from onnxruntime's source). Types come from the graph: its own value types, then onnx's
type and shape inference on a copy, then each op schema's type constraints (an output bound to the same
type parameter as a typed input has its type: what carries types through onnxruntime's contrib ops,
which onnx does not know). A node with an input whose type stays unknown is not placed ("not placed",
naming the inputs): a float8 tensor where the table expects float would otherwise match silently. Not
modelled: the CUDA EP's choice to leave small shape computations on the CPU (``GetCpuPreferredNodes``)
and graph fusions made before placement.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from fp8onnx.graph.kernels import CUDA_KERNELS_FILE, cpu_kernels, cuda_kernels, domain_of

__all__ = [
    "CUDA_KERNELS_FILE",
    "NOT_PLACED",
    "NodePlacement",
    "infer_types",
    "no_cuda_kernel_in",
    "placement_summary",
    "predict_placement",
]

logger = logging.getLogger(__name__)
NOT_PLACED = "not placed"  # a node with an input of unknown type
_HALF, _SINGLE = "tensor(float16)", "tensor(float)"
_FLOAT8 = {"tensor(float8e4m3fn)", "tensor(float8e5m2)", "tensor(float8e4m3fnuz)", "tensor(float8e5m2fnuz)"}
_domain = domain_of


@dataclasses.dataclass(frozen=True)
class NodePlacement:
    node: str | None  # None: the node has no name (inspect reads a model as it is)
    op: str  # domain-qualified for non-ONNX domains
    # "cuda", "cpu", "initializer" (a Constant), "inlined" (a function), "fails at load", "fails at run",
    # or NOT_PLACED (an input's type unknown)
    where: str
    why: str = ""


@functools.cache
def _ort_schemas() -> tuple:
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    return tuple(get_all_operator_schema())


@functools.cache
def _schema(domain: str, op: str, version: int):
    """(input type params, output type params, the schema's since version) of the op at opset
    ``version``, or None for an op no schema describes."""
    import onnx

    try:
        schema = onnx.defs.get_schema(op, version, domain)
        return [i.type_str for i in schema.inputs], [o.type_str for o in schema.outputs], schema.since_version
    except Exception:  # not an ONNX op: onnxruntime's contrib schemas
        found = [s for s in _ort_schemas() if s.name == op and _domain(s.domain) == domain]
        older = [s for s in found if s.since_version <= version]
        if older or found:
            s = max(older or found, key=lambda s: s.since_version)
            return [i.typeStr for i in s.inputs], [o.typeStr for o in s.outputs], s.since_version
    return None


_NAMES = {"FLOAT": "float", "DOUBLE": "double", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "BOOL": "bool"}
_DTYPES = {f"tensor({_NAMES.get(t.name, t.name.lower())})": t for t in ir.DataType if t != ir.DataType.UNDEFINED}


def _tensor_type(value: ir.Value | None) -> str | None:
    if value is None or value.dtype is None:
        return None
    name = value.dtype.name
    return f"tensor({_NAMES.get(name, name.lower())})"


def _node_types(node: ir.Node, version: int) -> tuple[dict[str, set[str]], str | None, list[str], int]:
    """(type parameter -> the node's types for it, its first input's type, the inputs whose type is
    unknown, the schema's since version)."""
    params = _schema(_domain(node.domain), node.op_type, version)
    first = _tensor_type(node.inputs[0]) if node.inputs else None
    unknown = [v.name or f"input {i}" for i, v in enumerate(node.inputs) if v is not None and v.dtype is None]
    if params is None:
        return {}, first, unknown, version
    ins, outs, since = params
    types: dict[str, set[str]] = collections.defaultdict(set)
    for i, value in enumerate(node.inputs):
        if value is not None and ins and (t := _tensor_type(value)) is not None:
            types[ins[min(i, len(ins) - 1)]].add(t)  # a variadic last input repeats
    for i, value in enumerate(node.outputs):
        if i < len(outs) and (t := _tensor_type(value)) is not None:
            types[outs[i]].add(t)
    return dict(types), first, unknown, since


def _version(model: ir.Model, node: ir.Node) -> int:
    domain = _domain(node.domain)
    return model.opset_imports.get(domain, model.opset_imports.get("ai.onnx", 1) if domain == "" else 1)


def infer_types(model: ir.Model) -> ir.Model:
    """A copy of ``model`` (weights shared) whose values carry every type that can be inferred: onnx's
    type and shape inference, then each op schema's type constraints (:func:`_schema_types`)."""
    model = model.clone()
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=False)(model)
    _schema_types(model)
    return model


def _schema_types(model: ir.Model) -> int:
    """Types onnx could not infer (onnxruntime's contrib ops): an output whose schema names a concrete type,
    or the type parameter of a typed input, gets that type. Returns how many values got one."""
    filled = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        params = _schema(_domain(node.domain), node.op_type, _version(model, node))
        if params is None or not any(v is not None and v.dtype is None for v in node.outputs):
            continue
        ins, outs, _ = params
        bound: dict[str, set[str]] = collections.defaultdict(set)
        for i, value in enumerate(node.inputs):
            if value is not None and ins and (t := _tensor_type(value)) is not None:
                bound[ins[min(i, len(ins) - 1)]].add(t)
        for i, value in enumerate(node.outputs):
            if value is None or value.dtype is not None or not outs:
                continue
            param = outs[min(i, len(outs) - 1)]
            known = {param} if param in _DTYPES else bound.get(param, set())
            if len(known) == 1 and (only := next(iter(known))) in _DTYPES:
                value.dtype, filled = _DTYPES[only], filled + 1
    return filled


def _has(table, node: ir.Node, since: int, types, first) -> bool:
    return any(k.admits(since, types, first) for k in table.get((_domain(node.domain), node.op_type), ()))


def _fails_at_run_on_cuda(node: ir.Node, types: dict[str, set[str]]) -> str | None:
    if node.op_type in ("DequantizeLinear", "QuantizeLinear") and node.attributes.get_int("block_size", 0) != 0:
        if any(t & _FLOAT8 for t in types.values()):
            return "a float8 Q/DQ with block_size: the CUDA kernel implements blocks for int4 only"
    return None


def predict_placement(model: ir.Model, provider: str = "cuda") -> list[NodePlacement]:
    """Every node of the main graph and its subgraphs, where ``provider`` ("cuda" or "cpu") puts it, on
    the types :func:`infer_types` finds (the model itself is not changed)."""
    cpu = cpu_kernels()[0]
    cuda = cuda_kernels()[0] if provider == "cuda" else None
    model = infer_types(model)
    out = []
    functions = {(_domain(f.domain), f.name) for f in model.functions.values()}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Constant" and _domain(node.domain) == "":
            out.append(NodePlacement(node.name, "Constant", "initializer", "onnxruntime makes it one at load"))
        elif (_domain(node.domain), node.op_type) in functions:
            why = "a model-local function: onnxruntime inlines its body at load"
            out.append(NodePlacement(node.name, f"{node.domain}.{node.op_type}", "inlined", why))
        else:
            out.append(_place(model, node, cpu, cuda))
    unplaced = [p.node or p.op for p in out if p.where == NOT_PLACED]  # an unnamed node by its op
    if unplaced:
        logger.info("%d nodes not placed, an input's type unknown: %s", len(unplaced), ", ".join(unplaced[:5]))
    return out


def _place(model: ir.Model, node: ir.Node, cpu, cuda) -> NodePlacement:
    version = _version(model, node)
    types, first, unknown, since = _node_types(node, version)
    op = node.op_type if _domain(node.domain) == "" else f"{node.domain}.{node.op_type}"
    on_cpu, widened = _has(cpu, node, since, types, first), ""
    if not on_cpu and any(_HALF in t for t in types.values()):  # onnxruntime's InsertCastTransformer
        wide = {p: {_SINGLE if x == _HALF else x for x in t} for p, t in types.items()}
        on_cpu = _has(cpu, node, since, wide, _SINGLE if first == _HALF else first)
        widened = "float16 run in float32 (onnxruntime casts around it)" if on_cpu else ""
    on_cuda = cuda is not None and _has(cuda, node, since, types, first)
    if unknown and (on_cuda or on_cpu):  # a kernel for some types: which one runs depends on the unknown ones
        named = ", ".join(repr(n) for n in unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        where = "cuda" if on_cuda else "cpu"
        why = f"the type of {named} is unknown after type inference (with a type it admits: {where})"
        return NodePlacement(node.name, op, NOT_PLACED, why)
    if on_cuda:
        broken = _fails_at_run_on_cuda(node, types)
        return NodePlacement(node.name, op, "fails at run" if broken else "cuda", broken or "")
    if on_cpu:
        why = f"no CUDA kernel for opset {version}, {_describe(types)}" if cuda is not None else ""
        return NodePlacement(node.name, op, "cpu", "; ".join(w for w in (why, widened) if w))
    return NodePlacement(node.name, op, "fails at load", f"no kernel for opset {version}, {_describe(types)}")


def no_cuda_kernel_in(model: ir.Model, dtype: ir.DataType) -> list[str]:
    """Names of the nodes of a float32 model (main graph and subgraphs; unnamed ones are skipped) that
    compute in float32 and for which the CUDA EP has no kernel once their float32 tensors are ``dtype``:
    the nodes a conversion to ``dtype`` must leave in float32."""
    table, wanted = cuda_kernels()[0], _tensor_type(ir.Value(type=ir.TensorType(dtype)))
    names = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if not node.name or (node.op_type == "Constant" and _domain(node.domain) == ""):
            continue
        types, first, _, since = _node_types(node, _version(model, node))
        if not any(_SINGLE in t for t in types.values()):
            continue
        narrow = {p: {wanted if x == _SINGLE else x for x in t} for p, t in types.items()}
        if not _has(table, node, since, narrow, wanted if first == _SINGLE else first):
            names.append(node.name)
    return names


def _describe(types: dict[str, set[str]]) -> str:
    return ", ".join(f"{p}={'/'.join(sorted(t))}" for p, t in sorted(types.items())) or "types unknown"


def placement_summary(placements: list[NodePlacement], provider: str = "cuda") -> dict:
    """Counts per place, and the nodes not on ``provider``, grouped by where, op and why; the nodes not
    placed (an input's type unknown) first, and named in ``not_placed``."""
    counts = collections.Counter(p.where for p in placements)
    notable: dict[str, list[str | None]] = collections.defaultdict(list)
    ordered = sorted(placements, key=lambda p: p.where != NOT_PLACED)  # stable: graph order within each
    for p in ordered:
        if p.where not in (provider, "initializer", "inlined") or (p.why and p.where == "cpu" and provider == "cpu"):
            notable[f"{p.where}: {p.op}: {p.why}"].append(p.node)
    unplaced = [p.node for p in placements if p.where == NOT_PLACED]
    return {"counts": dict(counts), "not_on_the_provider": dict(notable), "not_placed": unplaced}
