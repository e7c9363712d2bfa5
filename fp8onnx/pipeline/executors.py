"""Executors: how the calibration pipeline runs an instrumented model over batches of data.

One executor per way of running, chosen from :class:`~fp8onnx.graph.run_settings.RunOptions` by
:func:`executor_for` (never by a technique):

- :class:`InProcess`: the whole graph in one onnxruntime session in this process;
- :class:`LayerByLayer`: a model whose weights exceed ``run.weight_memory`` runs in segments holding
  at most that much of its weights each (:mod:`fp8onnx.pipeline.segments`);
- :class:`Sequential`: layer by layer in the order of the quantized layers, each measured on the
  results of those before it as they will be stored (sequential calibration, a recipe's choice:
  ``--sequential``; it runs in this process);
- :class:`RayWorkers`: ``run.workers`` > 1: the batches on Ray actors (:mod:`fp8onnx.pipeline.distributed`),
  layer by layer there too when the weights exceed the budget.

requires: an instrumented model whose outputs include ``outputs`` (statistics, not the model's own).
ensures: ``reduce`` (a module-level function, so it can travel to a worker) is applied to each batch's
fetched values where they were computed, and ``merge`` receives the reductions here, in batch order,
whichever executor ran them: merged in that order, the statistics are the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.base.phases import phase
from fp8onnx.base.progress import progress_bar
from fp8onnx.graph import known
from fp8onnx.graph.run_settings import RunOptions
from fp8onnx.graph.runtime import session_for_model, weight_bytes
from fp8onnx.pipeline.batching import _run_peak, _segmented_values
from fp8onnx.pipeline.distributed import fetch, shared_pool, statistics_pool
from fp8onnx.pipeline.segments import run_segmented, run_segmented_on

__all__ = ["Executor", "InProcess", "LayerByLayer", "RayWorkers", "Sequential", "executor_for"]


def executor_for(model: ir.Model, run: RunOptions, sequential: bool = False) -> type[Executor]:
    """The executor ``run`` asks for on ``model`` (``sequential``: the recipe's sequential calibration)."""
    if sequential:
        return Sequential
    if run.distributed:
        return RayWorkers
    return LayerByLayer if weight_bytes(model) > run.weight_memory else InProcess


class Executor:
    """Runs ``model``'s ``outputs`` over feeds; ``tensors``: whole tensors come back (histograms),
    not just scalars and small sums, which sizes the batches and onnxruntime's arena."""

    name = ""

    def __init__(self, model: ir.Model, outputs: list[str], run: RunOptions, what: str, tensors: bool = False):
        self.model, self.outputs, self.run, self.what, self.tensors = model, outputs, run, what, tensors
        self.layered = weight_bytes(model) > run.weight_memory

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def probe(self) -> Callable[[dict], tuple[int, int]] | None:
        """A function measuring one feed's (bytes fetched, resident growth), to size the batches by
        ``--batch-memory``; None where the batch cost is one segment's activations (layer by layer
        with scalar statistics): the batches are then ``run.batch`` samples."""
        if not self.tensors:
            return None
        return lambda feed: _segmented_values(self.model, self.outputs, feed, self.run.weight_memory, self.run.provider)

    def bar(self, items: Iterable, total: int | None, desc: str) -> Iterable:
        return progress_bar(items, total=total, desc=desc, unit="batch", enable=self.run.progress)

    def map(self, feeds: Iterable[dict], reduce: Callable, merge: Callable, total: int | None, desc: str) -> None:
        raise NotImplementedError


class InProcess(Executor):
    name = "in process"

    def __enter__(self):
        # ORT's arena kept growing over the first batches when whole tensors are fetched for histograms
        # (peak RSS 12% higher at 1,024 than at 128 samples on all-MiniLM-L6-v2); without it RSS is flat.
        with phase("onnxruntime session"):
            self.session = session_for_model(
                self.model, self.run.provider, self.what, arena=not self.tensors, instrumented=True
            )
        return self

    def __exit__(self, *exc) -> None:
        self.session = None

    def probe(self):
        return lambda feed: _run_peak(self.session, self.outputs, feed)

    def map(self, feeds, reduce, merge, total, desc) -> None:
        with phase("run the calibration batches"):
            for b, feed in enumerate(self.bar(feeds, total, desc)):
                try:
                    values = self.session.run(self.outputs, feed)
                except Exception as exc:
                    raise Fp8OnnxError(f"Calibration batch {b} failed in onnxruntime: {first_line(exc)}") from exc
                merge(reduce(dict(zip(self.outputs, values))))


class LayerByLayer(Executor):
    """Segments of at most ``run.weight_memory`` bytes of weights. ``settle(node names, statistic
    outputs complete so far)``, if given, is called after each segment has run over every batch: a
    technique can then use what is complete and drop it (GPTQ rounds those layers), so that memory
    holds one segment's statistics rather than all of them."""

    name = "layer by layer"

    def __init__(self, model, outputs, run, what, tensors=False, *, settle=None, layers=(), new=()):
        super().__init__(model, outputs, run, what, tensors)
        self.settle, self.layers, self.new = settle, set(layers), set(new)

    def segments(self):
        """``run_segmented``'s ``sequential`` argument: None here (cuts by weight budget only)."""
        return None

    def map(self, feeds, reduce, merge, total, desc) -> None:
        graph, run = self.model.graph, self.run
        completed: set[str] = set()
        settle = None
        if self.settle is not None:

            def settle(seg) -> None:
                completed.update(known.name(v) for v in seg.outputs)
                stored = self.settle([n.name for n in seg.nodes], completed)
                if self.segments() is not None:  # sequential: later segments read the layers as stored
                    for name, tensor in stored.items():
                        graph.initializers[name].const_value = tensor

        run_segmented(
            self.model,
            self.outputs,
            feeds,
            lambda _, values: merge(reduce(values)),
            budget=run.weight_memory,
            provider=run.provider,
            progress=lambda it, n, d: self.bar(it, n, d),
            sequential=self.segments(),
            settle=settle,
        )


class Sequential(LayerByLayer):
    """Layer by layer, cut so that no quantized layer (``layers``: their node names), nor any
    statistic (``new``: the nodes the statistics added), reads a value computed downstream of another
    quantized layer in the same segment; after each segment, ``settle`` returns the stored values of
    the weights it rounded (by initializer name), and a segment with quantized layers runs again on
    those for the segments after it."""

    name = "sequential"

    def segments(self):
        layers = {id(n) for n in self.model.graph if n.name in self.layers}
        return layers, layers | {id(n) for n in self.model.graph if n.name in self.new}


class RayWorkers(Executor):
    name = "Ray workers"

    def __enter__(self):

        with phase("Ray workers"):
            if self.layered:  # each segment's batches shared by the workers
                self.pool = shared_pool(self.run.workers, self.run.ray_address, self.run.ray_timeout)
            else:
                self.pool = statistics_pool(self.run, self.model, self.what)
        self.pool.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.pool.__exit__(*exc)

    def probe(self):
        if self.layered:
            return super().probe()
        # one sample measured on a worker: the budget is a worker's
        return lambda feed: next(iter(self.pool.map(_run_peak, [(self.outputs, feed)])))

    def map(self, feeds, reduce, merge, total, desc) -> None:
        run = self.run
        if self.layered:
            show = lambda it, n, d: self.bar(it, n, d)  # noqa: E731
            on_summary = lambda _, summary: merge(summary)  # noqa: E731
            run_segmented_on(
                self.pool,
                self.model,
                self.outputs,
                feeds,
                reduce,
                on_summary,
                budget=run.weight_memory,
                provider=run.provider,
                progress=show,
            )
            return
        with phase("run the calibration batches"):
            work = ((self.outputs, feed, reduce, self.what) for feed in feeds)
            for summary in self.bar(self.pool.map(fetch, work), total, desc):
                merge(summary)
