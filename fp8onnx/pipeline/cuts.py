"""Where a model is cut for a layer-by-layer run: segments of at most a budget of weights, in an order that
keeps each constant computation (a weight's DequantizeLinear) beside its reader (:mod:`fp8onnx.pipeline.segments`
runs them)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import onnx_ir as ir

from fp8onnx.graph import known

__all__ = ["FEED_BYTES", "Segment", "held_bytes", "split"]

logger = logging.getLogger(__name__)
# Initializers this big or bigger are fed at run time (memory-mapped) rather than copied into a session.
FEED_BYTES = 1 << 20
# NumPy arrays of these types go into onnxruntime as they are; others (bfloat16, float8) are copied in.
_FEEDABLE = {
    ir.DataType.FLOAT,
    ir.DataType.FLOAT16,
    ir.DataType.DOUBLE,
    ir.DataType.INT8,
    ir.DataType.UINT8,
    ir.DataType.INT32,
    ir.DataType.INT64,
}


@dataclasses.dataclass
class Segment:
    nodes: list[ir.Node]
    inputs: list[ir.Value] = dataclasses.field(default_factory=list)  # graph inputs or earlier segments' outputs
    weights: list[ir.Value] = dataclasses.field(default_factory=list)  # large initializers, fed at run time
    constants: list[ir.Value] = dataclasses.field(default_factory=list)  # small initializers, inside the session
    outputs: list[ir.Value] = dataclasses.field(default_factory=list)  # read later, or asked for
    later: set[str] = dataclasses.field(default_factory=set)  # names of the outputs later segments read

    @property
    def nbytes(self) -> int:
        """The weights' bytes as the segment's session holds them (a dequantized weight at its float size)."""
        return sum(held_bytes(v) for v in (*self.weights, *self.constants))


def held_bytes(value: ir.Value) -> int:
    """Bytes an initializer takes in a session: a weight read only by DequantizeLinear at its output's size
    (onnxruntime folds the constant dequantization at load: a float8 weight holds 4 bytes an element in a
    float32 graph, not 1); any other at its own."""
    tensor = known.constant(value)
    uses = list(value.uses())
    if not uses or any(u.node.op_type != "DequantizeLinear" or u.idx != 0 for u in uses):
        return tensor.nbytes
    dq = uses[0].node
    out = dq.outputs[0].dtype or (dq.inputs[1].dtype if len(dq.inputs) > 1 and dq.inputs[1] is not None else None)
    return max(tensor.nbytes, int(tensor.size * (out.itemsize if out is not None else 4)))


def _is_fed(value: ir.Value) -> bool:
    tensor = value.const_value
    return tensor is not None and tensor.nbytes >= FEED_BYTES and tensor.dtype in _FEEDABLE


def _reads(node: ir.Node, defined: set[int]) -> list[ir.Value]:
    """Main-graph values ``node`` reads: its inputs and what its If/Loop/Scan bodies capture."""
    values = [v for v in node.inputs if v is not None]
    for attr in node.attributes.values():
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            graphs = attr.value if attr.type == ir.AttributeType.GRAPHS else [attr.value]
            for sub in graphs:
                for inner in ir.traversal.RecursiveGraphIterator(sub):
                    values += [v for v in inner.inputs if v is not None and id(v) in defined]
    return list({id(v): v for v in values}.values())


def split(graph: ir.Graph, budget: int, wanted: Iterable[str], sequential=None) -> list[Segment]:
    """Cut ``graph``'s nodes, in order, into segments reading at most ``budget`` bytes of
    initializers each (a single node that needs more gets a segment of its own). ``wanted``: names of
    values every segment computing them must return.

    ``sequential``: (ids of the quantized layers, ids of the nodes that must read quantized layers'
    results): a cut also falls before such a node when it reads a value computed, in the current
    segment, downstream of a quantized layer; so each quantized layer's inputs and statistics come
    from segments that have already run (and been rounded, :func:`run_segmented`'s ``settle``)."""
    graph.sort()
    layers, sensitive = sequential or (set(), set())
    tainted: set[int] = set()  # values computed downstream of a quantized layer in the current segment
    wanted = set(wanted)
    defined = {id(v) for v in (*graph.inputs, *graph.initializers.values())}
    defined |= {id(out) for node in graph for out in node.outputs}
    reads = {id(node): _reads(node, defined) for node in graph}
    segments: list[Segment] = []
    current: list[ir.Node] = []
    held: dict[int, int] = {}  # id(weight) -> bytes, for the current segment
    pending: list[ir.Node] = []  # constant computations (a weight's DequantizeLinear), cut with their reader
    for node in _constants_at_first_use(graph, reads):
        made = {id(out) for n in pending for out in n.outputs}
        if all(v.is_initializer() or id(v) in made for v in reads[id(node)]) and node.outputs:
            pending.append(node)
            continue
        unit, pending = [*pending, node], []
        new = {
            id(v): held_bytes(v) for n in unit for v in reads[id(n)] if v.is_initializer() and v.const_value is not None
        }
        extra = sum(b for k, b in new.items() if k not in held)
        reads_tainted = any(id(v) in tainted for v in reads[id(node)])
        if current and (sum(held.values()) + extra > budget or (id(node) in sensitive and reads_tainted)):
            segments.append(Segment(current))
            current, held, tainted, reads_tainted = [], {}, set(), False
        current += unit
        held.update(new)
        if id(node) in layers or reads_tainted:
            tainted.update(id(out) for out in node.outputs)
    current += pending  # constants that only graph outputs read
    if current:
        segments.append(Segment(current))

    last_read: dict[int, int] = {}  # id(value) -> index of the last segment reading it
    for i, seg in enumerate(segments):
        for node in seg.nodes:
            for v in reads[id(node)]:
                last_read[id(v)] = i
    for i, seg in enumerate(segments):
        produced = {id(out) for node in seg.nodes for out in node.outputs}
        seen: dict[int, ir.Value] = {}
        for node in seg.nodes:
            for v in reads[id(node)]:
                if id(v) in produced or id(v) in seen:
                    continue
                seen[id(v)] = v
                if v.is_initializer() and v.const_value is not None and not v.is_graph_input():
                    (seg.weights if _is_fed(v) else seg.constants).append(v)
                else:
                    seg.inputs.append(v)
        seg.later = {known.name(out) for node in seg.nodes for out in node.outputs if last_read.get(id(out), -1) > i}
        seg.outputs = [out for node in seg.nodes for out in node.outputs if out.name in wanted or out.name in seg.later]
    over = [s for s in segments if s.nbytes > budget]
    if over:
        logger.info(
            "%d nodes alone read more weights than the budget (largest %.1f MB)",
            len(over),
            max(s.nbytes for s in over) / 1e6,
        )
    return segments


def _constants_at_first_use(graph: ir.Graph, reads: dict[int, list[ir.Value]]) -> list[ir.Node]:
    """``graph``'s nodes in order, but each node that computes from initializers alone (a weight's
    DequantizeLinear, which passes put first in the graph) moved to just before its first reader: so it
    runs in the segment that reads it, holding its weight there, rather than in the first segment, whose
    dequantized outputs would otherwise cross every cut for every batch (a quantized Qwen2.5 0.5B spilled
    its float weights once per batch and filled the disk)."""
    constant: set[int] = set()
    for node in graph:
        if all(
            v.is_initializer() or (v.producer() is not None and id(v.producer()) in constant) for v in reads[id(node)]
        ):
            if not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
                constant.add(id(node))
    order: list[ir.Node] = []
    placed: set[int] = set()

    def place(node: ir.Node) -> None:
        for v in reads[id(node)]:
            producer = v.producer()
            if producer is not None and id(producer) in constant and id(producer) not in placed:
                place(producer)
        placed.add(id(node))
        order.append(node)

    for node in graph:
        if id(node) not in constant:
            place(node)
    for node in graph:  # constants that only graph outputs read, at the end
        if id(node) not in placed:
            place(node)
    return order
