"""Store embedding tables (Gather over a constant 2-D float tensor) as 8-bit float8 codes.

ONNX's Gather does not take float8 tensors, and no opset-21 op reinterprets uint8 bits as float8.
So the table is stored as the *codes* of its float8 values (uint8, one byte per entry, per-row
scales ``amax_row / fmax``), and decoded after the Gather with a 256-entry lookup table:

    rows = Gather(codes_u8, ids)                      # [..., D] uint8
    vals = Gather(lut, Cast(rows, int32))             # lut[c] = the float value of float8 code c
    y    = vals * Unsqueeze(Gather(scales, ids), -1)  # one scale per row

Only the gathered rows are decoded at run time; every op has CPU and CUDA kernels. The values are
exactly ``DequantizeLinear(QuantizeLinear(table, scale_row))`` (round to nearest even, saturating).
A tied table (TieEmbeddingsPass: the Gather reads the lm_head weight) shares the lm_head's float8
copy when the lm_head was quantized (``dequantized``: the Gather reads its DequantizeLinear), and
stays in float with it otherwise. A table that something other than a Gather also reads is left
alone, with the reason, as is a table with fewer than ``min_rows`` rows.
"""

from __future__ import annotations

import dataclasses
import logging

import ml_dtypes  # noqa: F401  (registers the float8 NumPy dtypes)
import numpy as np
import onnx_ir as ir

from ..numerics.formats import Fp8Format, quantize
from ..numerics.scaling import amax_to_scale
from .common import check_initializers, derived_tensor, initializer
from .known import constant, dim
from .known import dtype as dtype_of
from .known import name as name_of
from .known import shape as shape_of

__all__ = ["EmbeddingsResult", "QuantizeEmbeddingsPass"]

logger = logging.getLogger(__name__)
PREFIX = "fp8onnx/"


@dataclasses.dataclass
class EmbeddingsResult(ir.passes.PassResult):
    quantized: list[str] = dataclasses.field(default_factory=list)  # table names
    shared: list[str] = dataclasses.field(default_factory=list)  # tied tables now read through lm_head's copy
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # table name -> why


def _lut(fmt: Fp8Format, dtype: ir.DataType) -> np.ndarray:
    """The value of every float8 code of ``fmt``, in the table's float type (NaN codes stay NaN)."""
    return np.arange(256, dtype=np.uint8).view(fmt.np_dtype).astype(dtype.numpy())


def _tables(model: ir.Model, min_rows: int, dequantized: dict[str, ir.Value]):
    """(table value, its Gather nodes, why it stays as it is) for every constant 2-D float table
    read by a Gather; the Gathers are on axis 0 unless the table is in ``dequantized``."""
    seen: dict[str, ir.Value] = {}
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        table = node.inputs[0]
        if table is None or table.const_value is None or not table.is_initializer() or table.is_graph_input():
            continue
        if (
            table.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
            or len(shape_of(table)) != 2
        ):
            continue
        seen.setdefault(name_of(table), table)
    for table in seen.values():
        uses = [u.node for u in table.uses()]
        other = next((n for n in uses if n.op_type != "Gather" or n.graph is not model.graph), None)
        axes = {n.attributes.get_int("axis", 0) for n in uses}
        if other is not None:
            tied = " (a tied table: it stays in float with it)" if other.op_type in ("MatMul", "Gemm") else ""
            yield table, [], f"also read by {other.op_type} {other.name!r}{tied}"
        elif table.name in dequantized:
            yield table, uses, None
        elif axes != {0}:
            yield table, [], f"gathered along axis {sorted(axes)[-1]}, not 0"
        elif (rows := dim(table, 0)) < min_rows:
            yield table, [], f"{rows} rows, fewer than {min_rows}"
        else:
            yield table, uses, None


