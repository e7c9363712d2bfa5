"""``fp8onnx zoo`` and ``train-study``: the papers' experiments over many models and in training."""

from __future__ import annotations

import math
import pathlib
import sys
import time

import click

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli.common import (
    _FLOATS,
    _batch_size_option,
    _provider_option,
    _run,
    _run_options,
    _workers_options,
    main,
)
from fp8onnx.experiments.zoo import find_models, zoo_configs
from fp8onnx.experiments.zoo import zoo as run_zoo
from fp8onnx.experiments.zoo_results import write_outputs, write_plot
from fp8onnx.graph.guard import check_paths, model_reads, output_folder
from fp8onnx.graph.model_io import write_text_atomic as write


@main.command()
@click.argument("source", type=click.Path())
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for the results: cells/ (one JSON per model and configuration; a finished cell is not rerun), "
    "zoo.json, zoo.csv.",
)
@click.option("--configs", help="Comma-separated configuration labels to run (default: all of them; see --list).")
@click.option("--list", "list_configs", is_flag=True, help="Print the configuration labels and exit.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the pass rates per configuration as a PNG.")
@_batch_size_option
@_workers_options
@_provider_option
@_run
def zoo(source, out, configs, list_configs, plot, batch_size, workers, ray_address, provider):
    """Formats and scaling methods across a zoo of models: the share of models that pass.

    SOURCE is a folder (its *.onnx files and its subfolders holding model.onnx) or a text file listing
    models, one per line. Each model brings its own data: NAME.calib.npz and NAME.eval.npz beside
    NAME.onnx (or .txt/.jsonl, or folders), else calib.npz and eval.npz in its folder. With --workers
    or --ray each model is a Ray task (rerun if its worker dies).

    \b
    Example:
      fp8onnx zoo models/zoo/ -o zoo-results/ --workers 2 --plot zoo-results/pass_rates.png
    """

    every = zoo_configs()
    if list_configs:
        for label, group, _ in every:
            click.echo(f"{label}  ({group})")
        return
    chosen = every
    if configs:
        wanted = [c.strip() for c in configs.split(",") if c.strip()]
        known = {label for label, _, _ in every}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise Fp8OnnxError(f"Unknown zoo configuration {unknown[0]!r}; `fp8onnx zoo --list` shows them.")
        chosen = [c for c in every if c[0] in wanted]
    models = find_models(source)
    reads = []
    for m in models:
        reads += model_reads(f"the zoo model {m.name!r}", m.model)
        reads += [(f"the calibration data of {m.name!r}", m.calib), (f"the evaluation data of {m.name!r}", m.data)]
    cells = pathlib.Path(out, "cells").resolve()
    for label, path in reads:
        if cells in pathlib.Path(path).resolve().parents:
            raise Fp8OnnxError(f"{label.capitalize()} {str(path)!r} lies in the output's cells folder {str(cells)!r}.")
    writes = [("the JSON output", pathlib.Path(out, "zoo.json")), ("the CSV output", pathlib.Path(out, "zoo.csv"))]
    output_folder(out)
    check_paths(reads, writes + ([("the plot", plot)] if plot else []))
    t0 = time.perf_counter()
    result = run_zoo(
        source, out, configs=chosen, run=_run_options(batch_size, provider, workers=workers, ray_address=ray_address)
    )
    click.echo(result.table())
    for path in write_outputs(result, out) + ([write_plot(result, plot)] if plot else []):
        click.echo(f"wrote {path}")
    click.echo(f"done in {time.perf_counter() - t0:.1f}s")


@main.command("train-study")
@click.option("--task", type=click.Choice(["decoder", "classify"]), default="decoder", show_default=True)
@click.option("--steps", default=200, show_default=True, type=click.IntRange(min=2), help="Training steps per run.")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(min=1), help="Seeds per FP8 setting.")
@click.option(
    "--scales",
    type=_FLOATS,
    help="CSCALE constant scales (default 2^-12, 2^-10, ..., 2^8; a power of two each, e.g. 0.0625,1,16).",
)
@click.option("--margin", default=0, show_default=True, type=int, help="FP8-AMAX exponent-bias margin.")
@click.option("--max-minutes", type=click.FloatRange(min=0), help="Start no run after this many minutes.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write every run as JSON.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write one row per run as CSV.")
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False),
    help="Write loss curves, the CSCALE window and scale-bias histograms.",
)
@click.option(
    "--deploy",
    "deploy_dir",
    type=click.Path(file_okay=False),
    help="Export the first seed's FP32 and FP8-AMAX models here; compare FP8-trained with post-training FP8.",
)
@_run
def train_study(task, steps, seeds, scales, margin, max_minutes, json_out, csv_out, plot_dir, deploy_dir):
    """Train with FP32, bf16, FP8-AMAX and FP8-CSCALE (a sweep of constant scales) and compare.

    The FP8 LLM paper's training comparison, emulated on the CPU (torch float8 casts): which constant
    scales converge, against per-tensor amax scaling, over several seeds.

    \b
    Example:
      fp8onnx train-study --steps 300 --json train.json --csv train.csv --plot plots/
    """
    # here, not at the top: train-study trains in torch, an optional dependency (the [train] extra)
    from fp8onnx.experiments.train_study import DEFAULT_SCALES, to_json_text, write_plots
    from fp8onnx.experiments.train_study import train_study as run

    check_paths([], [("the JSON output", json_out), ("the CSV output", csv_out)])
    if scales and any(s <= 0 or not math.log2(s).is_integer() for s in scales):
        raise Fp8OnnxError(f"--scales must be powers of two, got {','.join(map(str, scales))}.")
    show = (lambda label: click.echo(f"  {label}", err=True)) if sys.stderr.isatty() else None
    result = run(
        task,
        steps=steps,
        seeds=tuple(range(seeds)),
        scales=tuple(scales) if scales else DEFAULT_SCALES,
        margin=margin,
        max_minutes=max_minutes,
        deploy=deploy_dir,
        progress=show,
    )
    click.echo(result.table())
    if json_out:
        write(json_out, to_json_text(result))
    if csv_out:
        write(csv_out, result.to_csv())
    if plot_dir:
        for path in write_plots(result, plot_dir):
            click.echo(f"wrote {path}")
