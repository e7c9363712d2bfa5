"""onnxruntime sessions: provider choice and the session options FP8 graphs need.

On the CPU EP, ``session.disable_quant_qdq`` is set: its QDQ fusion turns a float8
DequantizeLinear -> Gemm into QGemm, which has no float8 kernel (onnxruntime issue 22269).
Everything else stays at ORT's defaults, because that is how users run the result. With that option
the CPU EP's constant folding dequantizes each float8 weight once at load, held in float beside the
float8 copy; where that would not fit the memory available (:func:`folds_at_load`), a session can
leave the weights in float8, dequantized at every run (``fold=False``).

What the CPU EP needs from a model first (:mod:`fp8onnx.graph.cpu_ep`): CUDA-only ops that fp8onnx
writes emulated (in memory; the file stays as it is), float16 Conv graphs kept from a transformer
that crashes on them.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx_ir as ir
import onnx_ir.external_data
import onnxruntime as ort

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.graph import known
from fp8onnx.graph.cpu_ep import cuda_only_ops, emulated, float16_conv
from fp8onnx.graph.providers import CPU as _CPU
from fp8onnx.graph.providers import CUDA as _CUDA
from fp8onnx.graph.run_settings import resolve_provider

__all__ = [
    "FOLD_SHARE",
    "available_memory",
    "dequantized_bytes",
    "folds_at_load",
    "inline_proto",
    "make_session",
    "median_latency_ms",
    "portable_model",
    "qdq_fusion_warning",
    "session_for_model",
    "session_from_portable",
    "weight_bytes",
    "worker_session",
]

logger = logging.getLogger(__name__)
# Weights this big or bigger go to onnxruntime as arrays rather than inside the serialized model.
HANDOVER_BYTES = 1 << 10
_IN_MEMORY = "fp8onnx-in-memory"  # the external-data location of those (never a file)
_NUMPY_DTYPES = {
    ir.DataType.FLOAT,
    ir.DataType.FLOAT16,
    ir.DataType.DOUBLE,
    ir.DataType.INT8,
    ir.DataType.UINT8,
    ir.DataType.INT16,
    ir.DataType.INT32,
    ir.DataType.INT64,
    ir.DataType.BOOL,
}


def _options(
    provider: str, arena: bool = True, optimize: bool = True, instrumented: bool = False, threads: int = 0
) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads  # 0: onnxruntime's default, one per core
    if instrumented:
        # A graph that reports statistics of many of its tensors (calibration, Hessians, sensitivity).
        # ORT's default order ran those Abs/ReduceMax branches after the whole model, so every measured
        # tensor stayed alive to the end; the priority-based order runs each right after its tensor.
        # SmolLM2-135M, 16 x 128 tokens: 3.19 GB of activations (1.65 GB without the memory pattern,
        # which only doubles what the first run held) vs 0.21 GB, at the same speed.
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        so.enable_mem_pattern = False
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    # Without the arena a session holds about half the memory at the same speed (measured on
    # all-MiniLM-L6-v2, CPU EP): what compare needs when it keeps many sessions open at once.
    so.enable_cpu_mem_arena = arena
    if provider == "cpu":
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    return so


def qdq_fusion_warning(path: str | os.PathLike) -> str | None:
    """The sentence for a written model that the installed onnxruntime refuses in a plain CPU session at
    its default optimisation level, tried there (before 1.32 only: onnxruntime-gpu's newest is 1.31.1,
    whose QDQ fusions turn some float8 Q/DQ into MatMulIntegerToFloat / QLinearMatMul, which have no
    float8 kernel); None where it loads, or where the runtime is 1.32 or newer."""
    version = tuple(int(p) for p in ort.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version >= (1, 32):
        return None
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        ort.InferenceSession(os.fspath(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        if "float8" not in str(exc):
            return None
        return (
            f"onnxruntime {ort.__version__} (installed) refuses {os.fspath(path)!r} in a CPU session at its default "
            f"optimisation level ({first_line(exc)}); set the session option session.disable_quant_qdq=1 in your "
            "CPU sessions, as fp8onnx's own do, or use onnxruntime 1.32 or newer (the CUDA EP is not affected)."
        )
    return None


def make_session(
    model: bytes | str | os.PathLike,
    provider: str = "auto",
    what: str = "model",
    *,
    arena: bool = True,
    optimize: bool = True,
    instrumented: bool = False,
    weights: dict[str, np.ndarray] | None = None,
    threads: int = 0,
    disabled_optimizers: tuple[str, ...] = (),
    fold: bool = True,
) -> ort.InferenceSession:
    """An InferenceSession for serialized bytes or a path; failures name ``what``. ``optimize=False``
    turns graph optimizations off (a load check that must not fold weights, see ``save_model``);
    ``instrumented=True`` is for graphs that report statistics of their own tensors (see ``_options``);
    ``weights``: arrays for initializers the model declares as external data, handed to onnxruntime
    without a copy (the session keeps them alive); ``threads``: onnxruntime's intra-op threads (0: its
    default); ``disabled_optimizers``: onnxruntime graph transformers to leave out (by name); ``fold=False``:
    on the CPU EP, float8 weights stay float8 in the session, dequantized at every run (no constant folding)."""
    provider = resolve_provider(provider)
    if provider == "cpu" and not fold:
        disabled_optimizers = (*disabled_optimizers, "ConstantFolding")
    options = _options(provider, arena, optimize, instrumented, threads)
    if provider == "cpu" and cuda_only_ops(model):  # lowered to standard ops, weights inline (or in a file)
        with emulated(model, weights, _IN_MEMORY, what) as lowered:
            return _session(lowered, provider, what, None, options, disabled_optimizers)
    return _session(model, provider, what, weights, options, disabled_optimizers)


def _session(model, provider, what, weights, options, disabled_optimizers) -> ort.InferenceSession:
    if provider == "cpu" and float16_conv(model):
        # onnxruntime 1.32's NchwcTransformer crashes the process (SIGSEGV) on float16 Conv graphs (the
        # corpus ViT's patch embedding at --precision fp16); it only changes the layout of float32 Convs
        disabled_optimizers = (*disabled_optimizers, "NchwcTransformer")
    providers = [_CUDA, _CPU] if provider == "cuda" else [_CPU]
    src = model if isinstance(model, bytes) else str(model)
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (weights or {}).values()]
    if weights:
        options.add_external_initializers(list(weights), values)
    try:
        session = ort.InferenceSession(
            src, options, providers=providers, disabled_optimizers=list(disabled_optimizers) or None
        )
    except Exception as exc:
        raise Fp8OnnxError(f"{what} does not load in onnxruntime ({provider}): {first_line(exc)}") from exc
    if provider == "cuda" and _CUDA not in session.get_providers():  # the probe said yes; this session says no
        raise Fp8OnnxError(f"{what} was to run on onnxruntime's CUDA EP but its session has {session.get_providers()}.")
    if weights:
        session._fp8onnx_weights = (weights, values)  # onnxruntime reads them in place: they must outlive it
    return session


def inline_proto(model: ir.Model):
    """The model as one self-contained ModelProto: weights that live in external data are read in
    (a shallow clone is filled, the caller's model keeps its memory-mapped tensors)."""
    if not any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()):
        return ir.to_proto(model)
    clone = model.clone()
    ir.external_data.load_to_model(clone)
    return ir.to_proto(clone)


