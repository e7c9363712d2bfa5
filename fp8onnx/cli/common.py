"""What every command shares: the ``fp8onnx`` group, exit codes and signals, logging, and the
options several commands take."""

from __future__ import annotations

import functools
import logging
import signal
import sys
import traceback
from typing import ClassVar

import click
from click.core import ParameterSource

from fp8onnx.base.errors import Fp8OnnxError, printable
from fp8onnx.base.progress import close_all
from fp8onnx.base.scratch import drain
from fp8onnx.base.version import __version__
from fp8onnx.data.feeds import TextSource, is_text
from fp8onnx.graph.run_settings import BATCH_MEMORY, DEFAULT_BATCH, PROVIDERS, RAY_TIMEOUT, WEIGHT_MEMORY, RunOptions
from fp8onnx.numerics.formats import Fp8Format
from fp8onnx.numerics.scaling import Scaling
from fp8onnx.settings.choices import DEFAULT_OP_TYPES, PRECISIONS

_FORMATS = [f.value for f in Fp8Format]
_SCALINGS = [s.value for s in Scaling]


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM/SIGHUP: the stack unwinds as on Ctrl-C (finally blocks and
    context managers remove temporary files), then the command exits with 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOPPED: list[int] = []  # the signals that stopped the command, even where Python could not raise them


def _stop(signum, frame):
    # Further TERM/HUP would interrupt the cleanup that is about to run; it is short, so they wait.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _STOPPED.append(signum)  # raised in a finaliser (a generator's close) the exception is lost; this is not
    raise Stopped(signum)


def _unraisable(hook):
    """No 'Exception ignored ... Traceback' for a stop Python could not raise (in a generator's finaliser):
    it is not lost, the command ends with 128 + N after its step."""
    return lambda info: None if isinstance(info.exc_value, KeyboardInterrupt) else hook(info)


def _install_signal_handlers(ctx: click.Context) -> None:
    """SIGTERM (timeout, docker stop, CI, Slurm) and SIGHUP get the cleanup Ctrl-C gets, and Ctrl-C is
    noted like them, unless the embedding program installed handlers of its own; the previous handlers
    return when the command ends."""
    _STOPPED.clear()  # a command run in this process before (tests, notebooks) does not stop this one
    defaults = {signal.SIGINT: signal.default_int_handler, **dict.fromkeys((signal.SIGTERM, signal.SIGHUP))}
    for sig, default in defaults.items():
        try:
            previous = signal.getsignal(sig)
            if previous == (default or signal.SIG_DFL) or getattr(previous, "fp8onnx_late", False):  # entry()'s
                signal.signal(sig, _stop)
                ctx.call_on_close(lambda sig=sig, previous=previous: signal.signal(sig, previous))
        except ValueError:  # not the main thread: leave it
            pass
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable(previous_hook)
    ctx.call_on_close(lambda: setattr(sys, "unraisablehook", previous_hook))


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
    """Fp8OnnxError: one line on stderr, exit code 2 (with --debug after its traceback and its cause)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        debug = ctx.find_root().params.get("debug", False)
        try:
            result = fn(*args, **kwargs)
            if _STOPPED:  # a signal Python could not raise where it landed: the command stops here
                raise Stopped(_STOPPED[0])
            return result
        except BaseException as exc:
            close_all()  # a bar the error left mid-way would share the message's line
            if isinstance(exc, KeyboardInterrupt):
                drain()  # what the interrupted step had not removed yet (fp8onnx.base.scratch)
            if isinstance(exc, Fp8OnnxError):
                if debug:  # the error behind the sentence (onnxruntime's, protobuf's): ``from exc`` keeps it
                    traceback.print_exception(exc, file=sys.stderr)
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
@click.option(
    "--debug", is_flag=True, help="Show tracebacks: of internal errors, and of errors with the error behind them."
)
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
    """--workers / --ray / --ray-timeout: statistics batches on Ray actors (the [ray] extra)."""
    fn = click.option(
        "--ray-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=RAY_TIMEOUT,
        show_default=True,
        metavar="SECONDS",
        expose_value=False,  # read by _run_options from the context: every command takes it alike
        callback=lambda ctx, param, value: ctx.meta.__setitem__("fp8onnx_ray_timeout", value),
        help="With --ray: how long to try to reach the address before saying nothing answers there.",
    )(fn)
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
    help="fp16 / bf16: the unquantized part of the graph runs in float16 / bfloat16 (inputs and outputs kept as they "
    "were); calibrate with the --precision you quantize with.",
)
_provider_option = click.option(
    "--provider",
    type=click.Choice(PROVIDERS, case_sensitive=False),
    default="auto",
    show_default=True,
    help="onnxruntime execution provider: auto picks CUDA when onnxruntime-gpu sees a GPU.",
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
        ray_timeout=getattr(click.get_current_context(silent=True), "meta", {}).get("fp8onnx_ray_timeout", RAY_TIMEOUT),
    )


def _text_options(*names: str):
    """--tokenizer / --seq-len / --stride for a command's data options ``names``: each of them that names a
    text file (.txt, .jsonl) reaches the library as a :class:`~fp8onnx.data.feeds.TextSource` with these settings."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, tokenizer=None, seq_len=None, stride=None, **kwargs):
            if tokenizer is not None or seq_len is not None or stride is not None:
                texts = [n for n in names if kwargs.get(n) is not None and is_text(kwargs[n])]
                if not texts:
                    raise Fp8OnnxError(
                        "--tokenizer, --seq-len and --stride apply to text data (.txt, .jsonl); this command was "
                        "given none."
                    )
                for name in texts:
                    kwargs[name] = TextSource(kwargs[name], tokenizer, seq_len, stride=stride)
            return fn(*args, **kwargs)

        wrapper = click.option(
            "--stride",
            type=click.IntRange(min=1),
            help="Text windows move on and score this many tokens (sliding-window perplexity) [default: a window].",
        )(wrapper)
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
