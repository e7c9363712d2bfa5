"""Where onnxruntime will run each node of a model, predicted without running it.

A node runs on an execution provider when the provider registers a kernel for its (domain, op type,
opset version) whose type constraints admit the node's input and output types. Otherwise the CUDA EP
hands the node to the CPU EP (when the CPU EP has a kernel), and a node no provider has a kernel for
fails when the session is created ("Could not find an implementation for ..."). Some nodes are placed
and then fail at Run: a float8 DequantizeLinear/QuantizeLinear with ``block_size`` on the CUDA EP (its
block kernels are int4-only: "Unsupported quantization type").

The CPU EP's kernel table is onnxruntime's own (``get_all_opkernel_def()`` of the installed build). The
CUDA EP's is :data:`CUDA_KERNELS_FILE`, read from onnxruntime's source (see its ``source`` entry);
only a CUDA build carries that registry. Types come from the graph (values without a known type
match any constraint, and say so). Not modelled: the CUDA EP's choice to leave small shape
computations on the CPU (``GetCpuPreferredNodes``) and graph fusions made before placement.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib

import onnx_ir as ir

__all__ = ["CUDA_KERNELS_FILE", "NodePlacement", "no_cuda_kernel_in", "placement_summary", "predict_placement"]

CUDA_KERNELS_FILE = pathlib.Path(__file__).with_name("cuda_kernels.json")
_OPEN = 2**31 - 1
_HALF, _SINGLE = "tensor(float16)", "tensor(float)"
_FLOAT8 = {"tensor(float8e4m3fn)", "tensor(float8e5m2)", "tensor(float8e4m3fnuz)", "tensor(float8e5m2fnuz)"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    domain: str
    op: str
    since: int
    until: int
    constraints: tuple[tuple[str, frozenset[str]], ...] = ()  # type parameter -> the types it admits
    typed: str | None = None  # a typed registration: the type of the node's first input

    def admits(self, since: int, types: dict[str, set[str]], first: str | None) -> bool:
        """Whether a node whose schema dates from opset ``since`` (onnxruntime's KernelRegistry: the
        kernel's first version equals it, or a closed range covers it) with these types runs here."""
        if not (self.since == since or (self.until != _OPEN and self.since <= since <= self.until)):
            return False
        if self.typed is not None and first is not None and first != self.typed:
            return False
        return all(not types.get(p) or types[p] <= allowed for p, allowed in self.constraints)


@dataclasses.dataclass(frozen=True)
class NodePlacement:
    node: str
    op: str  # domain-qualified for non-ONNX domains
    where: str  # "cuda", "cpu", "initializer" (a Constant), "inlined" (a function), "fails at load" or "at run"
    why: str = ""


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


@functools.cache
def cpu_kernels() -> dict[tuple[str, str], list[Kernel]]:
    from onnxruntime.capi import _pybind_state as C

    table: dict[tuple[str, str], list[Kernel]] = collections.defaultdict(list)
    for k in C.get_all_opkernel_def():
        if k.provider != "CPUExecutionProvider":
            continue
        constraints = tuple((p, frozenset(types)) for p, types in sorted(k.type_constraints.items()))
        table[_domain(k.domain), k.op_name].append(Kernel(_domain(k.domain), k.op_name, *k.version_range, constraints))
    return dict(table)


@functools.cache
def cuda_kernels() -> tuple[dict[tuple[str, str], list[Kernel]], str]:
    """The CUDA EP's kernels from :data:`CUDA_KERNELS_FILE`, and where they were read."""
    doc = json.loads(CUDA_KERNELS_FILE.read_text(encoding="utf-8"))
    table: dict[tuple[str, str], list[Kernel]] = collections.defaultdict(list)
    for k in doc["kernels"]:
        constraints = tuple((p, frozenset(t)) for p, t in sorted((k.get("constraints") or {}).items()))
        kernel = Kernel(_domain(k["domain"]), k["op"], k["since"], k["until"] or _OPEN, constraints, k.get("type"))
        table[kernel.domain, kernel.op].append(kernel)
    return dict(table), doc["source"]


@functools.cache
def _schema(domain: str, op: str, version: int):
    """(input type params, output type params, the schema's since version) of the op at opset
    ``version``, or None for an op no schema describes."""
    import onnx

    try:
        schema = onnx.defs.get_schema(op, version, domain)
        return [i.type_str for i in schema.inputs], [o.type_str for o in schema.outputs], schema.since_version
    except Exception:  # not an ONNX op: onnxruntime's contrib schemas
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

        found = [s for s in get_all_operator_schema() if s.name == op and _domain(s.domain) == domain]
        older = [s for s in found if s.since_version <= version]
        if older or found:
            s = max(older or found, key=lambda s: s.since_version)
            return [i.typeStr for i in s.inputs], [o.typeStr for o in s.outputs], s.since_version
    return None


_NAMES = {"FLOAT": "float", "DOUBLE": "double", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "BOOL": "bool"}


def _tensor_type(value: ir.Value | None) -> str | None:
    if value is None or value.dtype is None:
        return None
    name = value.dtype.name
    return f"tensor({_NAMES.get(name, name.lower())})"


def _node_types(node: ir.Node, version: int) -> tuple[dict[str, set[str]], str | None, bool, int]:
    """(type parameter -> the node's types for it, its first input's type, whether any was unknown,
    the schema's since version)."""
    params = _schema(_domain(node.domain), node.op_type, version)
    first = _tensor_type(node.inputs[0]) if node.inputs else None
    if params is None:
        return {}, first, True, version
    ins, outs, since = params
    types: dict[str, set[str]] = collections.defaultdict(set)
    unknown = False
    for i, value in enumerate(node.inputs):
        if value is None or not ins:
            continue
        param = ins[min(i, len(ins) - 1)]  # a variadic last input repeats
        t = _tensor_type(value)
        if t is None:
            unknown = True
        else:
            types[param].add(t)
    for i, value in enumerate(node.outputs):
        if i < len(outs) and (t := _tensor_type(value)) is not None:
            types[outs[i]].add(t)
    return dict(types), first, unknown, since


def _version(model: ir.Model, node: ir.Node) -> int:
    domain = _domain(node.domain)
    return model.opset_imports.get(domain, model.opset_imports.get("ai.onnx", 1) if domain == "" else 1)


def _has(table, node: ir.Node, since: int, types, first) -> bool:
    return any(k.admits(since, types, first) for k in table.get((_domain(node.domain), node.op_type), ()))


def _fails_at_run_on_cuda(node: ir.Node, types: dict[str, set[str]]) -> str | None:
    if node.op_type in ("DequantizeLinear", "QuantizeLinear") and node.attributes.get_int("block_size", 0):
        if any(t & _FLOAT8 for t in types.values()):
            return "a float8 Q/DQ with block_size: the CUDA kernel implements blocks for int4 only"
    return None


def predict_placement(model: ir.Model, provider: str = "cuda") -> list[NodePlacement]:
    """Every node of the main graph and its subgraphs, where ``provider`` ("cuda" or "cpu") puts it."""
    cpu = cpu_kernels()
    cuda = cuda_kernels()[0] if provider == "cuda" else None
    out = []
    functions = {(_domain(f.domain), f.name) for f in model.functions.values()}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Constant" and _domain(node.domain) == "":
            out.append(NodePlacement(node.name, "Constant", "initializer", "onnxruntime makes it one at load"))
            continue
        if (_domain(node.domain), node.op_type) in functions:
            why = "a model-local function: onnxruntime inlines its body at load"
            out.append(NodePlacement(node.name, f"{node.domain}.{node.op_type}", "inlined", why))
            continue
        version = _version(model, node)
        types, first, unknown, since = _node_types(node, version)
        op = node.op_type if _domain(node.domain) == "" else f"{node.domain}.{node.op_type}"
        maybe = " (some types unknown)" if unknown else ""
        on_cpu, widened = _has(cpu, node, since, types, first), ""
        if not on_cpu and any(_HALF in t for t in types.values()):  # onnxruntime's InsertCastTransformer
            wide = {p: {_SINGLE if x == _HALF else x for x in t} for p, t in types.items()}
            on_cpu = _has(cpu, node, since, wide, _SINGLE if first == _HALF else first)
            widened = "float16 run in float32 (onnxruntime casts around it)" if on_cpu else ""
        if cuda is not None and _has(cuda, node, since, types, first):
            broken = _fails_at_run_on_cuda(node, types)
            out.append(NodePlacement(node.name, op, "fails at run" if broken else "cuda", (broken or "") + maybe))
        elif on_cpu:
            why = f"no CUDA kernel for opset {version}, {_describe(types)}" if cuda is not None else ""
            why = "; ".join(w for w in (why, widened) if w)
            out.append(NodePlacement(node.name, op, "cpu", why + maybe))
        else:
            why = f"no kernel for opset {version}, {_describe(types)}"
            out.append(NodePlacement(node.name, op, "fails at load", why))
    return out


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
    """Counts per place, and the nodes not on ``provider``, grouped by where, op and why."""
    counts = collections.Counter(p.where for p in placements)
    notable: dict[str, list[str]] = collections.defaultdict(list)
    for p in placements:
        if p.where not in (provider, "initializer", "inlined") or (p.why and p.where == "cpu" and provider == "cpu"):
            notable[f"{p.where}: {p.op}: {p.why}"].append(p.node)
    return {"counts": dict(counts), "not_on_the_provider": dict(notable)}
