"""The ``fp8onnx`` command line: a thin layer over the Python API that prints and sets exit codes.

Exit codes: 0 success; 2 bad usage or bad input (one sentence naming the file, tensor or node);
1 an internal error (a bug: run with --debug for the traceback, and report it); 128 + N when
stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP). SIGTERM and SIGHUP unwind like Ctrl-C,
so every temporary file and spill folder is removed and a previous output stays as it was.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import pathlib
import signal
import sys
import tempfile
import time
from typing import ClassVar

import click
from click.core import ParameterSource

from . import __version__, convert_fp16
from . import calibrate as api_calibrate
from . import compare as api_compare
from . import inspect as api_inspect
from . import quantize as api_quantize
from . import study as run_study
from .api import inspect_summary
from .compare import GENERATE_PROMPTS, GENERATE_TOKENS, METRICS
from .config import (
    ACTIVATION_MODES,
    DEFAULT_OP_TYPES,
    EMBEDDING_MODES,
    PRECISIONS,
    PRESETS,
    WEIGHT_ROUNDINGS,
    QuantizeConfig,
)
from .data import TextSource, is_text
from .errors import Fp8OnnxError, printable
from .formats import Fp8Format
from .guard import check_paths, model_reads, model_writes, output_folder
from .model_io import write_text_atomic
from .phases import process_age
from .phases import table as phases_table
from .progress import close_all
from .runtime import BATCH_MEMORY, DEFAULT_BATCH, PROVIDERS, WEIGHT_MEMORY, RunOptions
from .scaling import Scaling
from .targets import TARGETS

_FORMATS = [f.value for f in Fp8Format]
_SCALINGS = [s.value for s in Scaling]


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM/SIGHUP: the stack unwinds as on Ctrl-C (finally blocks and
    context managers remove temporary files), then the command exits with 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame):
    # Further TERM/HUP would interrupt the cleanup that is about to run; it is short, so they wait.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def _install_signal_handlers(ctx: click.Context) -> None:
    """SIGTERM (timeout, docker stop, CI, Slurm) and SIGHUP get the cleanup Ctrl-C gets, unless the
    embedding program installed handlers of its own; the previous handlers return when the command ends."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_DFL:
                signal.signal(sig, _stop)
                ctx.call_on_close(lambda sig=sig, previous=previous: signal.signal(sig, previous))
        except ValueError:  # not the main thread: leave it
            pass


class _Floats(click.ParamType):
    """Comma-separated numbers, e.g. 0.485,0.456,0.406."""

    name = "FLOATS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return tuple(float(v) for v in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)


_FLOATS = _Floats()


