"""The main job: choose what to quantize, calibrate, insert float8 Q/DQ, check and write the model.

``quantize()`` is what ``fp8onnx quantize`` calls. The decisions are kept apart from the rewrite:
:func:`plan` looks at each MatMul/Gemm and returns, per node, either the inputs to quantize or the
reason it is left alone; scales come from :mod:`fp8onnx.scaling`; the graph is changed only by the
passes in :mod:`fp8onnx.passes`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import pathlib
from collections.abc import Iterable

import onnx_ir as ir
import onnx_ir.passes.common

from . import __version__
from .calibration import Stats, collect_amax, weight_amax
from .errors import Fp8OnnxError
from .formats import Fp8Format, parse_format
from .model_io import check_output_path, load_model, save_model, write_text_atomic
from .passes import InsertQDQPass, TensorQuant, UpgradeOpsetPass
from .report import NodeReport, QuantizeReport, TensorReport
from .runtime import resolve_provider
from .scaling import Scaling, amax_to_scale, parse_scaling

__all__ = ["QuantizeConfig", "plan", "quantize", "SUPPORTED_OP_TYPES"]

logger = logging.getLogger(__name__)
SUPPORTED_OP_TYPES = ("MatMul", "Gemm")
_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_MATMUL_INPUTS = {"MatMul": (0, 1), "Gemm": (0, 1)}  # Gemm's bias C stays in float


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; validated on creation."""

    format: Fp8Format = Fp8Format.E4M3FN
    scaling: Scaling = Scaling.AMAX
    margin: int = 0
    scale: float | None = None
    op_types: tuple[str, ...] = SUPPORTED_OP_TYPES
    exclude: tuple[str, ...] = ()
    activation_matmuls: bool = False

    def __post_init__(self):
        object.__setattr__(self, "format", parse_format(self.format))
        object.__setattr__(self, "scaling", parse_scaling(self.scaling))
        object.__setattr__(self, "op_types", tuple(self.op_types))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        unknown = [t for t in self.op_types if t not in SUPPORTED_OP_TYPES]
        if unknown or not self.op_types:
            raise Fp8OnnxError(
                f"Unsupported op type {unknown[0] if unknown else ''!r} in --op-types; supported: "
                f"{', '.join(SUPPORTED_OP_TYPES)}."
            )
        if self.scaling is Scaling.CONSTANT:
            amax_to_scale(1.0, self.format, self.scaling, constant=self.scale)  # validates --scale
        elif self.scale is not None:
            raise Fp8OnnxError("--scale only applies to --scaling constant.")
        if self.margin != int(self.margin):
            raise Fp8OnnxError(f"--margin must be an integer, got {self.margin!r}.")
        if self.margin and self.scaling is not Scaling.POW2:
            raise Fp8OnnxError("--margin only applies to --scaling pow2.")

    def to_json(self) -> dict:
        return {
            "format": self.format.value,
            "scaling": self.scaling.value,
            "margin": self.margin,
            "scale": self.scale,
            "op_types": list(self.op_types),
            "exclude": list(self.exclude),
            "activation_matmuls": self.activation_matmuls,
        }


@dataclasses.dataclass
class _Decision:
    node: ir.Node
    inputs: list[tuple[int, str]]  # (input index, "weight" | "activation")
    reason: str | None = None


def _is_weight(value: ir.Value) -> bool:
    return value.const_value is not None and value.is_initializer() and not value.is_graph_input()


def _decide(node: ir.Node, config: QuantizeConfig) -> _Decision:
    for pattern in config.exclude:
        if fnmatch.fnmatchcase(node.name or "", pattern):
            return _Decision(node, [], f"excluded by --exclude {pattern!r}")
    inputs = []
    for index in _MATMUL_INPUTS[node.op_type]:
        value = node.inputs[index] if index < len(node.inputs) else None
        if value is None:
            return _Decision(node, [], f"input {index} is missing")
        if value.dtype not in _FLOAT_TYPES:
            return _Decision(node, [], f"input {value.name!r} is {value.dtype}, not float32/float16/bfloat16")
        producer = value.producer()
        if producer is not None and producer.op_type == "DequantizeLinear":
            return _Decision(node, [], f"already quantized: input {value.name!r} comes from DequantizeLinear")
        if value.is_initializer() and value.is_graph_input():
            return _Decision(node, [], f"weight {value.name!r} is also a graph input and can be overridden at run time")
        inputs.append((index, "weight" if _is_weight(value) else "activation"))
    if all(kind == "activation" for _, kind in inputs) and not config.activation_matmuls:
        return _Decision(node, [], "both inputs are activations (e.g. attention scores); opt in with --activation-matmuls")
    return _Decision(node, inputs)


