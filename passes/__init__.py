"""Graph passes of fp8onnx, one job per module, all on onnx_ir (imported as ``fp8onnx.passes``).

Each pass is an ``onnx_ir.passes.InPlacePass``: ``pass_(model)`` returns a ``PassResult`` whose
``modified`` says whether the model changed; running a pass twice changes nothing the second time.
"""

from .add_amax_outputs import AMAX_SUFFIX, VALUE_SUFFIX, AddAmaxOutputsPass
from .block_fp8 import (
    BLOCK_FP8_OP,
    BlockFp8MatMulPass,
    BlockFp8Result,
    EmulateBlockFp8MatMulPass,
    block_fp8_reason,
    has_block_fp8,
)
from .common import output_channel_axis, release
from .convert_fp16 import ConvertFloat16Pass, Float16Error
from .emulate_bf16 import EmulateBfloat16Pass, has_bfloat16
from .fold_weight_transforms import FoldWeightTransformsPass
from .gate_inputs import GATE_PREFIX, GateInputsPass
from .half_tables import HalfTablesPass, HalfTablesResult
from .insert_qdq import NODE_PREFIX, InsertQDQPass, TensorQuant, is_quantized
from .lower_gemm_float8 import MS_DOMAIN, LowerGemmFloat8Pass, LoweringResult
from .quantize_embeddings import EmbeddingsResult, QuantizeEmbeddingsPass
from .scored_rows import ScoredRowsPass, scored_projections
from .shield_bias import ShieldBiasPass, bias_of
from .tie_embeddings import TieEmbeddingsPass
from .upgrade_opset import TARGET_OPSET, UpgradeError, UpgradeOpsetPass, default_opset

__all__ = [
    "AMAX_SUFFIX",
    "BLOCK_FP8_OP",
    "GATE_PREFIX",
    "MS_DOMAIN",
    "NODE_PREFIX",
    "TARGET_OPSET",
    "VALUE_SUFFIX",
    "AddAmaxOutputsPass",
    "BlockFp8MatMulPass",
    "BlockFp8Result",
    "ConvertFloat16Pass",
    "EmbeddingsResult",
    "EmulateBfloat16Pass",
    "EmulateBlockFp8MatMulPass",
    "Float16Error",
    "FoldWeightTransformsPass",
    "GateInputsPass",
    "HalfTablesPass",
    "HalfTablesResult",
    "InsertQDQPass",
    "LowerGemmFloat8Pass",
    "LoweringResult",
    "QuantizeEmbeddingsPass",
    "ScoredRowsPass",
    "ShieldBiasPass",
    "TensorQuant",
    "TieEmbeddingsPass",
    "UpgradeError",
    "UpgradeOpsetPass",
    "bias_of",
    "block_fp8_reason",
    "default_opset",
    "has_bfloat16",
    "has_block_fp8",
    "is_quantized",
    "output_channel_axis",
    "release",
    "scored_projections",
]
