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

import dataclasses

import numpy as np

from fp8onnx.numerics.formats import dequantize, quantize
from fp8onnx.passes import TensorQuant
from fp8onnx.pipeline.statistics import Statistic

__all__ = ["Settled", "Technique", "stored_values"]


def stored_values(w: np.ndarray, tq: TensorQuant) -> np.ndarray:
    """``w`` as InsertQDQPass stores it with ``tq``'s scale(s): quantized and dequantized, float32."""
    scale = tq.full_scale(w.shape)
    return dequantize(quantize(w, scale, tq.format), scale, np.float32)


@dataclasses.dataclass
class Settled:
    """What a technique did at the end of a segment: the weights it stored (by name, as they will be
    written), and those it will store but cannot yet (their statistics are still to come)."""

    stored: dict = dataclasses.field(default_factory=dict)
    waiting: set = dataclasses.field(default_factory=set)


class Technique:
    """``name``: how the summary calls it; ``option``: the command-line option that asks for it;
    ``needs``: what it reads from the calibration data (for the error without any);
    ``before_scales``: it changes the activations (so its pass runs, and it applies, before the
    activation ranges are measured), else it applies once the scales are known; ``settles``: it acts
    on :meth:`on_segment_end`."""

    name = ""
    option = ""
    needs = ""
    before_scales = False
    settles = False  # it acts on on_segment_end (rounds weights as a layer-by-layer pass goes)

    def statistics(self) -> list[Statistic]:
        """The statistics to measure (none: the technique needs no data)."""
        return []

    def apply(self, quant) -> str | None:
        """Make the change from the measured statistics (and ``quant``, the scales, once known:
        None for a ``before_scales`` technique); returns one line for the summary, or None."""
        raise NotImplementedError

    def on_segment_end(self, quant, measured: set[str], weights: list[str]) -> Settled:
        """The pipeline's event after each segment of a layer-by-layer pass (llm-compressor's
        ``sequential_epoch_end``): ``measured``, the statistic outputs complete so far; ``weights``, the
        segment's weights the later segments read as stored (sequential calibration; else none). A
        technique that rounds weights as the pass goes stores what it can (GPTQ); the rest do nothing."""
        return Settled()