def weight_bytes(model: ir.Model) -> int:
    """Bytes of the main graph's initializers."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def _handed_over(value: ir.Value) -> bool:
    tensor = value.const_value
    return (
        tensor is not None
        and tensor.nbytes >= HANDOVER_BYTES
        and tensor.dtype in _NUMPY_DTYPES
        and not value.is_graph_input()  # an overridable initializer stays in the graph
        # onnxruntime cannot place one that only If/Loop/Scan bodies read ("Failed to find existing
        # initializer"): those stay in the graph too
        and any(use.node.graph is value.graph for use in value.uses())
    )


# A session of an FP8 model may dequantize its float8 weights at load (faster runs: Qwen2.5-Coder-0.5B's W8A8
# model, one run of 32 tokens on one core, 1.3 s against 5.9 s dequantizing at every run) where the weights
# in float and in float8 together take at most this share of the memory available.
FOLD_SHARE = 0.7
_FLOAT8 = {
    ir.DataType.FLOAT8E4M3FN,
    ir.DataType.FLOAT8E4M3FNUZ,
    ir.DataType.FLOAT8E5M2,
    ir.DataType.FLOAT8E5M2FNUZ,
}


def dequantized_bytes(model: ir.Model) -> int:
    """Bytes that dequantizing ``model``'s float8 weights at load adds to a session: each float8 initializer
    of the main graph in the type a DequantizeLinear reading it gives (its scale's), else float32."""
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.dtype not in _FLOAT8:
            continue
        out = ir.DataType.FLOAT
        for use in value.uses():
            scale = use.node.inputs[1] if use.node.op_type == "DequantizeLinear" and use.idx == 0 else None
            if scale is not None and scale.dtype is not None:
                out = scale.dtype
                break
        total += int(tensor.size * out.itemsize)
    return total


def folds_at_load(model: ir.Model) -> tuple[bool, str]:
    """(whether a CPU session of ``model`` may dequantize its float8 weights once at load, why not): the
    weights as stored and dequantized must fit :data:`FOLD_SHARE` of the memory available now (a model
    without float8 weights always may)."""
    extra = dequantized_bytes(model)
    free = available_memory()
    if not extra or free is None or weight_bytes(model) + extra <= FOLD_SHARE * free:
        return True, ""
    return False, (
        f"its float8 weights were dequantized at every run: dequantized once at load they would add "
        f"{extra / 2**30:.1f} GiB, beyond {FOLD_SHARE:.0%} of the {free / 2**30:.1f} GiB available"
    )


def available_memory() -> int | None:
    """Bytes of memory available now (/proc/meminfo's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        return None
    return None  # pragma: no cover


def machine_memory() -> int:
    """Physical memory in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 1 << 62


def session_for_model(
    model: ir.Model,
    provider: str = "auto",
    what: str = "model",
    *,
    arena: bool = True,
    instrumented: bool = False,
    disabled_optimizers: tuple[str, ...] = (),
    fold: bool = True,
) -> ort.InferenceSession:
    """A session for an in-memory model. Its main graph's weights of ``HANDOVER_BYTES`` or more go to
    onnxruntime as arrays over the model's own memory (memory-mapped external data included): only
    the rest of the model is serialized. On all-MiniLM-L6-v2's instrumented copy the session took
    0.21 s instead of 0.34 s (84 MiB serialized), with the same results. A model whose weights
    exceed this machine's memory is refused in one sentence (onnxruntime would be killed). ``fold``: as
    :func:`make_session`'s."""
    held, total = weight_bytes(model), machine_memory()
    if held > total:
        raise Fp8OnnxError(
            f"{what[:1].upper()}{what[1:]} holds {held / 2**30:.1f} GiB of weights; this machine has "
            f"{total / 2**30:.1f} GiB of memory, too little for one onnxruntime session (quantize and calibrate "
            "run such a model layer by layer)."
        )
    return session_from_portable(
        portable_model(model, files=False),
        provider,
        what,
        arena=arena,
        instrumented=instrumented,
        disabled_optimizers=disabled_optimizers,
        fold=fold,
    )


def portable_model(model: ir.Model, *, files: bool = True) -> tuple[bytes, dict]:
    """The model for another process: (the graph serialized without its large weights, where each
    of them is). With ``files``, a weight in an external-data file travels as (file, offset,
    length), to be memory-mapped where it is used (workers on this machine, or on a filesystem every
    node shares); otherwise, and for a weight in memory, as its array. Either way a model of any
    size goes (protobuf's 2 GB limit is the graph's alone). :func:`session_from_portable` builds
    the session."""
    handed = [v for v in model.graph.initializers.values() if _handed_over(v)]
    where = {v.name: weight_location(v.const_value, files) for v in handed}
    external = [
        v
        for graph in (model.graph, *model.graph.subgraphs())
        for v in graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor) and v.name not in where
    ]
    saved = [(v, v.const_value) for v in (*handed, *external)]
    try:  # placeholders while the graph is serialized; the caller's model is restored after
        for v in handed:
            t = known.constant(v)
            shape = known.tensor_shape(t)
            v.const_value = ir.ExternalTensor(_IN_MEMORY, 0, t.nbytes, t.dtype, shape=shape, name=known.name(v))
        for v in external:
            t = known.constant(v)
            v.const_value = ir.Tensor(t.numpy(), dtype=t.dtype, name=v.name)
        graph = ir.to_proto(model).SerializeToString()
    finally:
        for v, tensor in saved:
            v.const_value = tensor
    return graph, where


