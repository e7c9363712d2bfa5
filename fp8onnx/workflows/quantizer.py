"""The main job, orchestrated: prepare the graph, decide, calibrate, assign scales, insert float8 Q/DQ,
check and write the model. ``quantize()`` is what ``fp8onnx quantize`` calls.

Each step lives in its own module, so that changing one rule means opening one small file:
:mod:`~fp8onnx.settings.config` (the recipe and which options go together), :mod:`~fp8onnx.graph.prepare` (graph
preparation), :mod:`~fp8onnx.graph.plan` (per node: the inputs to quantize, or why not),
:mod:`~fp8onnx.techniques.scales` (scales, and onnxruntime's bias workarounds), :mod:`fp8onnx.passes` (the only
code that rewrites the graph).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib

from fp8onnx.accuracy.sensitivity import measure_with
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.phases import current_phases, lap, recording
from fp8onnx.base.scratch import scratch
from fp8onnx.data.datasource import Data
from fp8onnx.graph.guard import (
    as_path,
    check_calibration_source,
    check_paths,
    external_locations,
    model_reads,
    model_writes,
)
from fp8onnx.graph.model_io import EXTERNAL_META, load_model, model_file, save_model, write_text_atomic
from fp8onnx.graph.plan import activation_tensors, candidate_activations, in_main_graph, integer_quantized, plan
from fp8onnx.graph.prepare import Float16Unsupported, prepare_model
from fp8onnx.graph.run_settings import RunOptions, entry_settings
from fp8onnx.graph.runtime import make_session, qdq_fusion_warning, weight_bytes
from fp8onnx.graph.schemas import check_attributes
from fp8onnx.pipeline.calibration import Stats
from fp8onnx.settings.choices import DEFAULT_OP_TYPES, PRECISIONS, SUPPORTED_OP_TYPES
from fp8onnx.settings.config import QuantizeConfig
from fp8onnx.settings.report import QuantizeReport
from fp8onnx.settings.targets import check_tensorrt
from fp8onnx.techniques.family import detect_family
from fp8onnx.techniques.recipe import measure_techniques, settling, techniques_for
from fp8onnx.techniques.scales import (
    activation_ranges,
    assign_scales,
    describe_source,
    keep_conv_bias_in_int32_range,
    node_report,
    weight_quant,
)
from fp8onnx.workflows.calibration_data import calibration_data, data_source
from fp8onnx.workflows.loss_choice import choose_w8a16
from fp8onnx.workflows.rewrite import rewrite

__all__ = [
    "DEFAULT_OP_TYPES",
    "PRECISIONS",
    "SUPPORTED_OP_TYPES",
    "QuantizeConfig",
    "activation_tensors",
    "candidate_activations",
    "in_main_graph",
    "plan",
    "prepare_model",
    "quantize",
    "quantize_with",
]

logger = logging.getLogger(__name__)


def quantize(
    model: str | os.PathLike,
    output: str | os.PathLike,
    calib: Data | None = None,
    *,
    config: QuantizeConfig | None = None,
    stats: str | os.PathLike | Stats | None = None,
    report: str | os.PathLike | None = None,
    run: RunOptions | None = None,
    calib_optional: bool = False,
    **options,
) -> QuantizeReport:
    """Quantize the MatMul/Gemm nodes of ``model`` to float8 and write the result to ``output``.

    ``calib`` is a ``.npz`` file, a folder of them, or an iterable of feed dicts; ``stats`` a
    statistics file from :func:`fp8onnx.calibrate` (or a :class:`Stats`) used instead of running
    calibration. ``run`` says how onnxruntime runs (:class:`~fp8onnx.graph.run_settings.RunOptions`: batch size,
    provider, weight budget, progress); a model with more than ``run.weight_memory`` bytes of weights
    is calibrated layer by layer (see :mod:`fp8onnx.pipeline.segments`). Keyword ``options`` are RunOptions
    fields (``provider="cpu"``) or, when ``config`` is not given, QuantizeConfig fields and ``preset``
    (default ``"auto"``: the model family's recipe, :mod:`fp8onnx.techniques.family`, under the fields given;
    ``"none"``: plain per-tensor static amax).

    Without ``calib``, a recipe that needs data (static activation scales, GPTQ, smoothing, bias
    correction) on a model with token inputs and a ``tokenizer.json`` beside it calibrates on a text
    sample of CPython's documentation (:func:`fp8onnx.data.text_sample.python_text_sample`). ``calib_optional``:
    ``calib`` is such a default, dropped where the recipe needs no data.
    """
    config, run = _checked(model, output, calib, config, stats, report, run, options)
    return quantize_with(model, output, calib, config, run, stats=stats, report=report, calib_optional=calib_optional)


def quantize_with(
    model: str | os.PathLike,
    output: str | os.PathLike,
    calib: Data | None,
    config: QuantizeConfig,
    run: RunOptions,
    *,
    stats: str | os.PathLike | Stats | None = None,
    report: str | os.PathLike | None = None,
    calib_optional: bool = False,
) -> QuantizeReport:
    """:func:`quantize` for a workflow that has built its settings and checked its paths at its own entry
    (the accuracy search's variants, an export folder's models): nothing is built or checked again.

    requires: ``run.provider`` resolved (``cpu`` or ``cuda``); at most one of ``calib`` and ``stats``; ``output``
    on no file the run reads. ensures: as :func:`quantize`."""
    with recording() as phases, scratch():
        result = _quantize(model, output, calib, config, stats, report, run, calib_optional)
    result.phases = phases.to_json()
    return result


def _quantize(model, output, calib, config, stats, report, run, calib_optional=False) -> QuantizeReport:
    out = pathlib.Path(output)
    ir_model, from_opset, prepared, config = _prepared(model, config)
    layer_by_layer = weight_bytes(ir_model) > run.weight_memory
    family, explicit = None, config.explicit
    if config.preset == "auto":  # the family's recipe, under what the user set explicitly
        family = detect_family(ir_model, fp8_gemm=config.native_gemm)
        config = config.for_family(family.preset)
        logger.info("%s", family.describe())
    if stats is None:
        auto = explicit if family is not None else None
        calib, config = calibration_data(model, ir_model, config, calib, calib_optional, auto)
    source = data_source(calib, ir_model, config, stats)  # every step below reads this one object
    lap("load and prepare")
    decisions, skipped = plan(ir_model, config)
    _refuse_integer_models(model, ir_model, decisions)
    lap("plan")
    calibration, quant, amax = _calibrate(ir_model, decisions, config, source, stats, run, prepared)
    choice = None
    if config.w8a8_share is not None:  # the W8A16 nodes, by their measured share of the loss
        decisions, choice = choose_w8a16(ir_model, decisions, quant, config.w8a8_share, source, run)
        prepared.append(choice.line())
        lap("choose W8A16 by loss")
    nodes = [node_report(d, quant, amax) for d in decisions]
    rewritten = rewrite(ir_model, decisions, quant, config, run, prepared)
    if not rewritten.modified:  # nothing to quantize: the output is the input graph as it was
        ir_model, prepared = load_model(model), []
    target_problems = check_tensorrt(ir_model) if config.target == "tensorrt" else []
    lap("rewrite")
    # GemmFloat8 has only a CUDA kernel: such a model is loaded for checking on the CUDA EP, if any.
    check_on = "cpu" if not rewritten.lowered else ("cuda" if run.provider == "cuda" else None)
    if check_on is None:  # not loaded here: its contrib ops' attributes are checked against onnxruntime's schemas
        check_attributes(ir_model, "The output model")
    # Weights that came in a side file go out in one too: written tensor by tensor, never whole.
    try:
        save_model(ir_model, out, provider=check_on, external_data=ir_model.meta.get(EXTERNAL_META, False))
    except Fp8OnnxError:
        _input_loads(model, check_on)  # the input's own problem is said as the input's
        raise
    lap("check and write")
    result = QuantizeReport(
        model=str(model),
        output=str(out),
        config=config.to_json(),
        opset_from=from_opset,
        opset_to=ir_model.opset_imports.get(""),
        prepared=prepared,
        nodes=nodes + skipped,
        calibration=_calibration_json(calibration, calib, stats),
        input_bytes=_file_size(model),
        output_bytes=_file_size(out),
        runtime_checked=check_on,
        target_problems=target_problems,
        family=None if family is None else family.to_json(),
        w8a16=None if choice is None else choice.to_json(),
        **rewritten.report_fields(),
    )
    if check_on == "cpu" and _activation_qdq(ir_model) and (warning := qdq_fusion_warning(out)):
        logger.warning("%s", warning)
    if report is not None:
        result.phases = current_phases()
        doc = result.to_json()
        again = source if as_path(calib) is not None else None  # read again from its file (feeds are not kept)
        doc.update(_sensitivity_section(model, again, calibration, config, run, rewritten.modified, layer_by_layer))
        write_text_atomic(report, json.dumps(doc, indent=1) + "\n")
        lap("report")
    return result


def _checked(model, output, calib, config, stats, report, run, options) -> tuple[QuantizeConfig, RunOptions]:
    """(config, run) from the arguments (keyword ``options``: RunOptions fields, else QuantizeConfig's
    and ``preset``), after the checks that need no model: one calibration source, and no output on a
    file the run reads."""
    check_calibration_source(calib, stats)
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", as_path(calib)), ("the statistics file", as_path(stats))],
        model_writes("the output model", output) + [("the report", report)],
    )
    return entry_settings(config, run, options)  # like the CLI: the family's recipe under the options given


def _prepared(model, config: QuantizeConfig):
    """(ir_model, the opset it came in, what preparation did, config): a model whose graph cannot be
    float16 under a derived precision stays float32 (the config then says so)."""
    try:
        return (*prepare_model(model, config.precision), config)
    except Float16Unsupported as exc:
        if not config.precision_derived:
            raise
        logger.warning("%s The graph stays float32; the fast form's ops get Casts to float16 and back.", exc)
        config = dataclasses.replace(config, precision="model", explicit=(*config.explicit, "precision"))
        return (*prepare_model(model, config.precision), config)


def _refuse_integer_models(model, ir_model, decisions) -> None:
    """An integer-quantized model with no float MatMul/Gemm left is refused by name, not written as is."""
    if not decisions and (integer := integer_quantized(ir_model)):
        ops = ", ".join(f"{n} {op}" for op, n in sorted(integer.items()))
        raise Fp8OnnxError(
            f"Model file {str(model)!r} is quantized to integers already ({ops}) and has no float MatMul/Gemm "
            "left to quantize: give fp8onnx the float model it was made from."
        )


def _calibrate(ir_model, decisions, config: QuantizeConfig, source, stats, run: RunOptions, prepared: list):
    """(the calibration's statistics, every quantized tensor's TensorQuant, their amax): smoothing's pass
    first where asked (it changes what the scales see), then one pass for the activation ranges and
    every later technique's statistics, the scales, and the techniques applied (``prepared`` gets their
    lines)."""
    early = techniques_for(config, ir_model, decisions, before_scales=True)  # smoothing: changes what scales see
    if early:
        measure_techniques(ir_model, early, source, run)
        prepared += [line for t in early if (line := t.apply(None))]
        lap("smooth")
    act_names = activation_tensors(decisions, ir_model)
    late = techniques_for(config, ir_model, decisions, before_scales=False)  # on the graph as smoothed
    ranges = activation_ranges(ir_model, act_names, config, source, stats)
    weights, settle = _settling(ir_model, decisions, config, late, run)
    calibration = measure_techniques(ir_model, late, source, run, ranges, settle, config.sequential)  # one pass
    lap("calibrate")
    quant, amax = assign_scales(decisions, ir_model, config, calibration, weights)
    keep_conv_bias_in_int32_range(decisions, quant)
    lap("scales")
    prepared += [line for t in late if (line := t.apply(quant))]
    if late:
        lap("apply " + ", ".join(t.name for t in late) + " (GPTQ's rounding runs when the weights are written)")
    return calibration, quant, amax


def _calibration_json(calibration, calib, stats) -> dict | None:
    """The report's ``calibration``: how much data went through, and from where."""
    if calibration is None:
        return None
    return {
        "batches": calibration.num_batches,
        "samples": calibration.num_samples,
        "batching": calibration.batching,
        "source": describe_source(stats) if stats is not None else describe_source(calib, "feeds"),
    }


