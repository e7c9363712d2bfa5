"""``fp8onnx calibrate``, ``inspect``, ``data``, ``fp16`` and ``demo``."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import click

from fp8onnx import calibrate as api_calibrate
from fp8onnx import compare as api_compare
from fp8onnx import convert_fp16
from fp8onnx import inspect as api_inspect
from fp8onnx import quantize as api_quantize
from fp8onnx.accuracy.plots import scale_exponents
from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.scratch import temporary_dir
from fp8onnx.cli.common import (
    _FLOATS,
    _batch_memory_option,
    _batch_size_option,
    _precision_option,
    _provider_option,
    _run,
    _run_options,
    _text_options,
    _weight_memory_option,
    _workers_options,
    main,
)
from fp8onnx.data.media import AudioOptions, ImageOptions
from fp8onnx.data.sources import make_data
from fp8onnx.data.text import TextOptions
from fp8onnx.graph.guard import check_paths, model_reads, output_folder
from fp8onnx.workflows.api import inspect_summary


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
@click.argument("model", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the summary.")
@click.option(
    "--plot", "plot_dir", type=click.Path(file_okay=False), help="Write scale_exponents.png into this folder."
)
@click.option(
    "--target",
    type=click.Choice(["onnxruntime", "onnxruntime-cuda"]),
    help="Also predict where each node runs: on onnxruntime's CPU EP, or its CUDA EP (CUDA, handed to the "
    "CPU EP, or failing at load or at Run), from the providers' kernel tables.",
)
@_run
def inspect(model, as_json, plot_dir, target):
    """Show what is quantized in MODEL: float8 tensors, formats, scales, sizes.

    \b
    Example:
      fp8onnx inspect model.fp8.onnx
      fp8onnx inspect model.fp8.onnx --json > info.json
      fp8onnx inspect model.fp8.onnx --plot plots/
      fp8onnx inspect model.cuda.onnx --target onnxruntime-cuda   # where each node will run
    """
    if plot_dir:
        output_folder(plot_dir, "Plot folder")
        check_paths(
            model_reads("the input model", model), [("the plot", pathlib.Path(plot_dir) / "scale_exponents.png")]
        )
    info = api_inspect(model, target)
    click.echo(json.dumps(info, indent=1) if as_json else inspect_summary(info))
    if plot_dir:
        exponents = {"weights": [], "activations": []}
        for t in info["float8_tensors"]:
            if isinstance(t["scale"], float):
                exponents["weights" if t["kind"] == "weight" else "activations"].append(math.log2(t["scale"]))
        path = scale_exponents(exponents, pathlib.Path(plot_dir) / "scale_exponents.png")
        if not as_json:
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
@click.option(
    "--stride",
    type=click.IntRange(min=1),
    help="Windows move on and score this many tokens; the rest is context (sliding-window perplexity).",
)
@click.option("--size", type=click.IntRange(min=1), help="Images: resize the shorter side to this many pixels.")
@click.option("--crop", type=click.IntRange(min=1), help="Images: center crop (default: the input's height/width).")
@click.option("--mean", type=_FLOATS, help="Images: per-channel mean in [0, 1] units, e.g. 0.485,0.456,0.406.")
@click.option("--std", type=_FLOATS, help="Images: per-channel std in [0, 1] units, e.g. 0.229,0.224,0.225.")
@click.option("--layout", type=click.Choice(["nchw", "nhwc"]), help="Images: default from the input's shape.")
@click.option("--channels", type=click.Choice(["rgb", "bgr"]), default="rgb", show_default=True, help="Images.")
@click.option("--sample-rate", type=click.IntRange(min=1), help="Audio: resample to this rate (default 16000).")
@click.option("--chunk", type=click.IntRange(min=1), help="Audio: samples per feed (default: one second).")
@_run
def data(model, source, output, **params):
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
      fp8onnx data llm.onnx ptb.test.txt --seq-len 512 --stride 256 -o ptb.npz   # sliding-window perplexity
      fp8onnx data resnet.onnx images/ --size 256 --crop 224 --mean 0.485,0.456,0.406 -o calib.npz
      fp8onnx data wav2vec.onnx clips/ --sample-rate 16000 --chunk 16000 -o calib.npz
    """

    p = params
    image = ImageOptions(p["size"], p["crop"], p["mean"], p["std"], p["layout"], p["channels"])
    audio = AudioOptions(p["sample_rate"], p["chunk"])
    text = TextOptions(p["tokenizer"], p["seq_len"], p["pad"], p["field"], stride=p["stride"])
    sampled = {"max_samples": p["max_samples"], "seed": p["seed"]}
    summary = make_data(
        model, source, output, text=text, image=image, audio=audio, **sampled, progress=sys.stderr.isatty()
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
    with temporary_dir("fp8onnx-demo-") as tmp:
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
            f"\nFP8 next-byte accuracy {fp8.accuracy:.4f} is {fp8.ratio_to_fp16:.2%}"
            + (f" (±{fp8.ratio_noise:.2%})" if fp8.ratio_noise else "")
            + f" of FP16's: {verdict} "
            f"the 99.5% criterion. ({time.perf_counter() - t0:.1f}s)"
        )
        if out_dir:
            click.echo(f"models kept in {folder}")
