"""onnxruntime's own operator schemas, for a graph that cannot be loaded here.

A model whose ops only another EP runs (``com.microsoft.GemmFloat8`` on the CUDA EP) is written without
an onnxruntime session to load it, and onnx.checker does not know its contrib ops. A node that sets an
attribute the op's schema lacks makes every EP refuse the model ("Unrecognized attribute": a ``rowMajor``
did, on the H200 with onnxruntime-gpu 1.31.1), so that much is checked here, against the schemas that
the installed onnxruntime registers (CPU and GPU builds register the same contrib schemas).
"""

from __future__ import annotations

import functools

import onnx_ir as ir
import onnxruntime as ort

from fp8onnx.base.errors import Fp8OnnxError

__all__ = ["check_attributes", "unknown_attributes"]


@functools.cache
def _schemas() -> dict[tuple[str, str], frozenset[str]]:
    """(domain, op_type) -> attribute names of every operator this onnxruntime registers."""
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    return {(s.domain, s.name): frozenset(s.attributes) for s in capi.get_all_operator_schema()}


def unknown_attributes(model: ir.Model, domain: str = "com.microsoft") -> list[str]:
    """One sentence per node of ``domain`` that sets an attribute onnxruntime's schema of its op does not have.

    requires: ``model`` is an onnx_ir model. ensures: [] when every such node's attributes are known, or
    its op is not registered in this onnxruntime build (then nothing can be said of it here)."""
    problems = []
    for node in model.graph.all_nodes():
        known = _schemas().get((node.domain, node.op_type)) if node.domain == domain else None
        extra = sorted(set(node.attributes) - known) if known is not None else []
        if extra:
            problems.append(
                f"node {node.name!r} ({domain}.{node.op_type}) sets {', '.join(extra)}, which onnxruntime "
                f"{ort.__version__}'s schema of {node.op_type} does not have"
            )
    return problems


def check_attributes(model: ir.Model, what: str) -> None:
    """Refuse ``model`` (``what`` names it) in one sentence where :func:`unknown_attributes` finds any."""
    if problems := unknown_attributes(model):
        raise Fp8OnnxError(f"{what} would not load in onnxruntime: {problems[0]}.")
