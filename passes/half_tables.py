"""Store large float tables that stay in float in 16 bits, read back through one Cast.

A recipe that keeps a vocabulary projection in float (``--float-vocab``: the lm_head, and with it a
tied embedding table) leaves the largest tensor of a small LLM in its exported float32: Gemma 3
270M's tied 262,144 x 640 table is 62% of its weights, so its FP8 file stayed at 0.45x. This pass
stores each named float32 table as float16 (bfloat16 where a value is beyond float16's range) and
puts one Cast back to float32 before its readers, under the table's own name:

    W (float32 [D, V], read by MatMul and Gather)  ->  W = Cast(W16, to=FLOAT)

Every reader sees the same name, type and shape; the values are the table rounded to 16 bits
(relative error at most 2^-11 in float16, 2^-8 in bfloat16: far below float8's 2^-4). onnxruntime
folds the Cast into a float32 initializer when it makes a session (its default optimisation), so
the session computes as it did, at the same memory; the file holds half the bytes. Without graph
optimisation the Cast runs once per inference.
"""

from __future__ import annotations

import dataclasses
import logging

import ml_dtypes
import numpy as np
import onnx_ir as ir

from .common import check_initializers, derived_tensor, initializer, insert_at_definition, release
from .known import constant
from .known import dtype as dtype_of
from .known import name as name_of

__all__ = ["FLOAT16_MAX", "HalfTablesPass", "HalfTablesResult"]

logger = logging.getLogger(__name__)
PREFIX = "fp8onnx/"
FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclasses.dataclass
class HalfTablesResult(ir.passes.PassResult):
    stored: dict[str, str] = dataclasses.field(default_factory=dict)  # table name -> "float16" / "bfloat16"
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # table name -> why it stays as it is


def _why_not(graph: ir.Graph, name: str) -> str | None:
    value = graph.initializers.get(name)
    if value is None or value.const_value is None:
        return "not an initializer of the main graph"
    if value.is_graph_input() or value.is_graph_output():
        return "a graph input or output (its type is part of the interface)"
    if value.dtype != ir.DataType.FLOAT:
        return f"stored as {dtype_of(value).name}, not float32"
    return None


class HalfTablesPass(ir.passes.InPlacePass):
    """requires: opset >= 13 (Cast from bfloat16); ensures: each table it reports as stored is the
    output of a Cast to float32 of a 16-bit initializer (same name, type and shape for its readers),
    and every other constant a node reads is still an initializer."""

    def __init__(self, names):
        """``names``: the float32 initializers of the main graph to store in 16 bits."""
        super().__init__()
        self.names = list(dict.fromkeys(names))

    def requires(self, model: ir.Model) -> None:
        if model.opset_imports.get("", 0) < 13:
            raise ir.passes.PreconditionError("16-bit tables need opset >= 13 (Cast from bfloat16)")

    def ensures(self, model: ir.Model) -> None:
        check_initializers(model)
        for name in self.stored:
            producer = next((n for n in model.graph if name in {o.name for o in n.outputs}), None)
            if producer is None or producer.op_type != "Cast" or producer.outputs[0].dtype != ir.DataType.FLOAT:
                raise ir.passes.PostconditionError(f"table {name!r} is not read through a Cast to float32")

    def call(self, model: ir.Model) -> HalfTablesResult:
        result = HalfTablesResult(model, modified=False)
        self.stored = result.stored
        graph = model.graph
        for name in self.names:
            why = _why_not(graph, name)
            if why:
                result.skipped[name] = why
                logger.info("table %r stays as it is: %s", name, why)
                continue
            result.stored[name] = self._store(graph, graph.initializers[name])
        result.modified = bool(result.stored)
        if result.stored:
            logger.info("stored %d float tables in 16 bits", len(result.stored))
        return result

    def _store(self, graph: ir.Graph, table: ir.Value) -> str:
        source = constant(table)
        wide = bool(np.abs(source.numpy()).max(initial=0.0) > FLOAT16_MAX)
        release(source)
        dtype = ir.DataType.BFLOAT16 if wide else ir.DataType.FLOAT16
        np_dtype = ml_dtypes.bfloat16 if wide else np.float16
        name, shape = name_of(table), table.shape
        stored_name = f"{PREFIX}{name}/{dtype.name.lower()}"
        narrow = initializer(
            graph,
            stored_name,
            derived_tensor(source, lambda t: t.astype(np_dtype), dtype, source.shape, stored_name),
        )
        del graph.initializers[name]
        tape = ir.tape.Tape()
        out = tape.op("Cast", [narrow], {"to": int(ir.DataType.FLOAT)}, name=f"{PREFIX}{name}/cast")
        out.dtype, out.shape = ir.DataType.FLOAT, shape
        table.replace_all_uses_with(out)
        insert_at_definition(narrow, tape.nodes)
        out.name = name  # the readers keep reading the table's name
        logger.info("table %r stored as %s", name, dtype.name.lower())
        return "bfloat16" if wide else "float16"
