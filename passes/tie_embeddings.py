"""Store a tied embedding table once: the input embedding reads the output projection's weight.

Exporters write a language model's tied ``embed_tokens`` / ``lm_head`` weight twice: once as the
Gather table ``E`` [V, D] and once as the projection's weight, either transposed for a MatMul
(``W = E^T`` [D, V]: TorchScript writes the copy, and FoldWeightTransformsPass folds dynamo's
``Transpose(E)`` into one) or as a second copy for ``Gemm(transB=1)``. This pass finds each
projection weight equal, value for value, to a Gather table and drops the table:

    Gather(E, ids)            ->  Transpose(Gather(W, ids, axis=1), perm=[1, ..., r, 0])   (MatMul)
    Gemm(x, E', transB=1)     ->  Gemm(x, E, transB=1)                                     (Gemm)

The rewrite is exact (the same numbers reach every consumer, same output names). Downstream the
weight has two readers; QuantizeEmbeddingsPass then shares its float8 copy with the Gather, or
leaves it in float when the projection stays in float.
"""

from __future__ import annotations

import logging
from typing import TypeGuard

import numpy as np
import onnx_ir as ir

from .common import check_initializers, release
from .known import constant, required_input
from .known import dtype as dtype_of
from .known import name as name_of
from .known import shape as shape_of

__all__ = ["TieEmbeddingsPass"]

logger = logging.getLogger(__name__)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _constant(value: ir.Value | None) -> TypeGuard[ir.Value]:
    return (
        value is not None
        and value.const_value is not None
        and value.is_initializer()
        and not value.is_graph_input()
        and not value.is_graph_output()
        and value.dtype in _FLOATS
        and value.shape is not None
        and len(value.shape) == 2
    )


def _gather_tables(graph: ir.Graph) -> dict[str, ir.Value]:
    """Tables read only by Gathers on axis 0 of the main graph, by name."""
    tables: dict[str, ir.Value] = {}
    for node in graph:
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and _constant(table := node.inputs[0]):
            readers = [u.node for u in table.uses()]
            if all(
                n.op_type == "Gather" and n.attributes.get_int("axis", 0) == 0 and n.graph is graph for n in readers
            ):
                tables[name_of(table)] = table
    return tables


def _equal(a: ir.Value, b: ir.Value, transposed: bool) -> bool:
    x, y = constant(a).numpy(), constant(b).numpy()
    same = x.dtype == y.dtype and np.array_equal(x, y.T if transposed else y)
    del x, y
    release(a.const_value)  # memory-mapped weights leave resident memory again
    release(b.const_value)
    return same


class TieEmbeddingsPass(ir.passes.InPlacePass):
    """requires: nothing; ensures: no MatMul/Gemm weight equals a Gather table it could share (the
    model computes exactly what it computed; only the duplicate initializer is gone). Checked after
    each run: every constant a node reads is still an initializer (comparing the tables again would
    read every weight twice)."""

    def ensures(self, model: ir.Model) -> None:
        check_initializers(model)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        tables = _gather_tables(graph)
        tied = 0
        for node in list(graph):
            if not tables:
                break
            if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                continue
            weight = node.inputs[1]
            if not _constant(weight) or weight.name in tables:
                continue
            transposed = node.op_type == "MatMul" or not node.attributes.get_int("transB", 0)
            rows, cols = (int(d) if isinstance(d, int) else -1 for d in shape_of(weight))
            for name, table in list(tables.items()):
                v, d = (int(x) if isinstance(x, int) else -2 for x in shape_of(table))
                shape = (cols, rows) if transposed else (rows, cols)
                if shape != (v, d):
                    continue
                if not _equal(table, weight, transposed):
                    continue
                if transposed and not self._read_transposed(graph, table, weight):
                    continue
                if not transposed:
                    for use in list(weight.uses()):
                        use.node.replace_input_with(use.idx, table)
                del graph.initializers[name_of(weight if not transposed else table)]
                del tables[name]
                tied += 1
                logger.info("tied embedding table %r stored once (it equals %s's weight)", name, node.name)
                break
        return ir.passes.PassResult(model, modified=bool(tied))

    @staticmethod
    def _read_transposed(graph: ir.Graph, table: ir.Value, weight: ir.Value) -> bool:
        """Every Gather of ``table`` rewritten to gather columns of ``weight``; False (nothing changed)
        when the rank of some Gather's indices is unknown."""
        gathers = [u.node for u in table.uses()]
        ranks = [len(s) if (s := required_input(g, 1).shape) is not None else None for g in gathers]
        known_ranks = [r for r in ranks if r is not None]
        if len(known_ranks) != len(ranks):
            logger.info("tied table %r left as it is: the rank of its Gather indices is unknown", table.name)
            return False
        for gather, rank in zip(gathers, known_ranks):
            ids, out = gather.inputs[1], gather.outputs[0]
            tape = ir.tape.Tape()
            columns = tape.op("Gather", [weight, ids], {"axis": 1}, name=f"{gather.name}/tied")
            columns.name, columns.dtype = f"{out.name}/tied_columns", dtype_of(weight)
            new = tape.op("Transpose", [columns], {"perm": [*range(1, rank + 1), 0]}, name=f"{gather.name}/tied_rows")
            new.dtype, new.shape = out.dtype or dtype_of(weight), out.shape
            graph.insert_before(gather, tape.nodes)
            name = out.name
            out.replace_all_uses_with(new, replace_graph_outputs=True)
            graph.remove(gather, safe=True)
            new.name = name  # statistics and reports refer to tensors by name
        return True