def _run(fn):
    """Turn Fp8OnnxError into one line on stderr and exit code 2; keep tracebacks for --debug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        debug = ctx.find_root().params.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            close_all()  # a bar the error left mid-way would share the message's line
            if isinstance(exc, Fp8OnnxError):
                click.echo(f"fp8onnx: error: {printable(exc)}", err=True)
                ctx.exit(2)
            if isinstance(exc, KeyboardInterrupt):
                signum = getattr(exc, "signum", signal.SIGINT)
                click.echo(f"fp8onnx: interrupted ({signal.Signals(signum).name})", err=True)
                ctx.exit(128 + signum)
            if debug or not isinstance(exc, Exception):  # click's own exits pass through
                raise
            click.echo(
                f"fp8onnx: internal error: {type(exc).__name__}: {exc} (rerun with --debug and report it)", err=True
            )
            ctx.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="fp8onnx")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
def main(verbose: int, debug: bool) -> None:
    """FP8 quantization of ONNX models for ONNX Runtime.

    \b
    Examples:
      fp8onnx demo
      fp8onnx quantize model.onnx --calib calib.npz -o model.fp8.onnx
      fp8onnx compare model.onnx model.fp8.onnx --data eval.npz
    """
    _install_signal_handlers(click.get_current_context())
    _configure_logging(click.get_current_context(), verbose, debug)


# Libraries whose warnings concern their own steps (e.g. onnx_ir: "shape inference failed", with a
# traceback), not the user's result: shown from -v on, one line each like fp8onnx's own.
_THIRD_PARTY = ("onnx_ir", "onnxscript", "onnx", "onnxruntime")


class _OneLine(logging.Formatter):
    """``LEVEL logger: first line of the message``; tracebacks only with --debug."""

    def __init__(self, debug: bool):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if self.debug:
            return super().format(record)
        lines = record.getMessage().strip().splitlines()
        return f"{record.levelname} {record.name}: {printable(lines[0] if lines else '')}"


class _SmoothAlpha(click.ParamType):
    """--smooth: an alpha in [0, 1], or "off" (None)."""

    name = "alpha"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float):
            return value
        if str(value).lower() in ("off", "none"):
            return None
        try:
            alpha = float(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number in [0, 1] nor 'off'.", param, ctx)
        if not 0 <= alpha <= 1:
            self.fail(f"{alpha:g} is not in the range 0<=x<=1.", param, ctx)
        return alpha


def _configure_logging(ctx: click.Context, verbose: int, debug: bool) -> None:
    """One handler on the root logger for the command's duration (removed when it ends)."""
    level = logging.WARNING - 10 * min(verbose, 2)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(debug))
    root = logging.getLogger()
    root.addHandler(handler)
    ctx.call_on_close(lambda: root.removeHandler(handler))
    root.setLevel(level)
    for name in _THIRD_PARTY:
        logging.getLogger(name).setLevel(level if verbose or debug else logging.ERROR)
    import onnxruntime

    onnxruntime.set_default_logger_severity(3 if verbose < 2 else 2)  # its C++ warnings go to stderr directly


_batch_size_option = click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help=f"Samples per onnxruntime run [default: {DEFAULT_BATCH}; calibration takes fewer where one batch "
    "would need more than --batch-memory].",
)
_batch_memory_option = click.option(
    "--batch-memory",
    type=click.IntRange(min=1),
    default=BATCH_MEMORY >> 20,
    show_default=True,
    metavar="MiB",
    help="Without --batch-size, calibration batches are sized to take about this much memory each "
    "(measured on the first sample).",
)


def _workers_options(fn):
    """--workers / --ray: statistics batches on Ray actors (the [ray] extra)."""
    fn = click.option(
        "--ray",
        "ray_address",
        metavar="ADDRESS",
        help="Run on this Ray cluster (e.g. auto, or ray://head:10001) instead of a local one.",
    )(fn)
    return click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Ray workers (each one onnxruntime session) that share the calibration batches; the "
        "statistics and the output are the same as with 1. Needs the [ray] extra.",
    )(fn)


_weight_memory_option = click.option(
    "--weight-memory",
    type=click.IntRange(min=1),
    default=WEIGHT_MEMORY >> 20,
    show_default=True,
    metavar="MiB",
    help="Calibration holds at most about this much of the weights at once; larger models run layer by layer.",
)
_precision_option = click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="model",
    show_default=True,
    help="fp16: the unquantized part of the graph runs in float16 (inputs and outputs kept as they were).",
)
_provider_option = click.option(
    "--provider",
    type=click.Choice(PROVIDERS, case_sensitive=False),
    default="auto",
    show_default=True,
    help="onnxruntime execution provider: auto picks CUDA when onnxruntime-gpu sees a GPU.",
)


_metric_option = click.option(
    "--metric",
    type=click.Choice(METRICS),
    default="auto",
    show_default=True,
    help="The headline compared with FP16: auto is task accuracy with labels, else top-1 agreement for class "
    "scores (named like logits, or computed by a Softmax), else mean cosine; rel-l2 scores 1 - relative L2 "
    "error (regression).",
)