def _input_loads(model, provider: str | None) -> None:
    """When the output does not load: if the input does not load either, say so (nothing was written)."""
    if provider is None or not isinstance(model, (str, os.PathLike)):
        return

    path = model_file(model)
    try:
        make_session(path, provider, f"Model file {str(model)!r}", optimize=False)
    except Fp8OnnxError as exc:
        raise Fp8OnnxError(f"{exc} (the input: fp8onnx cannot make it load; nothing written)") from exc


def _settling(model, decisions, config: QuantizeConfig, techniques, run: RunOptions):
    """(the weights' (TensorQuant, amax), settle) for a layer-by-layer pass that settles layers as it
    goes (:func:`~fp8onnx.techniques.recipe.settling`): sequential calibration, or GPTQ on a model
    over the weight budget; else ({}, None). The weights' scales come from the weights alone, so
    they are known before the pass."""
    layered = weight_bytes(model) > run.weight_memory and not run.distributed
    if not config.sequential and not (layered and config.weight_rounding == "gptq"):
        return {}, None
    weights = {
        d.node.inputs[i].name: weight_quant(d.node, i, d.node.inputs[i], config)
        for d in decisions
        for i, kind in d.inputs
        if kind == "weight"
    }
    quant = {name: tq for name, (tq, _) in weights.items()}
    return weights, settling(decisions, quant, techniques, config.sequential)


