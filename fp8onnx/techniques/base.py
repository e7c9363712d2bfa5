"""What a technique is: a step of the recipe that changes the weights or their rounding (the shape of
llm-compressor's Modifiers, run by its pipelines).

A technique declares the statistics it needs from the calibration data
(:class:`~fp8onnx.pipeline.statistics.Statistic`) and makes its change from them in :meth:`apply`.
The recipe (:mod:`fp8onnx.techniques.recipe`) orders the techniques and measures their statistics in
as few passes over the data as that order allows: one for those that change the activations others
measure (``before_scales``: smoothing), then one for everything else together with the activation
ranges.
"""

from __future__ import annotations

import numpy as np

from fp8onnx.numerics.formats import dequantize, quantize
from fp8onnx.passes import TensorQuant
from fp8onnx.pipeline.statistics import Statistic

__all__ = ["Technique", "stored_values"]


def stored_values(w: np.ndarray, tq: TensorQuant) -> np.ndarray:
    """``w`` as InsertQDQPass stores it with ``tq``'s scale(s): quantized and dequantized, float32."""
    scale = tq.full_scale(w.shape)
    return dequantize(quantize(w, scale, tq.format), scale, np.float32)


class Technique:
    """``name``: how the summary calls it; ``option``: the command-line option that asks for it;
    ``needs``: what it reads from the calibration data (for the error without any);
    ``before_scales``: it changes the activations (so its pass runs, and it applies, before the
    activation ranges are measured), else it applies once the scales are known."""

    name = ""
    option = ""
    needs = ""
    before_scales = False

    def statistics(self) -> list[Statistic]:
        """The statistics to measure (none: the technique needs no data)."""
        return []

    def apply(self, quant) -> str | None:
        """Make the change from the measured statistics (and ``quant``, the scales, once known:
        None for a ``before_scales`` technique); returns one line for the summary, or None."""
        raise NotImplementedError