def _run_options(
    batch_size: int | None = None,
    provider: str = "auto",
    weight_memory_mib: int | None = None,
    batch_memory_mib: int | None = None,
    workers: int = 1,
    ray_address: str | None = None,
) -> RunOptions:
    """The runtime knobs of a command, as the library takes them (progress bars on: a person watches)."""
    memory = WEIGHT_MEMORY if weight_memory_mib is None else weight_memory_mib << 20
    per_batch = BATCH_MEMORY if batch_memory_mib is None else batch_memory_mib << 20
    return RunOptions(
        batch_size=batch_size,
        provider=provider,
        weight_memory=memory,
        progress=True,
        batch_memory=per_batch,
        workers=workers,
        ray_address=ray_address,
    )


def _text_options(*names: str):
    """--tokenizer / --seq-len for a command's data options ``names``: each of them that names a text
    file (.txt, .jsonl) reaches the library as a :class:`~fp8onnx.data.TextSource` with these settings."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, tokenizer=None, seq_len=None, **kwargs):
            if tokenizer is not None or seq_len is not None:
                texts = [n for n in names if kwargs.get(n) is not None and is_text(kwargs[n])]
                if not texts:
                    raise Fp8OnnxError(
                        "--tokenizer and --seq-len apply to text data (.txt, .jsonl); this command was given none."
                    )
                for name in texts:
                    kwargs[name] = TextSource(kwargs[name], tokenizer, seq_len)
            return fn(*args, **kwargs)

        wrapper = click.option(
            "--seq-len",
            type=click.IntRange(min=1),
            help="Tokens per sample for text data [default: 128].",
        )(wrapper)
        return click.option(
            "--tokenizer",
            type=click.Path(),
            help="The tokenizer.json for text data [default: the one beside the model, or the text].",
        )(wrapper)

    return decorate


class _Sectioned(click.Command):
    """--help with the options in named sections (``sections``: title -> option names), the rest last:
    a command with many options reads as a few decisions."""

    sections: ClassVar[dict[str, tuple[str, ...]]] = {}

    def format_options(self, ctx, formatter):
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        shown = set()
        for title, names in self.sections.items():
            rows = [records[n] for n in names if records.get(n)]
            shown.update(names)
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        rest = [r for n, r in records.items() if r and n not in shown]
        if rest:
            with formatter.section("Other options"):
                formatter.write_dl(rest)


class _QuantizeCommand(_Sectioned):
    sections: ClassVar[dict[str, tuple[str, ...]]] = {
        "Model, data and output": ("output", "calib", "tokenizer", "seq_len", "preset", "report"),
        "Accuracy": ("eval_data", "accuracy_target", "metric", "max_float_nodes", "refine", "check_data", "stats"),
        "Recipe (what a preset sets; rarely needed by hand)": (
            "fmt",
            "weight_format",
            "activation_format",
            "scaling",
            "margin",
            "percentile",
            "scale",
            "activations",
            "per_channel",
            "op_types",
            "exclude",
            "activation_matmuls",
            "weight_rounding",
            "smooth",
            "bias_correction",
            "float_vocab",
            "float_stem",
            "embeddings",
        ),
        "Deployment target": ("precision", "target", "native_gemm", "fold_at_load"),
        "Running": ("batch_size", "batch_memory", "workers", "ray_address", "weight_memory", "provider"),
    }


def _csv(ctx, param, value):
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else DEFAULT_OP_TYPES


_DEFAULT = ParameterSource.DEFAULT
_PARAM = {"format": "fmt"}  # QuantizeConfig field -> click parameter name, where they differ

_per_channel_option = click.option(
    "--per-channel/--per-tensor",
    default=None,
    help="Weight scales per output channel (DequantizeLinear axis) for every op, or one per tensor for every op. "
    "Default: per channel for Conv/ConvTranspose, per tensor for MatMul/Gemm.",
)


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
    type=click.Choice(_FORMATS, case_sensitive=False),
    default="e4m3fn",
    show_default=True,
    help="Float8 format of weights and activations (e3m4: emulated, for studies only, not deployable).",
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
    help="amax: scale = amax/fmax; pow2: power-of-two scale from the exponent bias; percentile: clip at "
    "--percentile of |x|; mse: clip where the quantization error is least; constant: --scale for all.",
)
@click.option("--margin", type=int, default=0, show_default=True, help="pow2 only: exponent bias margin.")
@click.option(
    "--percentile", type=float, help="percentile only: which percentile of |x| maps to fmax [default: 99.99]."
)
@click.option("--scale", type=float, help="constant only: the scale used for every tensor.")
@click.option(
    "--activations",
    type=click.Choice(ACTIVATION_MODES),
    default="static",
    show_default=True,
    help="static: calibrated scales; dynamic: each batch's amax computed in the graph (no calibration); "
    "dynamic-per-token: one in-graph scale per row, with per-channel weights; none: weight-only FP8.",
)
@_per_channel_option
@_precision_option
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="onnxruntime",
    show_default=True,
    help="tensorrt: only what TensorRT's FP8 takes (E4M3FN, constant scales), checked on the result.",
)
@click.option(
    "--native-gemm",
    is_flag=True,
    help="Lower quantized MatMul/Gemm to com.microsoft.GemmFloat8 (CUDA EP, compute capability >= 8.9).",
)
@click.option(
    "--op-types", callback=_csv, default="MatMul,Gemm", show_default=True, help="Comma-separated: MatMul, Gemm, Conv."
)
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave nodes whose name matches GLOB (repeatable).")
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
@click.option(
    "--bias-correction", is_flag=True, help="Shift each layer's bias to cancel the mean error of its FP8 weights."
)
@click.option(
    "--float-vocab",
    is_flag=True,
    help="Leave vocabulary-sized projections (an lm_head: as many outputs as an embedding table has rows) in float.",
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
@_metric_option
@click.option(
    "--fold-at-load",
    is_flag=True,
    help="onnxruntime-genai folder: its decoder session dequantizes the float8 weights once at load "
    "(session.disable_quant_qdq=1 in genai_config.json): on the CPU, FP32's speed and memory, FP8's file.",
)
@click.option(
    "--refine",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --accuracy-target: score the N lowest-SQNR nodes one by one on --eval first and leave them in "
    "float in order of measured gain (N+1 more evaluations).",
)
@_run
@_text_options("calib", "eval_data", "check_data")
def quantize(
    model,
    output,
    calib,
    stats,
    fmt,
    weight_format,
    activation_format,
    scaling,
    margin,
    percentile,
    scale,
    activations,
    per_channel,
    precision,
    target,
    native_gemm,
    op_types,
    exclude,
    activation_matmuls,
    preset,
    weight_rounding,
    smooth,
    bias_correction,
    float_vocab,
    float_stem,
    embeddings,
    batch_size,
    batch_memory,
    workers,
    ray_address,
    weight_memory,
    provider,
    report,
    check_data,
    eval_data,
    accuracy_target,
    max_float_nodes,
    metric,
    fold_at_load,
    refine,
):
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
      fp8onnx quantize llama.onnx --calib calib.npz --weight-memory 256 -o llama.fp8.onnx  # layer by layer
    """
    if (eval_data is None) != (accuracy_target is None):
        raise Fp8OnnxError("--accuracy-target and --eval go together: give both or neither.")
    if (max_float_nodes is not None or refine) and accuracy_target is None:
        raise Fp8OnnxError("--max-float-nodes and --refine only apply with --accuracy-target.")
    folder_mode = pathlib.Path(model).is_dir() and not str(output).endswith(".onnx")
    if folder_mode and report:
        for label, folder in (("the output folder", output), ("the export folder", model)):
            if pathlib.Path(folder).resolve() in pathlib.Path(report).resolve().parents:
                raise Fp8OnnxError(f"The report {report!r} lies inside {label} {folder!r}; write it elsewhere.")
    # The library guards what it reads itself; --check's data is read only here.
    check_paths(
        [("the evaluation data", check_data), ("the evaluation data", eval_data)],
        ([] if folder_mode else model_writes("the output model", output)) + [("the report", report)],
    )
    options = dict(
        format=fmt,
        weight_format=weight_format,
        activation_format=activation_format,
        scaling=scaling,
        margin=margin,
        percentile=percentile,
        scale=scale,
        activations=activations,
        per_channel=per_channel,
        precision=precision,
        native_gemm=native_gemm,
        target=target,
        op_types=op_types,
        exclude=exclude,
        activation_matmuls=activation_matmuls,
        weight_rounding=weight_rounding,
        smooth=smooth,
        bias_correction=bias_correction,
        float_vocab=float_vocab,
        float_stem=float_stem,
        embeddings=embeddings,
    )
    if preset:  # the preset's settings, except where the command line says otherwise
        ctx = click.get_current_context()
        given = {k: v for k, v in options.items() if ctx.get_parameter_source(_PARAM.get(k, k)) != _DEFAULT}
        config = QuantizeConfig.for_preset(preset, **given)
    else:
        config = QuantizeConfig(**options)
    t0 = time.perf_counter()
    startup = process_age()
    run = _run_options(batch_size, provider, weight_memory, batch_memory, workers, ray_address)
    if fold_at_load and not folder_mode:
        raise Fp8OnnxError("--fold-at-load applies to an onnxruntime-genai folder written as a folder (-o OUT_DIR).")
    if folder_mode:
        from .exports import quantize_folder

        if accuracy_target is not None or stats or check_data:
            raise Fp8OnnxError(
                "--accuracy-target, --stats and --check take one model: give MODEL/model.onnx, or -o OUT.onnx."
            )
        result = quantize_folder(model, output, calib, config=config, run=run, fold_at_load=fold_at_load)
        click.echo(result.summary())
        if report:
            write_text_atomic(report, json.dumps(result.to_json(), indent=1) + "\n")
        click.echo(f"  done in {time.perf_counter() - t0:.1f}s" + (f"; report in {report}" if report else ""))
        return
    if accuracy_target is not None:
        from .fallback import quantize_to_target

        if stats:
            raise Fp8OnnxError("--accuracy-target measures sensitivity on --calib DATA; --stats cannot stand in.")
        fallback = quantize_to_target(
            model,
            output,
            calib,
            eval_data,
            target=accuracy_target,
            max_float_nodes=max_float_nodes,
            refine=refine,
            config=config,
            report=report,
            metric=metric,
            run=run,
        )
        click.echo(fallback.summary())
    else:
        result = api_quantize(model, output, calib, config=config, stats=stats, report=report, run=run)
        click.echo(result.summary())
        if logging.getLogger("fp8onnx").isEnabledFor(logging.INFO):  # -v
            click.echo(phases_table(result.phases, startup))
    click.echo(f"  done in {time.perf_counter() - t0:.1f}s" + (f"; report in {report}" if report else ""))
    if check_data:
        click.echo(api_compare(model, [output], check_data, run=_run_options(batch_size, provider)).table())


