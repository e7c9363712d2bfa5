"""A few input channels of each quantized MatMul/Gemm kept in float (QUIK, Ashkboos et al. 2023, "its
outliers kept", on the FP8 grid).

Decoder LLMs carry a handful of "massive activation" channels: after the attention's input norm of
Gemma 3 270M one channel carries 11-49x the median channel's root mean square. E4M3 keeps its
relative precision over a wide range, so these channels do not starve the others of grid points; what they
cost is their own rounding, and the rounding of the weight rows they multiply, which dominates the product.
Here the ``count`` input channels of largest calibration amax of each quantized activation leave the FP8
product: ``y = x W`` becomes ``x W' + x[..., idx] W[idx, :]`` (:func:`fp8onnx.passes.keep_channels
.keep_channels`), ``W'`` the weight with those rows set to zero (quantized as any other: its scales now fit
the remaining rows; a zero row rounds to zero, so GPTQ has nothing to spread from it) and the second product
a float MatMul of ``count`` columns. The function is unchanged up to float rounding; the FP8 GEMM keeps its
shape, and the float side costs ``count / K`` of the GEMM's multiply-adds. The activation itself is
quantized as before (its static scale still covers the kept channels, whose quantized values now meet zero
weights).

Only activations that feed MatMul/Gemm as input A with a constant 2-D weight are split (the groups
smoothing takes); a weight that another node reads too is left whole.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.graph.plan import Decision
from fp8onnx.passes.keep_channels import keep_channels
from fp8onnx.pipeline.statistics import Statistic, Sums
from fp8onnx.techniques.base import Technique
from fp8onnx.techniques.smoothing import _amax_per_channel, _groups

__all__ = ["OutlierChannels"]

logger = logging.getLogger(__name__)


class OutlierChannels(Technique):
    """Keep the ``count`` largest input channels of every eligible activation in float (module docstring).

    requires: calibration data (the per-channel amax of each activation), measured before the activation
    ranges. ensures: the model computes the same function up to float rounding; each split node's weight
    has ``count`` zero rows, and its output has the float product of those rows added."""

    name = "outlier channels"
    option = "--keep-channels"
    needs = "the per-channel amax of each activation"
    before_scales = True

    def __init__(self, model: ir.Model, decisions: list[Decision], count: int):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise Fp8OnnxError(f"--keep-channels must be a positive integer, got {count!r}.")
        self.model, self.count = model, count
        self.groups = _groups(decisions, model)
        builders = dict.fromkeys(self.groups, _amax_per_channel)
        self.amax = Sums(builders, "channel amax", combine=np.maximum) if builders else None
        self.kept: dict[str, list[int]] = {}  # activation name -> the channels kept in float

    def statistics(self) -> list[Statistic]:
        return [self.amax] if self.amax else []

    def apply(self, quant=None) -> str | None:
        if self.amax is None:
            return None
        split = 0
        for name, (x, nodes) in self.groups.items():
            ax = np.asarray(self.amax.result[name][0], np.float32)
            if self.count >= len(ax):
                continue
            idx = np.sort(np.argsort(-ax, kind="stable")[: self.count])
            done = keep_channels(x, idx, nodes, name)
            if done:
                self.kept[name] = idx.tolist()
                split += len(done)
        logger.info("kept %d input channels of %d activations in float", self.count, len(self.kept))
        return (
            f"kept the {self.count} largest input channels of {len(self.kept)} activations in float "
            f"({split} MatMul/Gemm split into FP8 and float products)"
        )
