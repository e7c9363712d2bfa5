"""The calibration pipeline: statistics that techniques declare, measured in one pass over the data.

A :class:`Statistic` is what a step of the recipe needs from the calibration data: nodes added to a
copy of the model (:meth:`Statistic.instrument`) and how each batch's values are reduced.
:func:`measure` instruments one clone of the model with every statistic it is given, runs the data
through it once on the executor ``RunOptions`` chooses (:mod:`fp8onnx.pipeline.executors`), and hands
each statistic its own reduced values. Two kinds cover every technique:

- :class:`Ranges`: each tensor's absolute maximum (and, for percentile/mse scaling, a fixed-bin
  histogram of |x|): static activation scales;
- :class:`Sums`: tensors computed in the graph from a named tensor and summed (or maxed) over the
  batches: GPTQ's X^T X, bias correction's input means, smoothing's per-channel amax.

Only these reductions leave onnxruntime, batch by batch: memory does not depend on the number of
samples, and layer by layer not on the model's size either. The model is cloned, never changed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.base.phases import phase
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.numerics.histogram import LogHistogram
from fp8onnx.passes import AMAX_SUFFIX, VALUE_SUFFIX, AddAmaxOutputsPass
from fp8onnx.passes.common import keep_only_outputs
from fp8onnx.passes.instrument import Reductions
from fp8onnx.pipeline.batching import _batched_inputs, _samples, auto_batch_size
from fp8onnx.pipeline.executors import LayerByLayer, executor_for

__all__ = ["F32", "Measured", "Ranges", "Statistic", "Sums", "measure", "reduce_batch"]

F32 = ir.DataType.FLOAT


class Statistic:
    """One statistic of the calibration data. ``tensors``: it fetches whole tensors (histograms),
    which sizes the batches by ``--batch-memory``; ``sized``: its batches may be sized that way at
    all (static activation ranges); otherwise they are ``run.batch`` samples."""

    tensors = False
    sized = False

    def instrument(self, model: ir.Model, tag: str) -> list[str]:
        """Add the nodes computing this statistic to ``model`` (a clone); return their output names."""
        raise NotImplementedError

    def merge(self, summary: dict) -> None:
        """One batch's :func:`reduce_batch` output (restricted to this statistic's outputs)."""
        raise NotImplementedError


def reduce_batch(values: dict[str, np.ndarray]) -> dict:
    """One batch's instrumented outputs, reduced where they were computed (in this process or on a
    Ray worker): amax outputs to one float, value outputs to sparse histogram counts, in-graph sums
    as they are. Merged in batch order, the statistics are the same bit for bit on every executor."""
    summary: dict[str, object] = {}
    for key, array in values.items():
        if key.endswith(AMAX_SUFFIX):
            summary[key] = float(array)
        elif key.endswith(VALUE_SUFFIX):
            hist = LogHistogram()
            hist.update(array)
            summary[key] = hist.sparse()
        else:
            summary[key] = array
    return summary


class Ranges(Statistic):
    """Running absolute maximum per tensor (NaN/Inf batches counted and skipped), and with
    ``histograms`` a :class:`~fp8onnx.numerics.histogram.LogHistogram` of |x| per tensor."""

    sized = True

    def __init__(self, names, histograms: bool = False):
        self.names = list(dict.fromkeys(names))
        self.tensors = histograms
        self.amax = dict.fromkeys(self.names, 0.0)
        self.nonfinite: dict[str, int] = {}
        self.hist = {n: LogHistogram() for n in self.names} if histograms else {}

    def instrument(self, model: ir.Model, tag: str) -> list[str]:
        AddAmaxOutputsPass(self.names, values=self.tensors)(model)
        return [n + AMAX_SUFFIX for n in self.names] + ([n + VALUE_SUFFIX for n in self.names] if self.tensors else [])

    def add(self, name: str, amax) -> None:
        a = float(amax)
        if math.isfinite(a):
            self.amax[name] = max(self.amax[name], a)
        else:
            self.nonfinite[name] = self.nonfinite.get(name, 0) + 1

    def merge(self, summary: dict) -> None:
        for key, part in summary.items():
            if key.endswith(AMAX_SUFFIX):
                self.add(key[: -len(AMAX_SUFFIX)], part)
            elif key.endswith(VALUE_SUFFIX):
                self.hist[key[: -len(VALUE_SUFFIX)]].add_sparse(part)


class Sums(Statistic):
    """For each named tensor, ``build(x, add)`` adds nodes computing its statistics from ``x``
    (``add(op, inputs, suffix, dtype=None, shape=None, **attrs)`` makes one node and returns its
    output; NumPy arrays among the inputs become constants) and returns the values to fetch.
    :attr:`result` is, per tensor, those values reduced over every batch by ``combine``
    (``np.add``: sums; ``np.maximum``: a running max), kept in ``dtype`` (float32 halves the
    memory of large sums such as the X^T X of every layer)."""

    def __init__(self, builders: dict, desc: str, combine=np.add, dtype=np.float64):
        self.builders, self.desc, self.combine, self.dtype = builders, desc, combine, dtype
        self.fetch: dict[str, list[str]] = {}
        self.sums: dict[str, np.ndarray] = {}
        self.dropped: set[str] = set()

    def instrument(self, model: ir.Model, tag: str) -> list[str]:
        graph = model.graph
        values = {v.name: v for n in graph for v in n.outputs}
        values.update({v.name: v for v in graph.inputs})
        for k, (name, build) in enumerate(self.builders.items()):
            nodes = Reductions(graph, f"fp8onnx_stat/{tag}{k}")
            outs = build(values[name], nodes.add)
            nodes.insert(values[name])
            graph.outputs.extend(outs)
            self.fetch[name] = [o.name for o in outs]
        return [o for names in self.fetch.values() for o in names]

    def merge(self, summary: dict) -> None:
        for o, value in summary.items():
            v = np.asarray(value, self.dtype)
            if o in self.sums:
                self.combine(self.sums[o], v, out=self.sums[o])  # in place: a 1B model's X^T X are GBs
            else:
                # summed into in place: a batch's own array is taken as it is (onnxruntime's outputs own
                # their memory through a base object; a read-only one, e.g. from Ray's store, is copied)
                self.sums[o] = v if v.flags.writeable else v.copy()

    def value_of(self, name: str) -> list[np.ndarray]:
        """Tensor ``name``'s reduced values (complete once every batch has run the nodes computing
        them: in sequential calibration, once their segment has)."""
        return [self.sums[o] for o in self.fetch[name]]

    def drop(self, name: str) -> None:
        """Forget tensor ``name``'s values (its user is done with them): memory for the rest."""
        for o in self.fetch[name]:
            self.sums.pop(o, None)
        self.dropped.add(name)

    @property
    def result(self) -> dict[str, list[np.ndarray]]:
        if len(self.sums) != sum(len(v) for k, v in self.fetch.items() if k not in self.dropped):
            raise Fp8OnnxError(f"No calibration batch to compute {self.desc} on.")
        return {name: [self.sums[o] for o in names] for name, names in self.fetch.items() if name not in self.dropped}