@main.command()
@click.argument("model", type=click.Path())
@click.option(
    "--calib",
    required=True,
    type=click.Path(),
    help="Calibration data: an .npz file, a folder of them, or a .txt/.jsonl text file.",
)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Statistics JSON to write.")
@_batch_size_option
@_batch_memory_option
@_workers_options
@_weight_memory_option
@_provider_option
@_precision_option
@_run
@_text_options("calib")
def calibrate(model, calib, output, batch_size, batch_memory, workers, ray_address, weight_memory, provider, precision):
    """Record activation statistics of MODEL once, for later `quantize --stats`.

    \b
    Example:
      fp8onnx calibrate model.onnx --calib calib.npz -o stats.json
      fp8onnx quantize model.onnx --stats stats.json -o model.fp8.onnx
      fp8onnx calibrate model.onnx --calib calib.npz --precision fp16 -o stats16.json  # for --precision fp16
    """
    stats = api_calibrate(
        model,
        calib,
        output,
        precision=precision,
        run=_run_options(batch_size, provider, weight_memory, batch_memory, workers, ray_address),
    )
    click.echo(
        f"{len(stats.amax)} tensors calibrated on {stats.num_samples} samples "
        f"({stats.num_batches} batches of {stats.batching}); wrote {output}"
    )


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
@_metric_option
@_run
@_text_options("data")
def compare(
    reference,
    candidates,
    data,
    no_fp16,
    generate,
    prompts,
    batch_size,
    workers,
    ray_address,
    provider,
    json_out,
    plot_dir,
    metric,
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
    run = _run_options(batch_size, provider, workers=workers, ray_address=ray_address)
    result = api_compare(
        reference, candidates, data, fp16=not no_fp16, generate=generate, prompts=prompts, metric=metric, run=run
    )
    click.echo(result.table())
    if json_out:
        write_text_atomic(json_out, json.dumps(result.to_json(), indent=1) + "\n")
    if plot:
        from .plots import compare_rows

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
@_run
@_text_options("calib", "data")
def study(
    model, calib, data, max_samples, batch_size, workers, ray_address, provider, json_out, csv_out, plot_dir, techniques
):
    """Run the papers' comparison on MODEL: formats, scaling methods, constant-scale sweep,
    static vs dynamic activations, per-tensor vs per-channel weights; one calibration pass.

    \b
    Example:
      fp8onnx study model.onnx --calib calib.npz --data eval.npz --json study.json --csv study.csv --plot plots/
    """
    from .study import PLOT_FILES, write_outputs, write_plots

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
        run=_run_options(batch_size, provider, workers=workers, ray_address=ray_address),
    )
    click.echo(result.table())
    write_outputs(result, json_out, csv_out)
    for path in write_plots(result, plot_dir) if plot_dir else []:
        click.echo(f"wrote {path}")
    click.echo(f"done in {time.perf_counter() - t0:.1f}s")


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
    from .zoo import find_models, write_outputs, write_plot, zoo_configs
    from .zoo import zoo as run_zoo

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
@click.option(
    "--refine",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="With --eval: how many of the lowest-SQNR nodes to score (one model each, plus the all-FP8 one).",
)
@click.option("--top", type=click.IntRange(min=1), help="Show only the N most sensitive nodes.")
@_batch_size_option
@_workers_options
@_provider_option
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write every node's SQNR as JSON.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write sensitivity.png into this folder.")
@_metric_option
@_run
@_text_options("calib", "data", "eval_data")
def sensitivity(
    model,
    calib,
    stats,
    data,
    fmt,
    scaling,
    activations,
    per_channel,
    op_types,
    activation_matmuls,
    eval_data,
    refine,
    top,
    batch_size,
    workers,
    ray_address,
    provider,
    json_out,
    plot_dir,
    metric,
):
    """Rank the nodes `quantize` would quantize by the error each contributes alone: the SQNR of its
    output when only it is in FP8, measured for every node in one pass over the data.

    \b
    Example:
      fp8onnx sensitivity model.onnx --calib calib.npz --top 10
      fp8onnx sensitivity model.onnx --calib calib.npz --data eval.npz --json sens.json --plot plots/
      fp8onnx sensitivity model.onnx --calib calib.npz --eval eval.npz --refine 8  # end-metric gain of the top 8
    """
    from .fallback import sensitivity as run_sensitivity
    from .sensitivity import write_json

    if plot_dir:
        output_folder(plot_dir, "Plot folder")
    plot = pathlib.Path(plot_dir) / "sensitivity.png" if plot_dir else None
    check_paths(
        model_reads("the input model", model)
        + [("the calibration data", calib), ("the statistics file", stats), ("the data", data)]
        + [("the evaluation data", eval_data)],
        [("the JSON output", json_out), ("the plot", plot)],
    )
    config = QuantizeConfig(
        format=fmt,
        scaling=scaling,
        activations=activations,
        per_channel=per_channel,
        op_types=op_types,
        activation_matmuls=activation_matmuls,
    )
    result = run_sensitivity(
        model,
        calib,
        data,
        config=config,
        stats=stats,
        eval_data=eval_data,
        refine=refine,
        metric=metric,
        run=_run_options(batch_size, provider, workers=workers, ray_address=ray_address),
    )
    click.echo(result.table(top))
    if json_out:
        write_json(result, json_out)
    if plot:
        from . import plots

        measured = [n for n in result.nodes if n.sqnr_db is not None]
        plots.sensitivity_bars([n.name for n in measured], [n.sqnr_db for n in measured], plot)
        click.echo(f"wrote {plot}")


