"""What to quantize and how: :class:`QuantizeConfig`, the quantization recipe, validated on creation
(every rule about which options go together lives here)."""

# ruff: noqa: RUF009  (a Normalised default is the field's descriptor, one per field, not a value shared by instances)
from __future__ import annotations

import dataclasses
import enum
import logging

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.numerics.formats import Fp8Format, parse_format
from fp8onnx.numerics.scaling import DEFAULT_PERCENTILE, Scaling, amax_to_scale, check_percentile, parse_scaling
from fp8onnx.settings.choices import (
    DEFAULT_OP_TYPES,
    SUPPORTED_OP_TYPES,
    Activations,
    Embeddings,
    FallbackUnit,
    GemmOp,
    Normalised,
    Precision,
    Target,
    WeightRounding,
    check_precision,
    parse_choice,
)
from fp8onnx.settings.presets import PRESETS, bundled, overruled

__all__ = ["PRESETS", "QuantizeConfig"]

logger = logging.getLogger(__name__)


PER_CHANNEL_BY_DEFAULT = ("Conv", "ConvTranspose")

# Activation modes whose weights are per output channel unless --per-tensor: the FP8-dynamic recipe,
# and weight-only FP8 (on SmolLM2-135M per-tensor weights alone cost 2.6% of FP16's accuracy).
_PER_CHANNEL_MODES = (Activations.DYNAMIC_PER_TOKEN, Activations.DYNAMIC_PER_GROUP, Activations.NONE)

