"""Layer-by-layer execution: run a model in segments that each hold a bounded share of its weights.

Static calibration has to run the float model. One onnxruntime session for a model whose weights
are larger than the memory on hand would need them all at once; instead the main graph's nodes (in
topological order) are cut into segments whose weights add up to at most ``budget`` bytes. Each
segment becomes a small session of its own; its large weights are not built into the session but
fed at run time as NumPy views of the memory-mapped external data, and unmapped when the segment is
done. Tensors that cross a cut are written to a temporary folder, one file per batch, and read back
by the segment that needs them, then deleted. So memory holds one segment's weights and one batch's
activations, whatever the model's size or the number of samples; the price is one disk round trip
per crossing tensor and batch.

Results are those of the whole graph: the same kernels run on the same values (only onnxruntime's
fusions across a cut are lost, which may change the last bits).
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
from collections.abc import Callable, Iterable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.base.phases import phase
from fp8onnx.base.scratch import make_dir, remove
from fp8onnx.graph import known
from fp8onnx.graph.runtime import make_session, open_weights, session_from_portable, weight_location
from fp8onnx.passes import release
from fp8onnx.pipeline.cuts import FEED_BYTES, Segment, split

__all__ = ["FEED_BYTES", "Segment", "Spill", "run_segmented", "split"]  # the cuts (pipeline.cuts) re-exported

logger = logging.getLogger(__name__)


def _value_info(name: str, dtype: int | None, rank_or_shape) -> onnx.ValueInfoProto:
    if dtype is None:
        info = onnx.ValueInfoProto()
        info.name = name
        return info
    shape = [None] * rank_or_shape if isinstance(rank_or_shape, int) else rank_or_shape
    return helper.make_tensor_value_info(name, dtype, shape)


def _segment_proto(model: ir.Model, seg: Segment, first_feed: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A self-contained model of ``seg``: activations and large weights are graph inputs."""
    inputs = [
        _value_info(name, helper.np_dtype_to_tensor_dtype(first_feed[name].dtype), first_feed[name].ndim)
        for name in map(known.name, seg.inputs)
    ]
    weights = [(known.name(v), known.constant(v)) for v in seg.weights]
    inputs += [_value_info(name, int(t.dtype), list(t.shape.numpy())) for name, t in weights]
    outputs = [_value_info(known.name(v), int(v.dtype) if v.dtype is not None else None, None) for v in seg.outputs]
    constants = []
    for v in seg.constants:
        t = known.constant(v)
        proto = ir.serde.serialize_tensor(ir.Tensor(t.numpy(), dtype=t.dtype, name=v.name))
        release(t)
        constants.append(proto)
    graph = helper.make_graph(
        [ir.serde.serialize_node(n) for n in seg.nodes], "segment", inputs, outputs, initializer=constants
    )
    opsets = [helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    proto = helper.make_model(graph, opset_imports=opsets)
    proto.ir_version = model.ir_version
    proto.functions.extend(ir.serde.serialize_function(f) for f in model.functions.values())
    return proto


class Spill:
    """Arrays kept on disk between passes, one .npy file per (name, batch) in a temporary folder. A batch
    whose array equals an earlier batch's holds no file of its own: it names that batch (its owner)."""

    def __init__(self):
        self.root = pathlib.Path(make_dir("fp8onnx-segments-"))
        self.ids: dict[str, int] = {}
        self.nbytes = 0
        self.owners: dict[tuple[str, int], int] = {}  # (name, batch) -> the batch whose file holds it
        self._digests: dict[tuple[str, str], int] = {}  # (name, content digest) -> the first batch with it

    def _path(self, name: str, batch: int) -> pathlib.Path:
        return self.root / f"{self.ids.setdefault(name, len(self.ids))}-{batch}.npy"

    def owner(self, name: str, batch: int) -> int:
        return self.owners.get((name, batch), batch)

    def save(self, name: str, batch: int, array: np.ndarray) -> None:
        self.owners.pop((name, batch), None)
        try:
            np.save(self._path(name, batch), array, allow_pickle=False)
        except OSError as exc:
            raise Fp8OnnxError(
                f"Cannot write intermediate arrays to {str(self.root)!r}: {exc.strerror or exc} "
                "(set TMPDIR to a folder with more space)."
            ) from exc
        self.nbytes += array.nbytes

    def save_input(self, name: str, batch: int, array: np.ndarray) -> None:
        """A graph input's array: shared with the earliest batch whose array is the same (dtype, shape
        and bytes: a digest, then the arrays compared), else saved."""
        flat = np.ascontiguousarray(array).reshape(-1)  # a 0-d array as one element: the saved array keeps its shape
        digest = hashlib.blake2b(flat.view(np.uint8).data, digest_size=16)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        key = (name, digest.hexdigest())
        first = self._digests.get(key)
        if first is not None:
            stored = self.load(name, first)
            if stored.dtype == array.dtype and stored.shape == array.shape and np.array_equal(stored, array):
                self.share(name, batch, first)
                return
        self._digests.setdefault(key, batch)
        self.save(name, batch, array)

    def share(self, name: str, batch: int, other: int) -> None:
        """``batch``'s ``name`` is ``other``'s: no file of its own."""
        self.owners[(name, batch)] = self.owner(name, other)

    def load(self, name: str, batch: int) -> np.ndarray:
        return np.load(self._path(name, self.owner(name, batch)), allow_pickle=False)

    def drop(self, name: str, batches: int) -> None:
        for b in range(batches):
            self.owners.pop((name, b), None)
            self._path(name, b).unlink(missing_ok=True)

    def close(self) -> None:
        remove(self.root)


def run_segmented(
    model: ir.Model,
    wanted: Iterable[str],
    feeds: Iterable[dict[str, np.ndarray]],
    on_result: Callable[[int, dict[str, np.ndarray]], None],
    *,
    budget: int,
    provider: str = "cpu",
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
    sequential=None,
    settle: Callable[[Segment], None] | None = None,
) -> int:
    """Run ``model`` over every feed, segment by segment; ``on_result(batch, {name: array})`` gets the
    ``wanted`` values each segment computes. Returns the number of batches.

    ``settle(segment)`` is called once a segment has run over every batch. Sequential calibration
    (``sequential``: see :func:`split`): there it replaces the segment's quantized layers' weights by
    the values they will be stored as, and the segment runs again to give later segments its results
    from those: each layer is measured on the outputs of the quantized layers before it (GPTQ's own
    order)."""
    wanted = list(dict.fromkeys(wanted))
    segments = split(model.graph, budget, wanted, sequential)
    layers = sequential[0] if sequential else set()
    logger.info(
        "running %d segments of at most %.1f MB of weights each", len(segments), max(s.nbytes for s in segments) / 1e6
    )
    spill = Spill()
    try:
        graph_inputs = {v.name for v in model.graph.inputs}
        num_batches = 0
        for feed in feeds:
            for name, array in feed.items():
                if name in graph_inputs:
                    spill.save_input(name, num_batches, array)
            num_batches += 1
        last_read = {known.name(v): i for i, seg in enumerate(segments) for v in seg.inputs}
        for i, seg in enumerate(segments):
            if not seg.outputs:
                continue  # computes nothing anyone asked for (e.g. the model's own outputs only)
            args = (model, seg, f"{i + 1}/{len(segments)}", num_batches, spill, set(wanted))
            rounded = any(id(n) in layers for n in seg.nodes)  # sequential: run again once rounded
            _run_segment(*args, on_result, provider, progress, keep=not rounded)
            if settle is not None:
                settle(seg)
            if rounded and seg.later:  # its results for later segments, from the rounded layers
                _run_segment(*args, lambda b, v: None, provider, progress)
            for name in [n for n, last in last_read.items() if last == i]:
                spill.drop(name, num_batches)
        logger.info("layer-by-layer run spilled %.0f MB of activations to disk", spill.nbytes / 1e6)
        return num_batches
    finally:
        spill.close()


def _run_segment(model, seg, place: str, num_batches, spill, wanted, on_result, provider, progress, keep=True):
    """Segment ``seg`` (``place``: "i/n") over every batch: ``wanted`` values to ``on_result``, later ones spilled.
    A batch whose every input is an earlier batch's (``Spill.owner``: the loss choice's gate settings before
    their gate's segment) is not run again: it gets that batch's values."""
    what = f"Calibration segment {place} (from node {seg.nodes[0].name!r})"
    names = [v.name for v in seg.outputs]
    sources = [tuple(spill.owner(v.name, b) for v in seg.inputs) for b in range(num_batches)]
    first_with: dict[tuple[int, ...], int] = {}
    same = [first_with.setdefault(src, b) for b, src in enumerate(sources)]  # the batch each one repeats
    last_use = {a: b for b, a in enumerate(same)}
    shared: dict[int, dict[str, np.ndarray]] = {}  # a repeated batch's wanted values, until its last repeat
    batches = range(num_batches)
    if progress is not None:
        batches = progress(batches, num_batches, f"segment {place}")
    session = None
    weights = {}  # read once per segment: views of the memory-mapped file (or computed once, if lazy)
    for b in batches:
        if same[b] != b:  # the values of an earlier batch, which had the same inputs
            a = same[b]
            on_result(b, dict(shared[a]))
            if keep:
                for name in names:
                    if name in seg.later:
                        spill.share(name, b, a)
            if last_use[a] == b:
                del shared[a]
            continue
        feed = {v.name: spill.load(v.name, b) for v in seg.inputs}
        if session is None:
            with phase("segment sessions"):
                session = make_session(
                    _segment_proto(model, seg, feed).SerializeToString(), provider, what, instrumented=True
                )
            with phase("segment weights (mapped or computed)"):
                weights = {v.name: v.const_value.numpy() for v in seg.weights}
        feed.update(weights)
        try:
            with phase("segment runs"):
                values = session.run(names, feed)
        except Exception as exc:
            raise Fp8OnnxError(f"{what} failed on batch {b} in onnxruntime: {first_line(exc)}") from exc
        del feed
        results = {name: array for name, array in zip(names, values) if name in wanted}
        if last_use[b] != b:
            shared[b] = results
        on_result(b, results)
        for name, array in zip(names, values):
            if keep and name in seg.later:
                spill.save(name, b, array)
    del session, weights
    for v in seg.weights:
        release(v.const_value)


class _SegmentSession:
    """A Ray worker's session of one segment, with its large weights memory-mapped (or as arrays)."""

    def __init__(self, portable, provider: str, what: str, threads: int):
        graph, where = portable
        self.weights = open_weights(where)  # the segment's large weights are inputs, fed at every run
        self.session = session_from_portable((graph, {}), provider, what, instrumented=True, threads=threads)
        self.inputs = {i.name for i in self.session.get_inputs()}


def segment_batch(sess: _SegmentSession, b: int, what: str, names, later, wanted, summarize, *produced):
    """One batch of one segment on a Ray worker: its inputs from the dicts earlier segments (and the
    feed) produced; returns (``summarize`` of the wanted values, the values later segments read)."""
    feed = {k: v for d in produced for k, v in d.items() if k in sess.inputs}
    feed.update(sess.weights)
    try:
        values = dict(zip(names, sess.session.run(names, feed)))
    except Exception as exc:
        raise Fp8OnnxError(f"{what} failed on batch {b} in onnxruntime: {first_line(exc)}") from exc
    return summarize({k: v for k, v in values.items() if k in wanted}), {k: values[k] for k in later}


def _last_readers(segments: list, graph_inputs: set[str]) -> dict[str | int, int]:
    """producer ("feed", or a segment's index) -> the index of the last segment that reads its outputs."""
    source: dict[str, str | int] = {name: "feed" for name in graph_inputs}
    last_read: dict[str | int, int] = {}
    for i, seg in enumerate(segments):
        for v in seg.inputs:
            last_read[source.get(known.name(v), "feed")] = i
        source.update({known.name(v): i for v in seg.outputs})
    return last_read


def _load_segment(pool, model: ir.Model, seg, first: list, provider: str, what: str) -> None:
    """Every worker of ``pool`` holds a session of segment ``seg``, typed from ``first`` (object-store
    references to the first batch's inputs), its weights memory-mapped where the workers are local."""
    inputs = {}
    for ref in first:
        inputs.update(pool.get(ref))
    proto = _segment_proto(model, seg, inputs).SerializeToString()
    del inputs
    where = {v.name: weight_location(v.const_value, files=pool.local) for v in seg.weights}
    pool.load((proto, where), _SegmentSession, provider, what)


def run_segmented_on(
    pool,
    model: ir.Model,
    wanted: Iterable[str],
    feeds: Iterable[dict[str, np.ndarray]],
    summarize: Callable[[dict[str, np.ndarray]], object],
    on_summary: Callable[[int, object], None],
    *,
    budget: int,
    provider: str = "cpu",
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
) -> int:
    """:func:`run_segmented` on a :class:`fp8onnx.pipeline.distributed.WorkerPool`: each segment's batches are
    shared by the workers (one session of that segment each, its weights memory-mapped from the
    model's file on this machine, or sent by value to a cluster); the tensors that cross a cut stay in
    Ray's object store instead of a temporary folder. ``summarize`` runs on the worker (the same
    function the caller applies in one process), ``on_summary(batch, summary)`` here, in batch
    order. Returns the number of batches."""
    wanted = list(dict.fromkeys(wanted))
    segments = split(model.graph, budget, wanted)

    logger.info("running %d segments on %d Ray workers", len(segments), len(pool.workers))
    graph_inputs = {known.name(v) for v in model.graph.inputs}
    produced: dict[tuple[str | int, int], object] = {}  # (producer, batch) -> object-store reference
    num_batches = 0
    for feed in feeds:
        produced[("feed", num_batches)] = pool.put({k: v for k, v in feed.items() if k in graph_inputs})
        num_batches += 1
    last_read = _last_readers(segments, graph_inputs)
    source: dict[str, str | int] = {name: "feed" for name in graph_inputs}  # tensor -> producer ("feed", segment)
    for i, seg in enumerate(segments):
        producers = sorted({source[known.name(v)] for v in seg.inputs}, key=str)
        source.update({known.name(v): i for v in seg.outputs})
        if not seg.outputs or num_batches == 0:
            continue
        what = f"Calibration segment {i + 1}/{len(segments)} (from node {seg.nodes[0].name!r})"
        first = [produced[(p, 0)] for p in producers]  # the first batch's inputs: the segment's input types
        _load_segment(pool, model, seg, first, provider, what)
        names = [v.name for v in seg.outputs]
        later = sorted(seg.later)
        items = (
            (b, what, names, later, set(wanted), summarize, *[produced[(p, b)] for p in producers])
            for b in range(num_batches)
        )
        results = pool.map(segment_batch, items, keep=True)
        if progress is not None:
            results = progress(results, num_batches, f"segment {i + 1}/{len(segments)}")
        for b, (summary, kept) in enumerate(results):
            on_summary(b, summary)
            produced[(i, b)] = kept
        for v in seg.weights:
            release(v.const_value)
        for p in [p for p, last in last_read.items() if last == i]:  # no later segment reads them
            for b in range(num_batches):
                produced.pop((p, b), None)
    return num_batches
