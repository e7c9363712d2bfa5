"""onnxruntime sessions: provider choice and the session options FP8 graphs need.

On the CPU EP, ``session.disable_quant_qdq`` is set: its QDQ fusion turns a float8
DequantizeLinear -> Gemm into QGemm, which has no float8 kernel (onnxruntime issue 22269).
Everything else stays at ORT's defaults, because that is how users run the result.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import tempfile

import onnx_ir as ir
import onnx_ir.external_data
import onnxruntime as ort

from .errors import Fp8OnnxError, first_line

__all__ = [
    "PROVIDERS",
    "WEIGHT_MEMORY",
    "RunOptions",
    "inline_proto",
    "make_session",
    "median_latency_ms",
    "resolve_provider",
    "session_for_model",
    "weight_bytes",
]

logger = logging.getLogger(__name__)
PROVIDERS = ("auto", "cuda", "cpu")
_CUDA, _CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
# Above this many bytes of weights a model is handed to ORT through a file with external data.
_INLINE_LIMIT = 1 << 30
# Models with more weights than this are calibrated layer by layer (see fp8onnx.segments).
WEIGHT_MEMORY = 512 << 20
_RUN_FIELDS = ("batch_size", "provider", "weight_memory", "progress")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a command runs onnxruntime, apart from what it computes (the recipe is QuantizeConfig):
    samples per run, execution provider, the weight budget of one calibration segment (bytes), and
    whether to show progress bars. Adding a knob means one field here and one CLI option."""

    batch_size: int = 16
    provider: str = "auto"
    weight_memory: int = WEIGHT_MEMORY
    progress: bool = False

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise Fp8OnnxError(f"--batch-size must be a positive integer, got {self.batch_size!r}.")
        if str(self.provider).lower() not in PROVIDERS:
            raise Fp8OnnxError(f"Unknown provider {self.provider!r}; choose one of {', '.join(PROVIDERS)}.")
        if isinstance(self.weight_memory, bool) or not isinstance(self.weight_memory, int) or self.weight_memory < 1:
            raise Fp8OnnxError(f"--weight-memory must be a positive number of bytes, got {self.weight_memory!r}.")

    @classmethod
    def of(cls, run: RunOptions | None = None, **overrides) -> RunOptions:
        """``run`` (or the defaults) with the given keyword knobs replacing its fields."""
        unknown = sorted(set(overrides) - set(_RUN_FIELDS))
        if unknown:
            raise TypeError(f"unknown run option {unknown[0]!r}; RunOptions has {', '.join(_RUN_FIELDS)}")
        return dataclasses.replace(run or cls(), **overrides)

    @staticmethod
    def split(options: dict) -> tuple[dict, dict]:
        """(run knobs, the rest) of a keyword dict: what the API's ``**options`` mix."""
        run = {k: v for k, v in options.items() if k in _RUN_FIELDS}
        return run, {k: v for k, v in options.items() if k not in _RUN_FIELDS}


def resolve_provider(provider: str) -> str:
    """'auto' -> 'cuda' when onnxruntime-gpu sees a device, else 'cpu'."""
    provider = provider.lower()
    if provider not in PROVIDERS:
        raise Fp8OnnxError(f"Unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}.")
    available = ort.get_available_providers()
    if provider == "auto":
        return "cuda" if _CUDA in available else "cpu"
    if provider == "cuda" and _CUDA not in available:
        raise Fp8OnnxError(
            "Provider 'cuda' was asked for but this onnxruntime has no CUDA EP; install onnxruntime-gpu "
            "(see README, GPU)."
        )
    return provider


def _options(
    provider: str, arena: bool = True, optimize: bool = True, instrumented: bool = False
) -> ort.SessionOptions:
    so = ort.SessionOptions()
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


def make_session(
    model: bytes | str | os.PathLike,
    provider: str = "auto",
    what: str = "model",
    *,
    arena: bool = True,
    optimize: bool = True,
    instrumented: bool = False,
) -> ort.InferenceSession:
    """An InferenceSession for serialized bytes or a path; failures name ``what``. ``optimize=False``
    turns graph optimizations off (a load check that must not fold weights, see ``save_model``);
    ``instrumented=True`` is for graphs that report statistics of their own tensors (see ``_options``)."""
    provider = resolve_provider(provider)
    providers = [_CUDA, _CPU] if provider == "cuda" else [_CPU]
    src = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(src, _options(provider, arena, optimize, instrumented), providers=providers)
    except Exception as exc:
        raise Fp8OnnxError(f"{what} does not load in onnxruntime ({provider}): {first_line(exc)}") from None


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


def session_for_model(
    model: ir.Model, provider: str = "auto", what: str = "model", *, arena: bool = True, instrumented: bool = False
) -> ort.InferenceSession:
    """A session for an in-memory model; large models go through a temporary file."""
    kw = {"arena": arena, "instrumented": instrumented}
    if weight_bytes(model) < _INLINE_LIMIT:
        return make_session(inline_proto(model).SerializeToString(), provider, what, **kw)
    with tempfile.TemporaryDirectory(prefix="fp8onnx-") as tmp:
        path = pathlib.Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        return make_session(path, provider, what, **kw)


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
