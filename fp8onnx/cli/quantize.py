"""``fp8onnx quantize``: a model or an export folder in, FP8 out."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from typing import ClassVar

import click

from fp8onnx import compare as api_compare
from fp8onnx import quantize as api_quantize
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.phases import process_age
from fp8onnx.base.phases import table as phases_table
from fp8onnx.cli.common import (
    _FORMATS,
    _PARAM,
    _SCALINGS,
    _batch_memory_option,
    _batch_size_option,
    _csv,
    _per_channel_option,
    _provider_option,
    _run,
    _run_options,
    _Sectioned,
    _SmoothAlpha,
    _text_options,
    _weight_memory_option,
    _workers_options,
    main,
)
from fp8onnx.cli.options import (
    NOT_OPTIONS,
    count_option,
    deployment_options,
    fallback_option,
    metric_option,
    recipe_options,
    refine_option,
    run_options,
    weight_block_size_option,
)
from fp8onnx.graph.guard import check_paths, model_writes
from fp8onnx.graph.model_io import write_text_atomic
from fp8onnx.settings.choices import ACTIVATION_MODES, EMBEDDING_MODES, WEIGHT_ROUNDINGS
from fp8onnx.settings.config import PRESETS, QuantizeConfig
from fp8onnx.workflows.exports import quantize_folder
from fp8onnx.workflows.fallback import REFINE_DEFAULTS, TargetSearch, quantize_to_target


def _sections() -> dict[str, tuple[str, ...]]:
    """quantize's --help sections; the recipe's are the QuantizeConfig fields no other section shows."""
    before = {
        "Model, data and output": ("output", "calib", "tokenizer", "seq_len", "preset", "report"),
        "Accuracy": (
            "eval_data",
            "accuracy_target",
            "metric",
            "max_float_nodes",
            "fallback",
            "refine",
            "check_data",
            "stats",
        ),
    }
    after = {
        "Deployment target": ("precision", "target", "gemm_op", "native_gemm", "fold_at_load"),
        "Running": ("batch_size", "batch_memory", "workers", "ray_address", "ray_timeout", "weight_memory", "provider"),
    }
    shown = {name for names in (*before.values(), *after.values()) for name in names}
    fields = (_PARAM.get(f.name, f.name) for f in dataclasses.fields(QuantizeConfig) if f.name not in NOT_OPTIONS)
    recipe = tuple(name for name in fields if name not in shown)
    return {**before, "Recipe (what a preset sets; rarely needed by hand)": recipe, **after}


class _QuantizeCommand(_Sectioned):
    sections: ClassVar[dict[str, tuple[str, ...]]] = _sections()


@main.command(cls=_QuantizeCommand)
@click.argument("model", type=click.Path())
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(),
    help="Where to write the FP8 model; for an export folder MODEL, a folder (unless it ends in .onnx).",
)
@click.option(
    "--calib", type=click.Path(), help="Calibration data: an .npz file, a folder of them, or a .txt/.jsonl text file."
)
@click.option(
    "--stats", type=click.Path(dir_okay=False), help="Statistics from `fp8onnx calibrate`, instead of --calib."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice([*_FORMATS, "mxfp8"], case_sensitive=False),
    default="e4m3fn",
    show_default=True,
    help="Float8 format of weights and activations (e3m4: emulated, for studies only, not deployable). mxfp8: "
    "OCP MXFP8 as standard ONNX: e4m3fn with one power-of-two scale per 32 elements (--weight-block-size 32, "
    "--activations dynamic-per-group --group-size 32, --scaling pow2; --activations none for weight-only).",
)
@click.option(
    "--weight-format", type=click.Choice(_FORMATS, case_sensitive=False), help="Override --format for weights."
)
@click.option(
    "--activation-format", type=click.Choice(_FORMATS, case_sensitive=False), help="Override --format for activations."
)
@click.option(
    "--scaling",
    type=click.Choice(_SCALINGS, case_sensitive=False),
    default="amax",
    show_default=True,
    help="amax: scale = amax/fmax; pow2: power-of-two scales (E8M0 values, MX-style; in-graph dynamic scales "
    "rounded up to one too); mx: OCP Microscaling's rule, 2^(floor(log2 amax) - emax of the format), the values "
    "above fmax saturating; percentile: clip at "
    "--percentile of |x|; mse: clip where the quantization error is least; constant: --scale for all.",
)
@click.option("--margin", type=int, default=0, show_default=True, help="pow2 only: exponent bias margin.")
@click.option(
    "--headroom",
    type=click.FloatRange(min=1),
    default=1.0,
    show_default=True,
    metavar="X",
    help="Static activations: each scale covers X times the calibrated range, so that text or images the "
    "calibration never saw do not clip (E4M3 keeps 3 mantissa bits over a range of 2^15; X costs only the "
    "smallest values).",
)
@click.option(
    "--percentile", type=float, help="percentile only: which percentile of |x| maps to fmax [default: 99.99]."
)
@click.option(
    "--scale", type=float, help="constant only: the scale used for every tensor [default: 1, values cast as they are]."
)
@click.option(
    "--activations",
    type=click.Choice(ACTIVATION_MODES),
    default="static",
    show_default=True,
    help="static: calibrated scales; dynamic: each batch's amax computed in the graph (no calibration); "
    "dynamic-per-token: one in-graph scale per row, with per-channel weights; dynamic-per-group: one in-graph "
    "scale per row and --group-size channels; none: weight-only FP8.",
)
@click.option(
    "--group-size",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    metavar="N",
    help="--activations dynamic-per-group: channels per in-graph scale (DeepSeek-V3's activation tiles: 128).",
)
@_per_channel_option
@deployment_options
@click.option(
    "--op-types", callback=_csv, default="MatMul,Gemm", show_default=True, help="Comma-separated: MatMul, Gemm, Conv."
)
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave nodes whose name matches GLOB (repeatable).")
@click.option(
    "--float-activations",
    multiple=True,
    metavar="GLOB",
    help="Nodes whose name matches GLOB keep float activations "
    "and FP8 weights (W8A16: the fast form without a_scale), the rest as --activations says (repeatable).",
)
@count_option(
    "--float-last-layers",
    "The MatMul/Gemm nodes of the last N decoder layers (told by 'layers.K' in their names, as torch, Optimum "
    "and onnxruntime-genai name them) keep float activations and FP8 weights (W8A16), like --float-activations.",
)
@click.option(
    "--w8a8-share",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=None,
    metavar="FRACTION",
    help="With static activations: at least this share of the quantized MACs W8A8; the other nodes keep float "
    "activations (W8A16), chosen by each one's measured share of the output's loss (KL to FP32) on a few "
    "calibration samples, cheapest per MAC W8A8 first. [llm-w8a8: 0.67]",
)
@click.option("--activation-matmuls", is_flag=True, help="Also quantize MatMuls whose both inputs are activations.")
@click.option(
    "--preset",
    type=click.Choice(["auto", "none", *PRESETS]),
    default="auto",
    show_default=True,
    help="The measured best settings for a model family (docs/usage.md); auto: the family told from the graph "
    "(decoder LLM, encoder, CNN, speech, other), none: plain per-tensor static amax; options given explicitly "
    "override them.",
)
@click.option(
    "--weight-rounding",
    type=click.Choice(WEIGHT_ROUNDINGS),
    default="nearest",
    show_default=True,
    help="gptq: round weights on the FP8 grid compensating each layer's error with X^T X from --calib (GPTQ).",
)
@click.option(
    "--smooth",
    type=_SmoothAlpha(),
    metavar="ALPHA|off",
    help="SmoothQuant: move activation outliers into the weights, s = amax_x^ALPHA / amax_w^(1-ALPHA) (0.5 usual); "
    "off: none (e.g. to turn off a preset's).",
)
@count_option(
    "--keep-channels",
    "Keep the N input channels of largest calibration amax of each quantized MatMul/Gemm input in float "
    "(a small float MatMul beside the FP8 one; an LLM's massive activations); 0: none.",
)
@click.option(
    "--bias-correction", is_flag=True, help="Shift each layer's bias to cancel the mean error of its FP8 weights."
)
@weight_block_size_option
@click.option(
    "--sequential/--no-sequential",
    default=False,
    help="Calibrate layer by layer, each layer on the outputs of the quantized layers before it (their weights as "
    "stored: GPTQ's rounding or the nearest FP8 value); GPTQ's X^T X, bias correction's means and static activation "
    "ranges then see the quantized model's inputs. Runs in this process, two runs per segment "
    "(--no-sequential: on the float model, the default).",
)
@click.option(
    "--float-vocab",
    is_flag=True,
    help="Leave vocabulary-sized projections (an lm_head: as many outputs as an embedding table has rows) in float.",
)
@click.option(
    "--wide-tables",
    is_flag=True,
    help="Keep float tables that stay in float (an lm_head under --float-vocab, its tied embedding table) in 32 bits; "
    "by default they are stored as float16 (bfloat16 beyond its range) and read through a Cast to float32.",
)
@click.option(
    "--float-stem",
    is_flag=True,
    help="Leave the stem convolutions (those that read the model's input before any other layer) in float.",
)
@click.option(
    "--embeddings",
    type=click.Choice(EMBEDDING_MODES),
    default="float",
    show_default=True,
    help="fp8: store embedding tables (Gather over a constant table) as float8 codes with per-row scales.",
)
@_batch_size_option
@_batch_memory_option
@_workers_options
@_weight_memory_option
@_provider_option
@click.option(
    "--report", type=click.Path(dir_okay=False), help="Write the full report (every node, scale, reason) as JSON."
)
@click.option(
    "--check", "check_data", type=click.Path(), help="Evaluation data: print the compare table after quantizing."
)
@click.option("--eval", "eval_data", type=click.Path(), help="Held-out data for --accuracy-target.")
@click.option(
    "--accuracy-target",
    type=float,
    metavar="PCT",
    help="Keep the fewest, most sensitive nodes in float until the headline metric on --eval is >= PCT% of FP16's.",
)
@click.option(
    "--max-float-nodes", type=click.IntRange(min=0), help="With --accuracy-target: keep at most N nodes in float."
)
@metric_option
@fallback_option
@click.option(
    "--fold-at-load/--no-fold-at-load",
    default=None,
    help="onnxruntime-genai folder: its decoder session dequantizes the float8 weights once at load "
    "(session.disable_quant_qdq=1 in genai_config.json): on the CPU, FP32's speed and memory, FP8's file. "
    "[default: on for a folder for the CPU, off for --target onnxruntime-cuda]",
)
@refine_option
@_run
@_text_options("calib", "eval_data", "check_data")
def quantize(model, output, **params):
    """Quantize the MatMul/Gemm nodes of MODEL to float8 (Q/DQ) and write the result.

    MODEL is an .onnx file or an export folder. A folder (onnxruntime-genai, Optimum decoder or
    encoder-decoder) with -o FOLDER gives a folder that the same runtime loads: every model in it
    quantized, calibrated by running the export on the prompts of --calib, every other file copied.

    \b
    What most users need:
      fp8onnx quantize export_dir/ -o export_fp8/                  # an export folder, no data file: the whole job
      fp8onnx quantize model.onnx --calib calib.npz -o model.fp8.onnx
      fp8onnx quantize model.onnx --calib calib.npz --eval eval.npz --accuracy-target 99.5 -o model.fp8.onnx

    \b
    Examples of the other options:
      fp8onnx quantize export_dir/ --calib corpus.txt -o export_fp8/   # a runnable folder
      fp8onnx quantize model.onnx --stats stats.json --scaling pow2 --margin 1 -o model.fp8.onnx
      fp8onnx quantize model.onnx --calib data/ --exclude '*lm_head*' --report report.json -o out.onnx
      fp8onnx quantize model.onnx --scaling constant --scale 0.05 -o model.cscale.onnx
      fp8onnx quantize model.onnx --activations dynamic --per-channel -o model.dyn.onnx
      fp8onnx quantize llm.onnx --activations dynamic-per-token -o llm.fp8-dynamic.onnx
      fp8onnx quantize model.onnx --activations none -o model.w8.onnx  # weight-only
      fp8onnx quantize model.onnx --calib calib.npz --weight-format e4m3fn --activation-format e5m2 -o mixed.onnx
      fp8onnx quantize model.onnx --calib calib.npz --precision fp16 -o model.fp8-fp16.onnx
      fp8onnx quantize model.onnx --calib calib.npz --precision fp16 --native-gemm -o model.gemmfp8.onnx
      fp8onnx quantize model.onnx --calib calib.npz --target onnxruntime-cuda -o model.cuda.onnx  # the CUDA fast path
      fp8onnx quantize llama.onnx --calib calib.npz --weight-memory 256 -o llama.fp8.onnx  # layer by layer
    """
    folder_mode = pathlib.Path(model).is_dir() and not str(output).endswith(".onnx")
    _check(model, output, folder_mode, params)
    recipe, run = recipe_options(params), run_options(params)
    t0, startup = time.perf_counter(), process_age()
    report = params["report"]
    if folder_mode:
        _quantize_folder(model, output, recipe, run, params)
    elif params["accuracy_target"] is not None:
        _quantize_to_target(model, output, recipe, run, params)
    else:
        result = api_quantize(
            model, output, params["calib"], config=recipe, stats=params["stats"], report=report, run=run
        )
        click.echo(result.summary())
        if logging.getLogger("fp8onnx").isEnabledFor(logging.INFO):  # -v
            click.echo(phases_table(result.phases, startup))
    click.echo(f"  done in {time.perf_counter() - t0:.1f}s" + (f"; report in {report}" if report else ""))
    if params["check_data"] and not folder_mode:
        checked = api_compare(model, [output], params["check_data"], run=_run_options(run.batch_size, run.provider))
        click.echo(checked.table())


def _check(model, output, folder_mode: bool, params: dict) -> None:
    """Which options go together, and what the command writes against what it reads (the library
    guards what it reads itself; the data of --check and --eval are read here)."""
    eval_data, target, report = params["eval_data"], params["accuracy_target"], params["report"]
    if (eval_data is None) != (target is None):
        raise Fp8OnnxError("--accuracy-target and --eval go together: give both or neither.")
    if (params["max_float_nodes"] is not None or params["refine"] is not None) and target is None:
        raise Fp8OnnxError("--max-float-nodes and --refine only apply with --accuracy-target.")
    if params["fold_at_load"] and not folder_mode:
        raise Fp8OnnxError("--fold-at-load applies to an onnxruntime-genai folder written as a folder (-o OUT_DIR).")
    if folder_mode and (target is not None or params["stats"] or params["check_data"]):
        raise Fp8OnnxError(
            "--accuracy-target, --stats and --check take one model: give MODEL/model.onnx, or -o OUT.onnx."
        )
    if target is not None and params["stats"]:
        raise Fp8OnnxError("--accuracy-target measures sensitivity on --calib DATA; --stats cannot stand in.")
    if folder_mode and report:
        for label, folder in (("the output folder", output), ("the export folder", model)):
            if pathlib.Path(folder).resolve() in pathlib.Path(report).resolve().parents:
                raise Fp8OnnxError(f"The report {report!r} lies inside {label} {folder!r}; write it elsewhere.")
    check_paths(
        [("the evaluation data", params["check_data"]), ("the evaluation data", eval_data)],
        ([] if folder_mode else model_writes("the output model", output)) + [("the report", report)],
    )


def _quantize_folder(model, output, config: QuantizeConfig, run, params: dict) -> None:

    result = quantize_folder(
        model, output, params["calib"], config=config, run=run, fold_at_load=params["fold_at_load"]
    )
    click.echo(result.summary())
    if params["report"]:
        write_text_atomic(params["report"], json.dumps(result.to_json(), indent=1) + "\n")


def _quantize_to_target(model, output, config: QuantizeConfig, run, params: dict) -> None:
    fallback = quantize_to_target(
        model,
        output,
        params["calib"],
        params["eval_data"],
        goal=TargetSearch(
            params["accuracy_target"],
            params["max_float_nodes"],
            REFINE_DEFAULTS["quantize_to_target"] if params["refine"] is None else params["refine"],
            params["metric"],
        ),
        config=config,
        report=params["report"],
        run=run,
    )
    click.echo(fallback.summary())