@dataclasses.dataclass
class Measured:
    """What one pass read: batches and samples, and how the batches were sized."""

    num_batches: int = 0
    num_samples: int = 0
    batching: str = ""
    executor: str = ""


def _merge(owner: dict, statistics: list, summary: dict) -> None:
    """One batch's ``summary`` (output name -> value) merged into the statistics that own its outputs."""
    parts: dict[int, dict] = {}
    for key, value in summary.items():
        parts.setdefault(id(owner[key]), {})[key] = value
    for stat in statistics:
        if id(stat) in parts:
            stat.merge(parts[id(stat)])


def measure(
    model: ir.Model,
    statistics: list[Statistic],
    data,
    run: RunOptions,
    desc: str,
    settle=None,
    sequential: bool = False,
) -> Measured:
    """Measure every statistic in ``statistics`` in one pass of ``data`` (a data source, as
    :func:`fp8onnx.data.datasource.as_data` makes it at the caller's entry) through ``model``; returns what
    the pass read.
    ``settle``: (names of the quantized layers' nodes, ``settle(node names, outputs complete so
    far)``), called after each segment of a layer-by-layer run (:class:`~fp8onnx.pipeline.executors.LayerByLayer`);
    ``sequential``: sequential calibration (:class:`~fp8onnx.pipeline.executors.Sequential`), where
    ``settle`` returns the stored values of the layers it rounded.

    requires: each statistic names tensors of ``model``'s main graph; ``data`` has ``batches()``.
    ensures: ``model`` unchanged (but for what ``settle`` changes); each statistic has merged every batch,
    in batch order."""
    done = Measured()
    statistics = [s for s in statistics if s is not None]
    if not statistics:
        return done
    with phase("instrument the graph"):
        instrumented = model.clone()
        original = {n.name for n in instrumented.graph}
        owner: dict[str, Statistic] = {}
        for i, stat in enumerate(statistics):
            owner.update(dict.fromkeys(stat.instrument(instrumented, f"{i}/" if i else ""), stat))
        outputs = list(owner)
        keep_only_outputs(instrumented, outputs)  # statistics only: not the model's own outputs
    if not outputs:
        return done
    source = data
    tensors = any(s.tensors for s in statistics)

    def counted(batches):
        for batch in batches:
            done.num_batches += 1
            done.num_samples += batch.size
            yield batch.feed

    kind, extra = executor_for(model, run, sequential), {}
    if settle is not None and issubclass(kind, LayerByLayer):
        new = [n.name for n in instrumented.graph if n.name not in original]  # the statistics' nodes
        extra = {"layers": settle[0], "settle": settle[1], "new": new}
    with kind(instrumented, outputs, run, f"The {desc} model", tensors, **extra) as executor:
        done.executor = executor.name
        probe = executor.probe() if any(s.sized for s in statistics) else None
        if probe is not None and run.batch_size is None and _batched_inputs(model):
            with phase("size the batches"):
                size, done.batching = auto_batch_size(probe, source, run.batch_memory)
        else:
            size, done.batching = run.batch, _samples(run.batch)
        merge = functools.partial(_merge, owner, statistics)
        executor.map(counted(source.batches(size)), reduce_batch, merge, source.count_batches(size), desc)
    if done.num_batches == 0:
        raise Fp8OnnxError("The calibration data gave no batches.")
    return done
