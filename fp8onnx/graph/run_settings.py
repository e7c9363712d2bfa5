"""How a command runs onnxruntime, apart from what it computes: :class:`RunOptions` (batch size, provider, the
weight budget of a calibration segment, progress, Ray workers), the provider resolved, and
:func:`entry_settings`, which builds a Python API entry point's two settings objects (this and the recipe,
:class:`~fp8onnx.settings.config.QuantizeConfig`) once from its keyword arguments."""

from __future__ import annotations

import dataclasses
import importlib.util

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph.providers import auto_provider, require_cuda
from fp8onnx.settings.config import QuantizeConfig

__all__ = [
    "BATCH_MEMORY",
    "DEFAULT_BATCH",
    "PROVIDERS",
    "RAY_TIMEOUT",
    "WEIGHT_MEMORY",
    "RunOptions",
    "check_ray",
    "entry_settings",
    "resolve_provider",
]

PROVIDERS = ("auto", "cuda", "cpu")
# Models with more weights than this are calibrated layer by layer (see fp8onnx.pipeline.segments).
WEIGHT_MEMORY = 512 << 20
# Samples per run when the user chose none; calibration runs fewer when one sample's statistics run
# needs more than 1/DEFAULT_BATCH of BATCH_MEMORY (see fp8onnx.pipeline.batching.auto_batch_size).
DEFAULT_BATCH = 16
BATCH_MEMORY = 1 << 30
_RUN_FIELDS = (
    "batch_size",
    "provider",
    "weight_memory",
    "progress",
    "batch_memory",
    "workers",
    "ray_address",
    "ray_timeout",
)
RAY_TIMEOUT = 30.0  # seconds to reach a Ray cluster's address before saying nothing answers there


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a command runs onnxruntime, apart from what it computes (the recipe is QuantizeConfig):
    samples per run, execution provider, the weight budget of one calibration segment (bytes),
    whether to show progress bars, the memory one calibration batch may take when ``batch_size`` is
    None (the default: :data:`DEFAULT_BATCH` samples, fewer in calibration when they would not fit),
    and the Ray workers that share the statistics batches. Adding a knob means one field here and
    one CLI option."""

    batch_size: int | None = None
    provider: str = "auto"
    weight_memory: int = WEIGHT_MEMORY
    progress: bool = False
    batch_memory: int = BATCH_MEMORY
    workers: int = 1  # Ray actors for the statistics runs (fp8onnx.pipeline.distributed); 1: this process
    ray_address: str | None = None  # a running Ray cluster; None: a local one when workers > 1
    ray_timeout: float = RAY_TIMEOUT  # seconds to reach ray_address

    def __post_init__(self):
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise Fp8OnnxError(f"--workers must be a positive integer, got {self.workers!r}.")
        if not (isinstance(self.ray_timeout, (int, float)) and self.ray_timeout > 0):
            raise Fp8OnnxError(f"--ray-timeout must be a positive number of seconds, got {self.ray_timeout!r}.")
        if self.distributed:
            check_ray(self.workers, self.ray_address)
        size = self.batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise Fp8OnnxError(f"--batch-size must be a positive integer, got {size!r}.")
        if isinstance(self.batch_memory, bool) or not isinstance(self.batch_memory, int) or self.batch_memory < 1:
            raise Fp8OnnxError(f"--batch-memory must be a positive number of bytes, got {self.batch_memory!r}.")
        if str(self.provider).lower() not in PROVIDERS:
            raise Fp8OnnxError(f"Unknown provider {self.provider!r}; choose one of {', '.join(PROVIDERS)}.")
        if isinstance(self.weight_memory, bool) or not isinstance(self.weight_memory, int) or self.weight_memory < 1:
            raise Fp8OnnxError(f"--weight-memory must be a positive number of bytes, got {self.weight_memory!r}.")

    @property
    def distributed(self) -> bool:
        return self.workers > 1 or bool(self.ray_address)

    @property
    def batch(self) -> int:
        """Samples per run: the user's choice, else :data:`DEFAULT_BATCH`."""
        return DEFAULT_BATCH if self.batch_size is None else self.batch_size

    @classmethod
    def of(cls, run: RunOptions | None = None, **overrides) -> RunOptions:
        """``run`` (or the defaults) with the given keyword knobs replacing its fields."""
        unknown = sorted(set(overrides) - set(_RUN_FIELDS))
        if unknown:
            raise TypeError(f"unknown run option {unknown[0]!r}; RunOptions has {', '.join(_RUN_FIELDS)}")
        return dataclasses.replace(run or cls(), **overrides)


def entry_settings(
    config: QuantizeConfig | None, run: RunOptions | None, options: dict, preset: str | None = "auto"
) -> tuple[QuantizeConfig, RunOptions]:
    """The two settings objects of a Python API entry point, built once there and passed down whole.

    ``options`` (the entry's keyword arguments) are RunOptions fields, which replace ``run``'s, and, where
    ``config`` is not given, QuantizeConfig fields and ``preset``: the preset's settings under the fields given
    (:meth:`QuantizeConfig.for_preset`; ``preset`` names the entry's default: ``"auto"``, the model family's
    recipe, for the commands that quantize; None: the fields alone). The provider comes back resolved
    (``auto`` -> ``cuda`` or ``cpu``).

    requires: ``options`` holds only RunOptions fields, QuantizeConfig fields and ``preset``; recipe fields
    only where ``config`` is None. ensures: nothing in ``options`` is dropped (a recipe field beside a
    ``config`` is one sentence, not ignored)."""
    run_kw = {k: v for k, v in options.items() if k in _RUN_FIELDS}
    recipe = {k: v for k, v in options.items() if k not in _RUN_FIELDS}
    if config is not None and recipe:
        raise Fp8OnnxError(
            f"{', '.join(sorted(recipe))} given beside config=: set them on the QuantizeConfig "
            "(dataclasses.replace(config, ...)) or leave config out."
        )
    if config is None:
        name = recipe.pop("preset", preset)
        config = QuantizeConfig.for_preset(name, **recipe) if name else QuantizeConfig(**recipe)
    run = RunOptions.of(run, **run_kw)
    return config, RunOptions.of(run, provider=resolve_provider(run.provider))


def resolve_provider(provider: str) -> str:
    """'cuda' or 'cpu': the provider fp8onnx's sessions will run on. 'auto' is 'cuda' where a session
    asked for the CUDA EP gets it in this process, else 'cpu', and says which; 'cuda' where the CUDA EP
    does not start is one sentence with onnxruntime's reason and the command that fixes it
    (:mod:`fp8onnx.graph.providers`)."""
    provider = provider.lower()
    if provider not in PROVIDERS:
        raise Fp8OnnxError(f"Unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}.")
    return "cpu" if provider == "cpu" else auto_provider() if provider == "auto" else require_cuda()


def check_ray(workers: int, address: str | None) -> None:
    """A clear sentence when Ray is asked for and not installed."""
    if (workers > 1 or address) and importlib.util.find_spec("ray") is None:
        raise Fp8OnnxError("--workers/--ray need Ray: pip install 'fp8onnx[ray]'.")
