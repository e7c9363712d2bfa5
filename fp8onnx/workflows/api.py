"""The smaller commands of the Python API: calibrate, convert_fp16, inspect."""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.data.datasource import Data
from fp8onnx.graph import known
from fp8onnx.graph.guard import as_path, check_paths, model_reads, model_writes
from fp8onnx.graph.model_io import EXTERNAL_META, load_model, save_model
from fp8onnx.graph.placement import placement_summary, predict_placement
from fp8onnx.graph.plan import candidate_activations, vocabulary_projections
from fp8onnx.graph.prepare import prepare_model
from fp8onnx.graph.run_settings import RunOptions, resolve_provider
from fp8onnx.numerics.formats import EMULATED_NOTE, format_of
from fp8onnx.passes import BLOCK_FP8_OP, ConvertFloat16Pass
from fp8onnx.pipeline.calibration import Stats, collect_amax
from fp8onnx.settings.report import describe_config
from fp8onnx.settings.targets import check_tensorrt

__all__ = ["calibrate", "convert_fp16", "inspect"]

logger = logging.getLogger(__name__)


def calibrate(
    model: str | os.PathLike,
    calib: Data,
    output: str | os.PathLike | None = None,
    *,
    precision: str = "model",
    run: RunOptions | None = None,
    **run_options,
) -> Stats:
    """Absolute maxima and |x| histograms of every float activation input of every MatMul/Gemm,
    saved to ``output`` when given. ``run`` (or RunOptions fields as keywords) says how
    onnxruntime runs."""
    run = RunOptions.of(run, **run_options)
    reads = model_reads("the input model", model)
    check_paths(
        reads + [("the calibration data", as_path(calib))],
        [("the statistics file", output)],
    )
    run = RunOptions.of(run, provider=resolve_provider(run.provider))
    ir_model, _, _ = prepare_model(model, precision)
    names = candidate_activations(ir_model)
    if not names:
        raise Fp8OnnxError(f"Model {str(model)!r} has no MatMul/Gemm activation to calibrate.")
    # Histograms too, so that one statistics file serves every --scaling method.
    stats = collect_amax(ir_model, names, calib, histograms=True, run=run)
    if output is not None:
        stats.save(output)
    return stats


def convert_fp16(model: str | os.PathLike, output: str | os.PathLike) -> pathlib.Path:
    """Write the FP16 baseline of ``model`` (inputs and outputs stay as they were)."""
    check_paths(model_reads("the input model", model), model_writes("the output model", output))
    out = pathlib.Path(output)
    source = load_model(model)
    converted = ConvertFloat16Pass()(source).model
    return save_model(converted, out, what="FP16 model", external_data=source.meta[EXTERNAL_META])


def inspect(model: str | os.PathLike, target: str | None = None) -> dict:
    """What is quantized in ``model``: float8 tensors with their scales, node counts and sizes; with
    ``target`` ("onnxruntime": the CPU EP, or "onnxruntime-cuda"), where each node will run
    (:func:`fp8onnx.graph.placement.predict_placement`)."""
    m = load_model(model)
    graph = m.graph
    tensors = _fast_form_weights(m) + _dequantized_tensors(graph)
    ops = collections.Counter(n.op_type for n in ir.traversal.RecursiveGraphIterator(graph))
    fast = [n for n in ir.traversal.RecursiveGraphIterator(graph) if n.op_type == BLOCK_FP8_OP]
    matmuls = [n for n in ir.traversal.RecursiveGraphIterator(graph) if n.op_type in ("MatMul", "Gemm")] + fast
    quantized = [n for n in matmuls if n in fast or any(v is not None and _dequantized(v) for v in n.inputs[:2])]
    fed = len(quantized)
    by_type: dict[str, int] = collections.defaultdict(int)
    for v in graph.initializers.values():
        if v.const_value is not None:
            by_type[str(v.const_value.dtype)] += v.const_value.nbytes
    meta = m.metadata_props.get("fp8onnx")

    placement = None
    if target is not None:
        provider = {"onnxruntime": "cpu", "onnxruntime-cuda": "cuda"}.get(target)
        if provider is None:
            raise Fp8OnnxError(f"inspect --target takes onnxruntime or onnxruntime-cuda, not {target!r}.")
        placement = {"target": target, **placement_summary(predict_placement(m, provider), provider)}
    return {
        "model": str(model),
        "opset": m.opset_imports.get(""),
        "placement": placement,
        "matmul_gemm_nodes": len(matmuls),
        "quantized_nodes": fed,
        "float8_tensors": tensors,
        "weight_bytes_by_type": dict(by_type),
        "op_counts": dict(ops),
        "fp8onnx": json.loads(meta) if meta else None,
        "tensorrt_problems": check_tensorrt(m),
        # node -> why FP8 is risky there: in a quantized model only nodes that read float8 (not those
        # kept in float), in a float one every candidate (advice before quantizing)
        "high_risk": vocabulary_projections(m, quantized if tensors else matmuls),
    }


def _dequantized_tensors(graph: ir.Graph) -> list[dict]:
    """Every float8 tensor a DequantizeLinear reads: its name (the dequantized output's), kind, format,
    scale, granularity, shape and consumers."""
    tensors = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "DequantizeLinear" or node.inputs[0] is None:
            continue
        src = node.inputs[0]
        found = format_of(src.dtype)
        if found is None:
            continue
        fmt = found.value
        scale = (
            node.inputs[1].const_value.numpy()
            if node.inputs[1] is not None and node.inputs[1].const_value is not None
            else None
        )
        kind = "weight" if src.const_value is not None else "activation"
        out, granularity = node.outputs[0], _granularity(node, scale)
        if known.name(out).endswith("/block_rows") and src.shape is not None:  # the per-axis form of block scales
            out, axis = _layout_ops_after(out)
            granularity = f"block {src.shape[1]} along axis {axis} (per-axis form, for the CUDA EP)" + (
                granularity[granularity.index(",") :] if "," in granularity else ""
            )
        tensors.append(
            {
                "name": out.name,
                "kind": kind,
                "format": fmt,
                "scale": None if scale is None else (float(scale) if scale.size == 1 else scale.tolist()),
                "granularity": granularity,
                "shape": None if src.shape is None else [d if isinstance(d, int) else str(d) for d in src.shape],
                "consumers": sorted({u.node.op_type for u in out.uses()}),
            }
        )
    return tensors