# The fast form's weight blocks when none are asked for: onnxruntime's default block_size.
BLOCK_FP8_DEFAULT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; validated on creation.

    ``format`` sets both ``weight_format`` and ``activation_format`` unless they are given. The enumerated
    fields take a member or its name (:class:`~fp8onnx.settings.choices.Normalised`) and hold the member.
    """

    format: Normalised[Fp8Format, Fp8Format | str] = Normalised(Fp8Format.E4M3FN)
    weight_format: Normalised[Fp8Format, Fp8Format | str | None] = Normalised(None)  # None: format
    activation_format: Normalised[Fp8Format, Fp8Format | str | None] = Normalised(None)  # None: format
    scaling: Normalised[Scaling, Scaling | str] = Normalised(Scaling.AMAX)
    margin: int = 0
    # static activation scales cover this multiple of the calibrated range: text the calibration never saw
    # may run past its absolute maximum, and E4M3 keeps its relative precision over a wide range
    headroom: float = 1.0
    scale: float | None = None
    percentile: float | None = None
    activations: Normalised[Activations, Activations | str] = Normalised(Activations.STATIC)
    per_channel: bool | None = None  # None: Conv/ConvTranspose per output channel, MatMul/Gemm per tensor
    weight_block_size: int = 0  # one weight scale per this many elements along the reduction axis (0: off)
    group_size: int = 128  # --activations dynamic-per-group: channels per in-graph scale
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    exclude: tuple[str, ...] = ()
    float_activations: tuple[str, ...] = ()  # globs: these nodes' activations stay in float (W8A16), weights FP8
    float_last_layers: int = 0  # the last N decoder layers' (named layers.K/) activations in float (W8A16)
    # at least this share of the quantized MACs W8A8, the W8A16 rest chosen by measured loss (workflows.loss_choice)
    w8a8_share: float | None = None
    keep_float: tuple[str, ...] = ()  # node names kept in float for an accuracy target (accuracy.fallback)
    # what keep_float leaves in float (activations none: nodes)
    fallback: Normalised[FallbackUnit, FallbackUnit | str] = Normalised(FallbackUnit.NODES)
    activation_matmuls: bool = False
    weight_rounding: Normalised[WeightRounding, WeightRounding | str] = Normalised(WeightRounding.NEAREST)
    smooth: float | None = None  # SmoothQuant's alpha: migrate activation outliers into weights (techniques)
    keep_channels: int = 0  # the largest input channels of each quantized activation kept in float (techniques)
    bias_correction: bool = False  # shift biases by E[x] (W - Wq), from calibration (techniques)
    sequential: bool = False  # each layer calibrated on the quantized layers before it (pipeline.executors)
    float_vocab: bool = False  # leave vocabulary-sized projections (lm_head) in float
    wide_tables: bool = False  # keep float tables left in float (an lm_head under float_vocab) in 32 bits, not 16
    float_stem: bool = False  # leave the convolutions that read the model's input (the stem) in float
    embeddings: Normalised[Embeddings, Embeddings | str] = Normalised(Embeddings.FLOAT)
    preset: str | None = None  # recorded only: the fields a preset set are already in place (for_preset)
    # --preset auto: the fields the user set, kept over the family's preset once it is known (for_family)
    explicit: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)
    # None: fp16 for --gemm-op block-fp8 (the op's A), else model
    precision: Normalised[Precision, Precision | str | None] = Normalised(None)
    native_gemm: bool = False  # the same as gemm_op="gemm-float8"
    target: Normalised[Target, Target | str] = Normalised("onnxruntime")
    gemm_op: Normalised[GemmOp, GemmOp | str] = Normalised(GemmOp.AUTO)  # resolved on creation: never AUTO afterwards
    # precision was not given: fp16 chosen for the fast form (quantize keeps float32 where fp16 cannot be had)
    precision_derived: bool = dataclasses.field(default=False, compare=False, repr=False)

    def __post_init__(self):
        if str(getattr(self.format, "value", self.format)).lower() == "mxfp8":
            raise Fp8OnnxError(
                "format 'mxfp8' is a bundle of settings: pass it to fp8onnx.quantize or build the config with "
                "QuantizeConfig.for_preset(preset, format='mxfp8', ...)."
            )
        fmt = parse_format(self.format)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "weight_format", parse_format(self.weight_format or fmt))
        object.__setattr__(self, "activation_format", parse_format(self.activation_format or fmt))
        object.__setattr__(self, "scaling", parse_scaling(self.scaling))
        object.__setattr__(self, "op_types", tuple(self.op_types))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "float_activations", tuple(self.float_activations))
        object.__setattr__(self, "keep_float", tuple(self.keep_float))
        unknown = [t for t in self.op_types if t not in SUPPORTED_OP_TYPES]
        if unknown or not self.op_types:
            raise Fp8OnnxError(
                f"Unsupported op type {unknown[0] if unknown else ''!r} in --op-types; supported: "
                f"{', '.join(SUPPORTED_OP_TYPES)}."
            )
        object.__setattr__(self, "target", parse_choice(Target, self.target, "--target"))
        self._resolve_gemm_op()
        if self.precision is None:
            fp16 = self.gemm_op is GemmOp.BLOCK_FP8
            object.__setattr__(self, "precision", Precision.FP16 if fp16 else Precision.MODEL)
            object.__setattr__(self, "precision_derived", fp16)
        object.__setattr__(self, "precision", check_precision(self.precision))
        if self.precision is Precision.BF16 and self.gemm_op is not GemmOp.BLOCK_FP8:
            raise Fp8OnnxError(
                "--precision bf16 is for the CUDA fast form (--target onnxruntime-cuda, --gemm-op block-fp8): float8 "
                "Q/DQ to bfloat16 has no CUDA kernel, and onnxruntime's CPU EP runs few ops in bfloat16."
            )
        self._check_techniques()
        self._check_modes()

    def _check_techniques(self) -> None:
        """Weight rounding, smoothing, bias correction, blocks, groups, the fallback unit, embeddings."""
        choices: dict[str, type[enum.Enum]] = {
            "weight_rounding": WeightRounding,
            "fallback": FallbackUnit,
            "embeddings": Embeddings,
        }
        for field, kind in choices.items():
            object.__setattr__(self, field, parse_choice(kind, getattr(self, field), "--" + field.replace("_", "-")))
        if self.smooth is not None and not 0 <= self.smooth <= 1:
            raise Fp8OnnxError(f"--smooth must be in [0, 1], got {self.smooth!r}.")
        keep = self.keep_channels
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise Fp8OnnxError(f"--keep-channels must be a non-negative integer, got {keep!r}.")
        if keep and self.smooth is not None:
            raise Fp8OnnxError("--keep-channels and --smooth both move activation outliers; choose one.")
        if keep and self.scaling is Scaling.CONSTANT:
            raise Fp8OnnxError("--keep-channels needs calibration; --scaling constant has none.")
        if self.bias_correction and self.scaling is Scaling.CONSTANT:
            raise Fp8OnnxError("--bias-correction needs calibration; --scaling constant has none.")
        if self.weight_rounding == "gptq" and self.scaling is Scaling.CONSTANT:
            raise Fp8OnnxError("--weight-rounding gptq needs calibration; --scaling constant has none.")
        block = self.weight_block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise Fp8OnnxError(f"--weight-block-size must be a non-negative integer, got {block!r}.")
        last = self.float_last_layers
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise Fp8OnnxError(f"--float-last-layers must be a non-negative integer, got {last!r}.")
        room = self.headroom
        if isinstance(room, bool) or not isinstance(room, (int, float)) or not 1 <= room < float("inf"):
            raise Fp8OnnxError(f"--headroom must be a finite number of at least 1, got {room!r}.")
        share = self.w8a8_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise Fp8OnnxError(f"--w8a8-share must be a fraction in (0, 1], got {share!r}.")
        group = self.group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise Fp8OnnxError(f"--group-size must be a positive integer, got {group!r}.")
        if block and self.scaling is Scaling.CONSTANT:
            raise Fp8OnnxError("--weight-block-size contradicts --scaling constant (one scale for every tensor).")

    def _check_modes(self) -> None:
        """Activations against formats, targets and scaling: what can go together."""
        object.__setattr__(self, "activations", parse_choice(Activations, self.activations, "--activations"))
        if self.activations is Activations.NONE:  # no activation to keep in float: the unit is the node
            object.__setattr__(self, "fallback", FallbackUnit.NODES)
        if self.headroom != 1 and (self.activations is not Activations.STATIC or self.scaling is Scaling.CONSTANT):
            constant = self.scaling is Scaling.CONSTANT
            what = "--scaling constant" if constant else f"--activations {self.activations.value}"
            raise Fp8OnnxError(f"--headroom widens calibrated static activation scales; {what} has none to widen.")
        if self.w8a8_share is not None and self.activations is not Activations.STATIC:
            raise Fp8OnnxError(
                f"--w8a8-share chooses which static activations stay in float; --activations {self.activations.value} "
                "has none to choose (use --activations static)."
            )
        if Fp8Format.INT8 in (self.weight_format, self.activation_format) and self.native_gemm:
            raise Fp8OnnxError("--native-gemm is onnxruntime's float8 GEMM; int8 takes standard Q/DQ only.")
        if self.target == "onnxruntime-cuda" and not (self.weight_format.cuda_ok and self.activation_format.cuda_ok):
            raise Fp8OnnxError("--target onnxruntime-cuda takes e4m3fn and e5m2 (the CUDA EP's float8 Q/DQ types).")
        if self.target == "tensorrt":
            if Fp8Format.E4M3FN not in (self.weight_format, self.activation_format) or (
                self.weight_format != self.activation_format
            ):
                raise Fp8OnnxError("--target tensorrt takes e4m3fn only (TensorRT's FP8 format).")
            if self.weight_block_size:
                raise Fp8OnnxError(
                    "--target tensorrt takes per-tensor or per-channel FP8 scales: drop --weight-block-size."
                )
            if self.activations.dynamic or self.native_gemm:
                raise Fp8OnnxError(
                    f"--target tensorrt needs constant scales and standard Q/DQ: drop --activations "
                    f"{self.activations.value} and --native-gemm."
                )
        if self.scaling is Scaling.CONSTANT:
            if self.scale is None:  # the baseline as such: values cast to the format as they are
                object.__setattr__(self, "scale", 1.0)
            amax_to_scale(1.0, self.weight_format, self.scaling, constant=self.scale)  # validates --scale
            if self.activations.dynamic:
                raise Fp8OnnxError(
                    f"--scaling constant contradicts --activations {self.activations.value} (one fixed scale vs "
                    "one per batch)."
                )
            if self.per_channel:
                raise Fp8OnnxError("--scaling constant contradicts --per-channel (one scale for every tensor).")
            object.__setattr__(self, "per_channel", False)  # one constant scale: per tensor for every op
        elif self.scale is not None:
            raise Fp8OnnxError("--scale only applies to --scaling constant.")
        if self.margin != int(self.margin):
            raise Fp8OnnxError(f"--margin must be an integer, got {self.margin!r}.")
        if self.margin and self.scaling is not Scaling.POW2:
            raise Fp8OnnxError("--margin only applies to --scaling pow2.")
        if self.percentile is not None:
            if self.scaling is not Scaling.PERCENTILE:
                raise Fp8OnnxError("--percentile only applies to --scaling percentile.")
            check_percentile(self.percentile)
        if self.activations.dynamic and self.scaling not in (Scaling.AMAX, Scaling.POW2, Scaling.MX):
            raise Fp8OnnxError(
                f"--activations {self.activations.value} computes each batch's amax in the graph; --scaling "
                f"{self.scaling.value} needs calibration (use --scaling amax, pow2 or mx, or --activations static)."
            )
        if self.activations.dynamic and self.margin:
            raise Fp8OnnxError(
                f"--margin applies to calibrated scales; --activations {self.activations.value} computes its "
                "power-of-two scales in the graph without one."
            )

    def _resolve_gemm_op(self) -> None:
        gemm_op = parse_choice(GemmOp, self.gemm_op, "--gemm-op")
        if self.native_gemm and gemm_op not in (GemmOp.AUTO, GemmOp.GEMM_FLOAT8):
            raise Fp8OnnxError(f"--native-gemm is --gemm-op gemm-float8; it contradicts --gemm-op {gemm_op.value}.")
        if gemm_op is GemmOp.AUTO:
            if self.native_gemm:
                gemm_op = GemmOp.GEMM_FLOAT8
            elif (
                self.target == "onnxruntime-cuda"
                and self.weight_format is Fp8Format.E4M3FN
                and {"MatMul", "Gemm"} & set(self.op_types)
            ):
                gemm_op = GemmOp.BLOCK_FP8
            else:
                gemm_op = GemmOp.QDQ
        if gemm_op is GemmOp.BLOCK_FP8:
            if self.weight_format is not Fp8Format.E4M3FN:
                raise Fp8OnnxError(
                    f"--gemm-op block-fp8 stores float8e4m3fn weights; --format/--weight-format is "
                    f"{self.weight_format.value} (use --gemm-op qdq)."
                )
            if self.scaling is Scaling.CONSTANT:
                raise Fp8OnnxError("--gemm-op block-fp8 takes calibrated weight scales; --scaling constant has one.")
            if not self.weight_block_size and self.per_channel is None:
                object.__setattr__(self, "weight_block_size", BLOCK_FP8_DEFAULT_BLOCK)
        object.__setattr__(self, "gemm_op", gemm_op)
        object.__setattr__(self, "native_gemm", gemm_op is GemmOp.GEMM_FLOAT8)

    @classmethod
    def for_preset(cls, name: str, **explicit) -> QuantizeConfig:
        """The preset's settings (``PRESETS``), overridden by every field given in ``explicit``.
        ``auto``: the preset of the model's family, chosen when the model is read (:meth:`for_family`);
        ``none``: no preset (plain per-tensor static amax unless ``explicit`` says otherwise).
        ``format="mxfp8"`` stands for :data:`MXFP8`'s settings."""
        explicit = bundled(explicit)
        if name == "auto":
            return cls(**explicit, preset="auto", explicit=tuple(explicit))
        if name == "none":
            return cls(**explicit)
        if name not in PRESETS:
            raise Fp8OnnxError(f"Unknown --preset {name!r}; choose one of auto, none, {', '.join(PRESETS)}.")
        settings = {k: v for k, v in PRESETS[name]["settings"].items() if not overruled(k, v, explicit)}
        return cls(**{**settings, **explicit, "preset": name, "explicit": tuple(explicit)})

    def for_family(self, preset: str | None) -> QuantizeConfig:
        """This ``auto`` config resolved: the family's ``preset`` (None: none) under the user's fields."""
        given = {name: getattr(self, name) for name in self.explicit}
        if self.keep_float:  # set by the accuracy search (fallback), never by a preset
            given["keep_float"] = self.keep_float
        return QuantizeConfig.for_preset(preset or "none", **given)

    @property
    def weights_need_data(self) -> bool:
        """GPTQ, bias correction, smoothing and kept channels read the calibration data, whatever the activations."""
        extras = self.bias_correction or self.smooth is not None or self.keep_channels > 0
        return self.weight_rounding == "gptq" or extras

    def weight_per_channel(self, op_type: str) -> bool:
        """Whether ``op_type``'s weights get one scale per output channel: always with --per-channel,
        never with --per-tensor, by default for Conv/ConvTranspose only (what every peer does: a
        convolution's filters differ in range far more than a MatMul's columns)."""
        if self.per_channel is None:  # per-token activations and weight-only FP8 pair with per-channel weights
            return op_type in PER_CHANNEL_BY_DEFAULT or self.activations in _PER_CHANNEL_MODES
        return self.per_channel

    @property
    def emulated(self) -> bool:
        return not (self.weight_format.deployable and self.activation_format.deployable)

    def _per_channel_json(self) -> bool | str:
        if self.per_channel is not None:
            return self.per_channel
        # The default is "conv" only where it makes a difference: MatMul-only outputs are unchanged.
        if self.activations in _PER_CHANNEL_MODES:
            return True
        return "conv" if any(t in PER_CHANNEL_BY_DEFAULT for t in self.op_types) else False

    def to_json(self) -> dict:
        doc = {
            "weight_format": self.weight_format.value,
            "activation_format": self.activation_format.value,
            "scaling": self.scaling.value,
            "margin": self.margin,
            "scale": self.scale,
            "percentile": self.percentile
            if self.percentile is not None
            else (DEFAULT_PERCENTILE if self.scaling is Scaling.PERCENTILE else None),
            "activations": self.activations.value,
            "per_channel": self._per_channel_json(),
            "op_types": list(self.op_types),
            "exclude": list(self.exclude),
            "activation_matmuls": self.activation_matmuls,
            "precision": self.precision.value,
            "native_gemm": self.native_gemm,
            "target": self.target.value,
            "emulated": self.emulated,
        }
        # Set only where they differ from what earlier versions wrote (outputs without them stay byte-identical):
        # field -> (the value written, whether it is written), in the order earlier versions wrote them.
        optional = {
            "preset": (self.preset, bool(self.preset)),
            "float_activations": (list(self.float_activations), bool(self.float_activations)),
            "float_last_layers": (self.float_last_layers, bool(self.float_last_layers)),
            "w8a8_share": (self.w8a8_share, self.w8a8_share is not None),
            "headroom": (self.headroom, self.headroom != 1),
            "fallback": (self.fallback.value, self.fallback is not FallbackUnit.NODES),
            "weight_rounding": (self.weight_rounding.value, self.weight_rounding is not WeightRounding.NEAREST),
            "smooth": (self.smooth, self.smooth is not None),
            "keep_channels": (self.keep_channels, self.keep_channels > 0),
            "bias_correction": (True, self.bias_correction),
            "sequential": (True, self.sequential),
            "weight_block_size": (self.weight_block_size, bool(self.weight_block_size)),
            "group_size": (self.group_size, self.activations == "dynamic-per-group"),
            "float_vocab": (True, self.float_vocab),
            "float_stem": (True, self.float_stem),
            "wide_tables": (True, self.wide_tables),
            "embeddings": (self.embeddings.value, self.embeddings is not Embeddings.FLOAT),
            "gemm_op": (getattr(self.gemm_op, "value", self.gemm_op), self.gemm_op is GemmOp.BLOCK_FP8),
        }
        doc.update({key: value for key, (value, written) in optional.items() if written})
        if self.keep_float:  # only then: outputs without it stay byte-identical to earlier versions
            doc["keep_float"] = list(self.keep_float)
        return doc