def session_from_portable(portable: tuple[bytes, dict], provider: str, what: str, **options) -> ort.InferenceSession:
    """A session for :func:`portable_model`'s output (weights memory-mapped from their files)."""
    graph, where = portable
    return make_session(graph, provider, what, weights=open_weights(where), **options)


def weight_location(tensor, files: bool = True):
    """Where a weight is, for another process: (file, offset, length, dtype, shape) of external data
    (with ``files``), else its array (a strided view is copied once)."""
    if files and isinstance(tensor, ir.ExternalTensor):
        return (tensor.path, tensor.offset or 0, tensor.nbytes, tensor.dtype.numpy(), tuple(tensor.shape.numpy()))
    return np.ascontiguousarray(tensor.numpy())


def open_weights(where: dict) -> dict[str, np.ndarray]:
    """:func:`weight_location`'s entries as arrays: files memory-mapped, arrays as they are."""
    return {
        name: np.memmap(w[0], dtype=w[3], mode="r", offset=w[1], shape=w[4]) if isinstance(w, tuple) else w
        for name, w in where.items()
    }


def median_latency_ms(session: ort.InferenceSession, feed: dict, *, warmup: int = 3, runs: int = 20) -> float:
    """Median wall time of ``session.run`` on ``feed`` after ``warmup`` runs, in milliseconds."""
    import time

    for _ in range(warmup):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def worker_session(model, provider: str, what: str, threads: int):
    """The calibration session of a Ray worker, built there from :func:`portable_model`'s output
    (or from serialized bytes)."""
    if isinstance(model, tuple):
        return session_from_portable(model, provider, what, arena=False, instrumented=True, threads=threads)
    return make_session(model, provider, what, arena=False, instrumented=True, threads=threads)