def _sensitivity_section(model, source, stats, config, run, modified, layer_by_layer) -> dict:
    """The report's ``sensitivity``: per node, as :func:`~fp8onnx.accuracy.sensitivity.measure_sensitivity`
    measures it (its ``measure_with``: the settings built already), with the scales just used (one more pass
    over ``source``, the calibration data read from its file; None or False where there is none); or why it
    was not measured."""
    if not modified:
        why = "nothing was quantized"
    elif config.activations != "static" or source is None:
        why = "it needs calibration data read from a file (run `fp8onnx sensitivity MODEL --data DATA`)"
    elif layer_by_layer:
        why = "the model is calibrated layer by layer (its weights exceed --weight-memory)"
    elif config.weights_need_data:
        why = "it measures plain rounding of the unsmoothed graph, not --smooth, GPTQ or bias correction"
    else:
        measured = measure_with(model, None, source, config, RunOptions.of(run, progress=False), stats=stats)
        return {"sensitivity": measured.to_json()["nodes"]}
    return {"sensitivity_not_measured": why}


def _activation_qdq(model) -> int:
    """The float8 QuantizeLinear nodes of the written graph that read an activation (not a constant)."""
    return sum(
        1
        for node in model.graph
        if node.op_type == "QuantizeLinear"
        and node.inputs[0] is not None
        and node.inputs[0].const_value is None
        and node.inputs[0].name not in model.graph.initializers
    )


def _file_size(path) -> int:
    """Bytes of a model file (the model.onnx of an export folder) and every external-data file it
    references (Optimum's ``model.onnx_data`` as much as our ``<name>.data``)."""
    path = model_file(path)
    files = {path, *(path.parent / loc for loc in external_locations(path))}
    return sum(f.stat().st_size for f in files if f.is_file())
