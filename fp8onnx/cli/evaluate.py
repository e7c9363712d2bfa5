"""``fp8onnx compare``, ``study`` and ``sensitivity``: how close FP8 stays, and where it hurts."""

from __future__ import annotations

import json
import pathlib
import time

import click

from fp8onnx import compare as api_compare
from fp8onnx import study as run_study
from fp8onnx.accuracy.compare import GENERATE_PROMPTS, GENERATE_TOKENS
from fp8onnx.accuracy.plots import compare_rows, sensitivity_bars
from fp8onnx.accuracy.sensitivity import write_json
from fp8onnx.cli.common import (
    _FORMATS,
    _SCALINGS,
    _batch_size_option,
    _csv,
    _per_channel_option,
    _provider_option,
    _run,
    _text_options,
    _workers_options,
    main,
)
from fp8onnx.cli.options import (
    fallback_option,
    metric_option,
    recipe_options,
    refine_option,
    run_options,
    weight_block_size_option,
)
from fp8onnx.experiments.study import PLOT_FILES, write_outputs, write_plots
from fp8onnx.graph.guard import check_paths, model_reads, output_folder
from fp8onnx.graph.model_io import write_text_atomic
from fp8onnx.settings.choices import ACTIVATION_MODES
from fp8onnx.workflows.fallback import REFINE_DEFAULTS, Scoring
from fp8onnx.workflows.fallback import sensitivity as run_sensitivity


@main.command()
@click.argument("reference", type=click.Path())
@click.argument("candidates", nargs=-1, type=click.Path())
@click.option(
    "--data",
    required=True,
    type=click.Path(),
    help="Evaluation data (.npz, folder, or .txt/.jsonl text); 'labels' enables accuracy.",
)
@click.option("--no-fp16", is_flag=True, help="Do not build and run the FP16 baseline.")
@click.option(
    "--generate",
    type=click.IntRange(min=0),
    default=GENERATE_TOKENS,
    show_default=True,
    metavar="N",
    help="Language models (input_ids in, logits out): greedy tokens each model generates from prompts taken "
    "from the data, compared with FP32's; 0: no generation check.",
)
@click.option(
    "--prompts",
    type=click.IntRange(min=1),
    default=GENERATE_PROMPTS,
    show_default=True,
    help="Prompts for --generate: the first rows of the data (their first 32 tokens).",
)
@_batch_size_option
@_workers_options
@_provider_option
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the results as JSON.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write compare.png into this folder.")
@metric_option
@_run
@_text_options("data")
def compare(
    reference,
    candidates,
    data,
    no_fp16,
    generate,
    prompts,
    json_out,
    plot_dir,
    metric,
    **running,
):
    """Accuracy of CANDIDATES against REFERENCE (FP32) and its FP16 baseline; for language models
    also greedy generation against FP32's; for every model its time per batch and session memory.

    \b
    Example:
      fp8onnx compare model.onnx model.fp8.onnx model.pow2.onnx --data eval.npz --json cmp.json
      fp8onnx compare llm/ llm-fp8/ --data held_out.txt --generate 48 --prompts 5 --plot plots/
    """
    reads = model_reads("the reference model", reference)
    for cand in candidates:
        reads += model_reads(f"the candidate model {cand!r}", cand)
    if plot_dir:
        output_folder(plot_dir, "Plot folder")
    plot = pathlib.Path(plot_dir) / "compare.png" if plot_dir else None
    check_paths(reads + [("the evaluation data", data)], [("the JSON output", json_out), ("the plot", plot)])
    run = run_options(running)
    result = api_compare(
        reference, candidates, data, fp16=not no_fp16, generate=generate, prompts=prompts, metric=metric, run=run
    )
    click.echo(result.table())
    if json_out:
        write_text_atomic(json_out, json.dumps(result.to_json(), indent=1) + "\n")
    if plot:
        click.echo(f"wrote {compare_rows(result.rows, result.generation, plot)}")