_LAYOUT_OPS = ("Reshape", "Transpose", "Slice")


def _layout_ops_after(value: ir.Value) -> tuple[ir.Value, int]:
    """Past the Reshape/Transpose/Slice nodes that follow a per-axis block DequantizeLinear: the weight
    they rebuild, and its blocked axis (1 where a last Transpose turns [K, N] into [N, K])."""
    axis = 0
    uses = list(value.uses())
    while len(uses) == 1 and uses[0].node.op_type in _LAYOUT_OPS:
        node = uses[0].node
        axis = 1 if node.op_type == "Transpose" and list(node.attributes.get_ints("perm", [])) == [1, 0] else axis
        value = node.outputs[0]
        uses = list(value.uses())
    return value, axis


def _fast_form_weights(model: ir.Model) -> list[dict]:
    """The float8 weights that ``com.microsoft.MatMulBlockQuantizedFp8Weight`` nodes read."""
    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != BLOCK_FP8_OP:
            continue
        b, b_scale = node.inputs[1], node.inputs[2]
        if b is None or b.shape is None:
            continue
        block = node.attributes.get_int("block_size", 128)
        scale = b_scale.const_value.numpy() if b_scale is not None and b_scale.const_value is not None else None
        n, k = b.shape.numpy()
        how = "per channel (one block over K)" if block >= k else f"block {block} along K"
        numerics = "W8A8" if len(node.inputs) > 3 and node.inputs[3] is not None else "W8A16"
        found.append(
            {
                "name": node.outputs[0].name,
                "kind": "weight",
                "format": "e4m3fn",
                "scale": None if scale is None else scale.tolist(),
                "granularity": f"{how} ({BLOCK_FP8_OP}, {numerics})",
                "shape": [n, k],
                "consumers": [BLOCK_FP8_OP],
            }
        )
    return found


def _dequantized(value: ir.Value) -> bool:
    """Whether ``value`` comes from a DequantizeLinear, directly or through layout ops only."""
    producer = value.producer()
    while producer is not None and producer.op_type in _LAYOUT_OPS:
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    return producer is not None and producer.op_type == "DequantizeLinear"


def _granularity(node: ir.Node, scale) -> str:
    """How finely a DequantizeLinear's scale is applied, and whether every scale is a power of two."""
    block = node.attributes.get_int("block_size", 0)
    if scale is None:
        return "dynamic"
    kind = (
        f"block {block} along axis {node.attributes.get_int('axis', 1)}"
        if block
        else ("per tensor" if scale.size == 1 else f"per channel along axis {node.attributes.get_int('axis', 1)}")
    )
    mantissa, _ = np.frexp(np.asarray(scale, np.float64))
    return kind + (", power-of-two scales" if np.all(mantissa == 0.5) else "")


def inspect_summary(info: dict) -> str:
    lines = [
        f"{info['model']}: opset {info['opset']}, {info['quantized_nodes']} of {info['matmul_gemm_nodes']} "
        "MatMul/Gemm nodes read float8 inputs"
    ]
    if info["fp8onnx"]:
        cfg = info["fp8onnx"]
        lines.append(f"  written by fp8onnx {cfg.get('version')}: {describe_config(cfg)}")
        if cfg.get("emulated"):
            lines.append(f"  SIMULATION: {EMULATED_NOTE}")
    weights = [t for t in info["float8_tensors"] if t["kind"] == "weight"]
    acts = [t for t in info["float8_tensors"] if t["kind"] == "activation"]
    for label, group in (("weights", weights), ("activations", acts)):
        if not group:
            continue
        scales = np.array([t["scale"] for t in group if isinstance(t["scale"], float)])
        fmts = ", ".join(sorted({t["format"] for t in group}))
        rng = f", scales {scales.min():.3g} .. {scales.max():.3g}" if scales.size else ""
        kinds = collections.Counter(t.get("granularity", "") for t in group)
        how = "; ".join(f"{n} {k}" for k, n in sorted(kinds.items()) if k)
        lines.append(f"  {len(group)} float8 {label} ({fmts}){rng}" + (f" [{how}]" if how else ""))
    for name, why in info.get("high_risk", {}).items():
        lines.append(f"  HIGH RISK for FP8: {name}: {why}; consider --exclude '{name}'")
    problems = info.get("tensorrt_problems", [])
    lines.append(
        "  TensorRT: "
        + ("; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "") if problems else "no Q/DQ it would reject")
    )
    sizes = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(info["weight_bytes_by_type"].items()))
    lines.append(f"  initializers: {sizes}")
    placement = info.get("placement")
    if placement:
        counts = ", ".join(f"{n} {where}" for where, n in sorted(placement["counts"].items()))
        lines.append(f"  placement on {placement['target']} (predicted): {counts}")
        for what, nodes in list(placement["not_on_the_provider"].items())[:8]:
            shown = ", ".join(nodes[:3]) + (f", ... ({len(nodes)} nodes)" if len(nodes) > 3 else "")
            lines.append(f"    {what}: {shown}")
    return "\n".join(lines)