class QuantizeEmbeddingsPass(ir.passes.InPlacePass):
    """requires: opset >= 13 (Gather, Unsqueeze with axes input); ensures: every table it reports
    as quantized is read only through its uint8 codes (the float initializer is gone), so every
    constant a node reads is still an initializer."""

    def requires(self, model: ir.Model) -> None:
        if model.opset_imports.get("", 0) < 13:
            raise ir.passes.PreconditionError("embedding tables need opset >= 13 (Unsqueeze with an axes input)")

    def ensures(self, model: ir.Model) -> None:
        check_initializers(model)

    def __init__(
        self, fmt: Fp8Format = Fp8Format.E4M3FN, min_rows: int = 256, dequantized: dict[str, ir.Value] | None = None
    ):
        """``dequantized``: weight name -> the value its quantized readers now read (InsertQDQPass's
        result); a table listed there is shared, not stored a second time."""
        super().__init__()
        self.fmt, self.min_rows, self.dequantized = fmt, min_rows, dict(dequantized or {})

    def call(self, model: ir.Model) -> EmbeddingsResult:
        result = EmbeddingsResult(model, modified=False)
        graph = model.graph
        for table, gathers, why in list(_tables(model, self.min_rows, self.dequantized)):
            if why:
                logger.info("embedding table %r left in float: %s", table.name, why)
                result.skipped[table.name] = why
            elif table.name in self.dequantized:
                for gather in gathers:
                    gather.replace_input_with(0, self.dequantized[table.name])
                del graph.initializers[table.name]
                logger.info("tied embedding table %r reads its projection's float8 copy", table.name)
                result.shared.append(table.name)
            else:
                self._rewrite(graph, table, gathers)
                result.quantized.append(table.name)
        result.modified = bool(result.quantized or result.shared)
        if result.quantized:
            logger.info("stored %d embedding tables as %s codes", len(result.quantized), self.fmt.value)
        return result

    def _rewrite(self, graph: ir.Graph, table: ir.Value, gathers: list[ir.Node]) -> None:
        fmt, dtype, name = self.fmt, dtype_of(table), name_of(table)
        source = constant(table)
        amax = np.abs(source.numpy().astype(np.float32)).max(axis=1)
        scales = np.array(
            [amax_to_scale(float(a), fmt) if a > 0 else 1.0 for a in amax], dtype=dtype.numpy()
        )  # an all-zero row decodes to zeros with any scale
        scale32 = scales.astype(np.float32)[:, None]
        codes = initializer(
            graph,
            f"{PREFIX}{name}/{fmt.value}_codes",
            derived_tensor(
                source,
                lambda t: quantize(t.astype(np.float32), scale32, fmt).view(np.uint8),
                ir.DataType.UINT8,
                source.shape,
                f"{PREFIX}{name}/{fmt.value}_codes",
            ),
        )
        lut = initializer(graph, f"{PREFIX}{fmt.value}/lut/{dtype.name}", _lut(fmt, dtype))
        scale_table = initializer(graph, f"{PREFIX}{name}/row_scale", scales)
        last = initializer(graph, f"{PREFIX}const/axes_last", np.array([-1], np.int64))
        for k, gather in enumerate(gathers):
            _decode(graph, gather, codes, lut, scale_table, last, f"{PREFIX}{name}/gather{k}")
        del graph.initializers[name]


def _decode(graph, gather: ir.Node, codes, lut, scale_table, last, tag: str) -> None:
    """Replace ``gather`` (over the float table) by the gather of codes, the lookup and the row scale."""
    ids, out, dtype = gather.inputs[1], gather.outputs[0], lut.dtype
    tape = ir.tape.Tape()

    def op(op_type, inputs, suffix, out_dtype, **attrs):
        value = tape.op(op_type, inputs, attrs or None, name=f"{tag}/{suffix}")
        value.name, value.dtype = f"{tag}/{suffix}", out_dtype
        return value

    rows = op("Gather", [codes, ids], "codes", ir.DataType.UINT8, axis=0)
    index = op("Cast", [rows], "index", ir.DataType.INT32, to=int(ir.DataType.INT32))
    values = op("Gather", [lut, index], "values", dtype, axis=0)
    scale = op("Gather", [scale_table, ids], "scale", dtype, axis=0)
    decoded = op("Mul", [values, op("Unsqueeze", [scale, last], "scale_b", dtype)], "decoded", dtype)
    decoded.shape = out.shape
    graph.insert_before(gather, tape.nodes)
    name, is_output = out.name, out.is_graph_output()
    out.replace_all_uses_with(decoded, replace_graph_outputs=True)
    graph.remove(gather, safe=True)
    if is_output:  # the model's interface keeps its output names
        decoded.name = name