@main.command()
@click.argument("model", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the summary.")
@click.option(
    "--plot", "plot_dir", type=click.Path(file_okay=False), help="Write scale_exponents.png into this folder."
)
@_run
def inspect(model, as_json, plot_dir):
    """Show what is quantized in MODEL: float8 tensors, formats, scales, sizes.

    \b
    Example:
      fp8onnx inspect model.fp8.onnx
      fp8onnx inspect model.fp8.onnx --json > info.json
      fp8onnx inspect model.fp8.onnx --plot plots/
    """
    if plot_dir:
        output_folder(plot_dir, "Plot folder")
        check_paths(
            model_reads("the input model", model), [("the plot", pathlib.Path(plot_dir) / "scale_exponents.png")]
        )
    info = api_inspect(model)
    click.echo(json.dumps(info, indent=1) if as_json else inspect_summary(info))
    if plot_dir:
        from . import plots

        exponents = {"weights": [], "activations": []}
        for t in info["float8_tensors"]:
            if isinstance(t["scale"], float):
                exponents["weights" if t["kind"] == "weight" else "activations"].append(math.log2(t["scale"]))
        path = plots.scale_exponents(exponents, pathlib.Path(plot_dir) / "scale_exponents.png")
        if not as_json:
            click.echo(f"wrote {path}")


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
    from .model_io import write_text_atomic as write
    from .train_study import DEFAULT_SCALES, to_json_text, write_plots
    from .train_study import train_study as run

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


@main.command()
@click.argument("model", type=click.Path())
@click.argument("source", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The .npz to write.")
@click.option(
    "--tokenizer", type=click.Path(), help="A Hugging Face tokenizer.json (default: the one in MODEL's export folder)."
)
@click.option("--seq-len", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens per sample.")
@click.option("--pad", is_flag=True, help="One document per sample, padded/truncated (encoders); default: windows.")
@click.option("--field", default="text", show_default=True, help="The text field of each .jsonl record.")
@click.option("--max-samples", type=click.IntRange(min=1), help="At most this many samples.")
@click.option("--seed", type=int, help="Pick --max-samples at random over the whole source (default: the first ones).")
@click.option("--size", type=click.IntRange(min=1), help="Images: resize the shorter side to this many pixels.")
@click.option("--crop", type=click.IntRange(min=1), help="Images: center crop (default: the input's height/width).")
@click.option("--mean", type=_FLOATS, help="Images: per-channel mean in [0, 1] units, e.g. 0.485,0.456,0.406.")
@click.option("--std", type=_FLOATS, help="Images: per-channel std in [0, 1] units, e.g. 0.229,0.224,0.225.")
@click.option("--layout", type=click.Choice(["nchw", "nhwc"]), help="Images: default from the input's shape.")
@click.option("--channels", type=click.Choice(["rgb", "bgr"]), default="rgb", show_default=True, help="Images.")
@click.option("--sample-rate", type=click.IntRange(min=1), help="Audio: resample to this rate (default 16000).")
@click.option("--chunk", type=click.IntRange(min=1), help="Audio: samples per feed (default: one second).")
@_run
def data(model, source, output, tokenizer, seq_len, pad, field, max_samples, seed, **media):
    """Make calibration/evaluation data for MODEL from text, images or audio.

    SOURCE is a .txt/.jsonl text file, an image file or folder (subfolders = classes: `labels`), or
    a .wav/.flac/.ogg file or folder. MODEL is an .onnx file or an export folder (model.onnx beside
    tokenizer.json / preprocessor_config.json, which give the defaults). Every model input is filled
    in: token ids, attention mask, token type ids, position ids, empty KV caches for prefill; windows
    of text also get next-token `labels` for `compare`.

    \b
    Examples:
      fp8onnx data model.onnx corpus.txt --tokenizer tokenizer.json -o calib.npz --max-samples 256
      fp8onnx data export_dir/ sentences.txt --pad --seq-len 128 -o eval.npz
      fp8onnx data resnet.onnx images/ --size 256 --crop 224 --mean 0.485,0.456,0.406 -o calib.npz
      fp8onnx data wav2vec.onnx clips/ --sample-rate 16000 --chunk 16000 -o calib.npz
    """
    from .media import AudioOptions, ImageOptions
    from .sources import make_data

    image = ImageOptions(media["size"], media["crop"], media["mean"], media["std"], media["layout"], media["channels"])
    audio = AudioOptions(media["sample_rate"], media["chunk"])

    summary = make_data(
        model,
        source,
        output,
        tokenizer=tokenizer,
        seq_len=seq_len,
        pad=pad,
        field=field,
        max_samples=max_samples,
        seed=seed,
        image=image,
        audio=audio,
        progress=sys.stderr.isatty(),
    )
    click.echo("\n".join(summary.lines()))


@main.command()
@click.argument("model", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@_run
def fp16(model, output):
    """Write the FP16 baseline of MODEL (float32 inputs and outputs kept: a drop-in).

    \b
    Example:
      fp8onnx fp16 model.onnx -o model.fp16.onnx
    """
    out = convert_fp16(model, output)
    click.echo(f"wrote {out}")


@main.command()
@click.option("--out-dir", type=click.Path(file_okay=False), help="Keep the models here (default: a temporary folder).")
@_provider_option
@_run
def demo(out_dir, provider):
    """Quantize the bundled sample decoder and compare FP32, FP16 and FP8 on held-out text.

    \b
    Example:
      fp8onnx demo
    """
    from importlib import resources

    sample = pathlib.Path(str(resources.files("fp8onnx.models") / "decoder"))
    model, calib, data = sample / "decoder.onnx", sample / "calib.npz", sample / "eval.npz"
    if not model.exists():
        raise Fp8OnnxError(f"The sample model {str(model)!r} is missing from this install.")
    with tempfile.TemporaryDirectory(prefix="fp8onnx-demo-") as tmp:
        folder = pathlib.Path(out_dir) if out_dir else pathlib.Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / "decoder.fp8.onnx"
        click.echo("Sample: a 4-layer Llama-style decoder (RMSNorm, rotary, SwiGLU) trained on the Python docs;")
        click.echo("task: next-byte prediction on held-out documentation topics.\n")
        t0 = time.perf_counter()
        result = api_quantize(model, out, calib, run=_run_options(provider=provider))
        click.echo(result.summary())
        cmp = api_compare(model, [out], data, run=_run_options(provider=provider))
        click.echo("\n" + cmp.table())
        fp8 = cmp.rows[-1]
        verdict = "within" if fp8.passes_llm else "NOT within"
        click.echo(
            f"\nFP8 next-byte accuracy {fp8.accuracy:.4f} is {fp8.ratio_to_fp16:.2%} of FP16's: {verdict} "
            f"the 99.5% criterion. ({time.perf_counter() - t0:.1f}s)"
        )
        if out_dir:
            click.echo(f"models kept in {folder}")


def entry() -> None:
    """The console script: run the command, flush what it printed and logged, and leave without
    tearing the interpreter down. Freeing the imported modules (sympy's caches, through onnx_ir, and
    onnxscript) took 0.15 s at every exit, 3% of quantizing all-MiniLM-L6-v2. Every file a command
    writes is closed (atomically renamed) before it returns, so nothing is left for exit handlers."""
    try:
        main()  # click's standalone mode ends in SystemExit, whatever happened
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    if "fp8onnx.distributed" in sys.modules:  # Ray workers and a local Ray started for them
        sys.modules["fp8onnx.distributed"].close_all()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
            pass
    if sys.getprofile() is not None or sys.gettrace() is not None:  # cProfile, coverage: let them write
        sys.exit(code)
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