@main.command()
@click.argument("model", type=click.Path())
@click.option("--calib", required=True, type=click.Path(), help="Calibration data (.npz, folder, or .txt/.jsonl text).")
@click.option(
    "--data",
    required=True,
    type=click.Path(),
    help="Evaluation data (.npz, folder, or .txt/.jsonl text); 'labels' enables accuracy.",
)
@click.option("--max-samples", type=click.IntRange(min=1), help="Evaluate on at most about this many samples.")
@_batch_size_option
@_workers_options
@_provider_option
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the ranked table as JSON.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write the ranked table as CSV.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write PNG plots into this folder.")
@click.option(
    "--techniques",
    is_flag=True,
    help="Also smoothing, GPTQ, bias correction, their combinations and the presets (a pass over --calib each).",
)
@metric_option
@_run
@_text_options("calib", "data")
def study(
    model,
    calib,
    data,
    max_samples,
    json_out,
    csv_out,
    plot_dir,
    techniques,
    metric,
    **running,
):
    """Run the papers' comparison on MODEL: formats, scaling methods, constant-scale sweep,
    static vs dynamic activations, per-tensor vs per-channel weights; one calibration pass.

    \b
    Example:
      fp8onnx study model.onnx --calib calib.npz --data eval.npz --json study.json --csv study.csv --plot plots/
    """

    if plot_dir:
        output_folder(plot_dir, "Plot folder")
    plots = [(f"the plot {name}", pathlib.Path(plot_dir) / name) for name in PLOT_FILES] if plot_dir else []
    check_paths(
        model_reads("the input model", model) + [("the calibration data", calib), ("the evaluation data", data)],
        [("the JSON output", json_out), ("the CSV output", csv_out), *plots],
    )
    t0 = time.perf_counter()
    result = run_study(
        model,
        calib,
        data,
        max_samples=max_samples,
        techniques=techniques,
        metric=metric,
        run=run_options(running),
    )
    click.echo(result.table())
    write_outputs(result, json_out, csv_out)
    for path in write_plots(result, plot_dir) if plot_dir else []:
        click.echo(f"wrote {path}")
    click.echo(f"done in {time.perf_counter() - t0:.1f}s")


@main.command()
@click.argument("model", type=click.Path())
@click.option("--calib", type=click.Path(), help="Calibration data for the scales (.npz, folder, or text).")
@click.option(
    "--stats", type=click.Path(dir_okay=False), help="Statistics from `fp8onnx calibrate`, instead of --calib."
)
@click.option("--data", type=click.Path(), help="Data to measure on (default: the calibration data).")
@click.option("--format", "fmt", type=click.Choice(_FORMATS, case_sensitive=False), default="e4m3fn", show_default=True)
@click.option("--scaling", type=click.Choice(_SCALINGS, case_sensitive=False), default="amax", show_default=True)
@click.option("--activations", type=click.Choice(ACTIVATION_MODES), default="static", show_default=True)
@_per_channel_option
@click.option(
    "--op-types", callback=_csv, default="MatMul,Gemm", show_default=True, help="Comma-separated op types to measure."
)
@click.option("--activation-matmuls", is_flag=True, help="Also measure MatMuls whose both inputs are activations.")
@click.option(
    "--eval", "eval_data", type=click.Path(), help="Held-out data: score the lowest-SQNR nodes on the end metric."
)
@refine_option
@click.option("--top", type=click.IntRange(min=1), help="Show only the N most sensitive nodes.")
@click.option(
    "--budget",
    is_flag=True,
    help="Also the FP8 error budget: per node, its share of the summed error, the weight's and the activation's "
    "errors alone, and of the activation's the part from clipped or below-normal values (range) vs rounding "
    "(mantissa); three more shadows a node in the same pass.",
)
@weight_block_size_option
@_batch_size_option
@_workers_options
@_provider_option
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write every node's SQNR as JSON.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write sensitivity.png into this folder.")
@metric_option
@fallback_option
@_run
@_text_options("calib", "data", "eval_data")
def sensitivity(model, **params):
    """Rank the nodes `quantize` would quantize by the error each contributes alone: the SQNR of its
    output when only it is in FP8, measured for every node in one pass over the data.

    \b
    Example:
      fp8onnx sensitivity model.onnx --calib calib.npz --top 10
      fp8onnx sensitivity model.onnx --calib calib.npz --data eval.npz --json sens.json --plot plots/
      fp8onnx sensitivity model.onnx --calib calib.npz --eval eval.npz --refine 8  # end-metric gain of the top 8
    """

    calib, stats, data, eval_data = (params.pop(k) for k in ("calib", "stats", "data", "eval_data"))
    json_out, plot_dir = params.pop("json_out"), params.pop("plot_dir")
    if plot_dir:
        output_folder(plot_dir, "Plot folder")
    plot = pathlib.Path(plot_dir) / "sensitivity.png" if plot_dir else None
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", calib), ("the statistics file", stats), ("the data", data)]
        + [("the evaluation data", eval_data)],
        [("the JSON output", json_out), ("the plot", plot)],
    )
    config, run = recipe_options(params), run_options(params)
    result = run_sensitivity(
        model,
        calib,
        data,
        config=config,
        stats=stats,
        eval_data=eval_data,
        scoring=Scoring(
            REFINE_DEFAULTS["sensitivity"] if params["refine"] is None else params["refine"], params["metric"]
        ),
        budget=params["budget"],
        run=run,
    )
    click.echo(result.table(params["top"]))
    if json_out:
        write_json(result, json_out)
    if plot:
        measured = [n for n in result.nodes if n.sqnr_db is not None]
        sensitivity_bars([n.name for n in measured], [n.sqnr_db for n in measured], plot)
        click.echo(f"wrote {plot}")
