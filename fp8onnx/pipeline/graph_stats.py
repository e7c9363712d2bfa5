"""Statistics computed in the graph and summed over calibration batches (GPTQ's X^T X, bias
correction's input means): only the reduced tensors leave onnxruntime, batch by batch.

``sum_in_graph(model, {tensor: build}, data, run, desc)``: for each named tensor, ``build(x, add)``
adds nodes computing its statistics from ``x`` (``add(op, inputs, suffix, **attrs)`` makes one node
and returns its output; NumPy arrays among the inputs become constants) and returns the values to
fetch; the result is, per tensor, the float64 sums of those values over every batch. The model is
cloned, never changed; a model above the weight budget runs layer by layer (:mod:`fp8onnx.pipeline.segments`),
as calibration does.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from fp8onnx.data.datasource import as_data
from fp8onnx.data.feeds import input_specs
from fp8onnx.errors import Fp8OnnxError
from fp8onnx.passes._common import initializer, insert_at_definition, keep_only_outputs
from fp8onnx.pipeline.segments import run_segmented, run_segmented_on
from fp8onnx.progress import progress_bar
from fp8onnx.runtime import RunOptions, session_for_model, weight_bytes

__all__ = ["F32", "sum_in_graph"]

F32 = ir.DataType.FLOAT
_PREFIX = "fp8onnx_stat/"


def sum_in_graph(
    model: ir.Model, builders: dict, data, run: RunOptions, desc: str, combine=np.add, dtype=np.float64
) -> dict[str, list[np.ndarray]]:
    """See the module docstring; ``combine`` merges one batch's values into the running ones
    (``np.maximum`` for a running max), kept in ``dtype`` (float32 halves the memory of large sums
    such as the X^T X of every layer)."""
    if not builders:
        return {}
    instrumented = model.clone()
    graph = instrumented.graph
    values = {v.name: v for n in graph for v in n.outputs}
    values.update({v.name: v for v in graph.inputs})
    fetch: dict[str, list[str]] = {}
    for k, (name, build) in enumerate(builders.items()):
        x = values[name]
        nodes: list[ir.Node] = []

        def add(op_type, inputs, suffix, dtype=None, shape=None, _k=k, _nodes=nodes, **attrs):
            inputs = [
                initializer(graph, f"{_PREFIX}{_k}/c{len(_nodes)}_{i}", v) if isinstance(v, np.ndarray) else v
                for i, v in enumerate(inputs)
            ]
            node = ir.node(op_type, inputs, attrs or None, name=f"{_PREFIX}{_k}/{suffix}{len(_nodes)}")
            node.outputs[0].name = node.name
            if dtype is not None:
                node.outputs[0].dtype = dtype
            if shape is not None:
                node.outputs[0].shape = ir.Shape(shape)
            _nodes.append(node)
            return node.outputs[0]

        outs = build(x, add)
        insert_at_definition(x, nodes)
        graph.outputs.extend(outs)
        fetch[name] = [o.name for o in outs]
    outputs = [o for names in fetch.values() for o in names]
    keep_only_outputs(instrumented, outputs)
    sums: dict[str, np.ndarray] = {}

    wanted = set(outputs)

    def accumulate(got: dict) -> None:  # all outputs at once, or one segment's (layer by layer)
        for o, value in got.items():
            if o in wanted:
                v = np.asarray(value, dtype)
                sums[o] = v if o not in sums else combine(sums[o], v)

    source = as_data(data, input_specs(model), model)
    total = source.count_batches(run.batch)
    feeds = (b.feed for b in source.batches(run.batch))
    bar = functools.partial(progress_bar, unit="batch", enable=run.progress)
    show = lambda it, n, d: bar(it, total=n, desc=d)  # noqa: E731
    segmented = weight_bytes(model) > run.weight_memory
    if segmented and run.distributed:  # each segment's batches on Ray workers (fp8onnx.pipeline.distributed)
        from fp8onnx.pipeline.distributed import shared_pool

        with shared_pool(run.workers, run.ray_address) as pool:
            budget = run.weight_memory
            merge = lambda _, got: accumulate(got)  # noqa: E731
            run_segmented_on(
                pool, instrumented, outputs, feeds, dict, merge, budget=budget, provider=run.provider, progress=show
            )
    elif segmented:
        budget, merge = run.weight_memory, lambda _, got: accumulate(got)
        run_segmented(instrumented, outputs, feeds, merge, budget=budget, provider=run.provider, progress=show)
    elif run.distributed:  # per-batch values summed here in batch order: the single-process sums
        from fp8onnx.pipeline.distributed import map_outputs

        for values in bar(map_outputs(run, instrumented, outputs, feeds, f"The {desc} model"), total=total, desc=desc):
            accumulate(dict(zip(outputs, values)))
    else:
        session = session_for_model(instrumented, run.provider, f"The {desc} model", instrumented=True)
        for feed in bar(feeds, total=total, desc=desc):
            accumulate(dict(zip(outputs, session.run(outputs, feed))))
    if len(sums) != len(outputs):
        raise Fp8OnnxError(f"No calibration batch to compute {desc} on.")
    return {name: [sums[o] for o in names] for name, names in fetch.items()}