def plan(model: ir.Model, config: QuantizeConfig) -> tuple[list[_Decision], list[NodeReport]]:
    """Per MatMul/Gemm of the model: the inputs to quantize, or why it is left alone."""
    decisions, skipped = [], []
    for node in model.graph:
        if node.op_type not in SUPPORTED_OP_TYPES or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type not in config.op_types:
            skipped.append(NodeReport(node.name, node.op_type, False, f"{node.op_type} is not in --op-types"))
            continue
        decision = _decide(node, config)
        if decision.reason:
            skipped.append(NodeReport(node.name, node.op_type, False, decision.reason))
        else:
            decisions.append(decision)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.graph is not model.graph and node.op_type in SUPPORTED_OP_TYPES:
            skipped.append(
                NodeReport(node.name, node.op_type, False, "inside a control-flow subgraph (If/Loop/Scan): not quantized yet")
            )
    for function in model.functions.values():
        for node in function:
            if node.op_type in SUPPORTED_OP_TYPES:
                skipped.append(
                    NodeReport(node.name, node.op_type, False, f"inside function {function.name!r}: not quantized yet")
                )
    return decisions, skipped


def activation_tensors(decisions: Iterable[_Decision]) -> list[str]:
    names = []
    for d in decisions:
        names.extend(d.node.inputs[i].name for i, kind in d.inputs if kind == "activation")
    return list(dict.fromkeys(names))


def candidate_activations(model: ir.Model) -> list[str]:
    """Every float activation input of every MatMul/Gemm: what ``fp8onnx calibrate`` records, so that
    one statistics file serves any later choice of --op-types, --exclude or --activation-matmuls."""
    config = QuantizeConfig(activation_matmuls=True)
    return activation_tensors(d for d in plan(model, config)[0])


def prepare_model(path: str | os.PathLike) -> tuple[ir.Model, int | None, bool]:
    """Load and upgrade the opset; returns (model, original opset, upgraded?)."""
    model = load_model(path)
    upgrade = UpgradeOpsetPass()
    result = upgrade(model)
    # Types of intermediate tensors decide what can be quantized and the scales' dtype.
    ir.passes.common.ShapeInferencePass()(model)
    return result.model, upgrade.from_version, result.modified


def quantize(
    model: str | os.PathLike,
    output: str | os.PathLike,
    calib=None,
    *,
    config: QuantizeConfig | None = None,
    stats: str | os.PathLike | Stats | None = None,
    batch_size: int = 16,
    provider: str = "auto",
    report: str | os.PathLike | None = None,
    progress: bool = False,
    **options,
) -> QuantizeReport:
    """Quantize the MatMul/Gemm nodes of ``model`` to float8 and write the result to ``output``.

    ``calib`` is a ``.npz`` file, a folder of them, or an iterable of feed dicts; ``stats`` a
    statistics file from :func:`fp8onnx.calibrate` (or a :class:`Stats`) used instead of running
    calibration. Keyword ``options`` build a :class:`QuantizeConfig` when ``config`` is not given.
    """
    config = config or QuantizeConfig(**options)
    out = check_output_path(output, model)
    provider = resolve_provider(provider)
    ir_model, from_opset, upgraded = prepare_model(model)
    decisions, skipped = plan(ir_model, config)
    act_names = activation_tensors(decisions)

    calibration = None
    amax: dict[str, float] = {}
    if act_names and config.scaling is not Scaling.CONSTANT:
        if stats is not None:
            loaded = stats if isinstance(stats, Stats) else Stats.load(stats)
            missing = [n for n in act_names if n not in loaded.amax]
            if missing:
                raise Fp8OnnxError(
                    f"Statistics file {str(stats)!r} has no entry for tensor {missing[0]!r}; rerun `fp8onnx calibrate` "
                    "on this model."
                )
            calibration = loaded
        elif calib is not None:
            calibration = collect_amax(
                ir_model, act_names, calib, batch_size=batch_size, provider=provider, progress=progress
            )
        else:
            raise Fp8OnnxError(
                "Activation scales need calibration: pass --calib DATA or --stats FILE (or --scaling constant)."
            )
        amax = calibration.amax

    quant: dict[str, TensorQuant] = {}
    targets = []
    nodes = []
    for d in decisions:
        tensors = []
        for index, kind in d.inputs:
            value = d.node.inputs[index]
            a = weight_amax(value) if kind == "weight" else amax.get(value.name, 0.0)
            if value.name not in quant:
                scale = amax_to_scale(a, config.format, config.scaling, margin=config.margin, constant=config.scale)
                quant[value.name] = TensorQuant(config.format, scale)
            tensors.append(TensorReport(value.name, kind, config.format.value, quant[value.name].scale, a))
            targets.append((d.node.name, index))
        nodes.append(NodeReport(d.node.name, d.node.op_type, True, None, tensors))

    modified = InsertQDQPass(targets, quant)(ir_model).modified
    ir_model.metadata_props["fp8onnx"] = json.dumps({"version": __version__, **config.to_json()}, sort_keys=True)
    save_model(ir_model, out, provider="cpu")
    result = QuantizeReport(
        model=str(model),
        output=str(out),
        config=config.to_json(),
        opset_from=from_opset,
        opset_to=UpgradeOpsetPass().target if upgraded else from_opset,
        nodes=nodes + skipped,
        calibration=None
        if calibration is None
        else {"batches": calibration.num_batches, "samples": calibration.num_samples, "source": str(stats or calib)},
        input_bytes=_file_size(model),
        output_bytes=_file_size(out),
        modified=modified,
    )
    if report is not None:
        write_text_atomic(report, json.dumps(result.to_json(), indent=1) + "\n")
    return result


def _file_size(path) -> int:
    path = pathlib.Path(path)
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
