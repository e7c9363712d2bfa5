"""QuantizeConfig's enumerated choices, one enum per option (the members are strings too, so a plain
name compares equal), their names as tuples for the command line, and the rule that turns a
user's string into a member or one sentence naming the option."""

from __future__ import annotations

import enum
from typing import Any, Generic, TypeVar, overload

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.settings.targets import TARGETS

SUPPORTED_OP_TYPES = ("MatMul", "Gemm", "Conv", "ConvTranspose")
DEFAULT_OP_TYPES = ("MatMul", "Gemm")  # Conv is opt-in (SPEC §2)


class Activations(str, enum.Enum):
    """static: calibrated scales; dynamic: each batch's amax computed in the graph;
    dynamic-per-token: one scale per row (token) of the activation, its amax over the reduction
    axis, computed in the graph, with per-channel weights (the FP8-dynamic recipe);
    dynamic-per-group: one scale per row and per ``group_size`` consecutive channels (DeepSeek-V3's
    1 x 128 activation tiles); none: weights only (float8 weights + DequantizeLinear, activations
    stay in float)."""

    STATIC = "static"
    DYNAMIC = "dynamic"
    DYNAMIC_PER_TOKEN = "dynamic-per-token"
    DYNAMIC_PER_GROUP = "dynamic-per-group"
    NONE = "none"

    @property
    def dynamic(self) -> bool:
        """Scales computed in the graph at run time: no calibration."""
        return self in (Activations.DYNAMIC, Activations.DYNAMIC_PER_TOKEN, Activations.DYNAMIC_PER_GROUP)


class Precision(str, enum.Enum):
    """model: keep the model's own float types; fp16 / bf16: the unquantized graph in float16 / bfloat16."""

    MODEL = "model"
    FP16 = "fp16"
    BF16 = "bf16"


# Which runtime's rules the output must meet (the names are fp8onnx.settings.targets', in its order: a
# literal, so that type checkers see the members; the assert keeps the two lists one).
Target = enum.Enum(
    "Target", {"ONNXRUNTIME": "onnxruntime", "ONNXRUNTIME-CUDA": "onnxruntime-cuda", "TENSORRT": "tensorrt"}, type=str
)
assert tuple(t.value for t in Target) == TARGETS, "Target and fp8onnx.settings.targets.TARGETS differ"
ACTIVATION_MODES = tuple(a.value for a in Activations)


class GemmOp(str, enum.Enum):
    """How a quantized MatMul/Gemm is written. qdq: standard ONNX (float8 Q/DQ around the float op, every
    runtime); block-fp8: ``com.microsoft.MatMulBlockQuantizedFp8Weight`` (onnxruntime's CUDA EP fast path,
    float8 weights read as they are; fp8onnx.passes.block_fp8); gemm-float8: ``com.microsoft.GemmFloat8``
    (cuBLASLt FP8 GEMM, per-tensor scales, compute capability >= 8.9); auto: block-fp8 for --target
    onnxruntime-cuda with E4M3 weights, gemm-float8 with --native-gemm, else qdq."""

    AUTO = "auto"
    QDQ = "qdq"
    BLOCK_FP8 = "block-fp8"
    GEMM_FLOAT8 = "gemm-float8"


GEMM_OPS = tuple(g.value for g in GemmOp)


class WeightRounding(str, enum.Enum):
    """nearest: round each weight to the nearest float8 value; gptq: error-compensating rounding from
    calibration (fp8onnx.techniques.gptq)."""

    NEAREST = "nearest"
    GPTQ = "gptq"


class Embeddings(str, enum.Enum):
    """float: embedding tables stay as they are; fp8: stored as float8 codes with per-row scales
    (fp8onnx.passes.quantize_embeddings)."""

    FLOAT = "float"
    FP8 = "fp8"


class FallbackUnit(str, enum.Enum):
    """What an accuracy target leaves in float, node by node: the whole node (float weight and activation),
    or only its activation (W8A16: the FP8 weight stays; the fast form's op without a_scale)."""

    NODES = "nodes"
    ACTIVATIONS = "activations"


WEIGHT_ROUNDINGS = tuple(w.value for w in WeightRounding)
EMBEDDING_MODES = tuple(e.value for e in Embeddings)
FALLBACK_UNITS = tuple(f.value for f in FallbackUnit)
PRECISIONS = tuple(p.value for p in Precision)


E = TypeVar("E", bound=enum.Enum)


def parse_choice(kind: type[E], value: object, option: str) -> E:
    """``value`` as a member of ``kind`` (the members are strings too, so comparisons with the
    plain names keep working), or one sentence naming the option."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise Fp8OnnxError(f"Unknown {option} {value!r}; choose one of {choices}.") from None


def check_precision(precision: Precision | str) -> Precision:
    """The one rule for --precision: model (keep the model's float types), fp16 or bf16."""
    return parse_choice(Precision, precision, "--precision")


T = TypeVar("T")
Given = TypeVar("Given")


class Normalised(Generic[T, Given]):
    """A dataclass field that takes more on creation (``Given``: a member or its name, None for "derived")
    than it holds once ``__post_init__`` has normalised it (``T``: the member): the constructor accepts
    the names, the attribute reads as the member. The value lives in the instance's ``__dict__`` under
    the field's own name, as a plain field's does (repr, equality, pickling, ``dataclasses.replace``
    unchanged); reading it before ``__post_init__`` has normalised it gives what was passed."""

    def __init__(self, default: Given) -> None:
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Given: ...  # the class's: the default
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:  # dataclasses reads the field's default from the class
            return self.default
        try:
            return vars(obj)[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: object, value: Given) -> None:
        vars(obj)[self.name] = value
