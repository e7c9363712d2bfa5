"""onnxruntime's CUDA fast path for float8 weights: ``com.microsoft.MatMulBlockQuantizedFp8Weight``.

The CUDA EP runs a float8 Q/DQ graph as dequantize + FP16/FP32 GEMM, with no fusion (its QDQ
transformers have no float8 rule). ``MatMulBlockQuantizedFp8Weight`` (CUDA EP, onnxruntime >= 1.29;
no CPU kernel) reads the float8 weight itself: A FP16/BF16 ``[..., K]``, B float8e4m3fn ``[N, K]``,
``b_scale`` float32 ``[N, ceil(K / block_size)]``, an optional scalar float32 ``a_scale`` (A quantized
to E4M3 with it: W8A8 numerics; absent: W8A16) and an optional bias ``[N]`` in A's type; the output
is in A's type. It is what onnxruntime-genai's builder writes for FP8 checkpoints (``block_size`` =
K there: one scale per output channel). Read from onnxruntime's ``contrib_ops/cuda/math/
matmul_block_scaled_fp8.{h,cc,cu}`` (1.29-1.32): ``block_size`` may be any positive number; its
decode path (GEMV) needs M <= 8, K % 16 == 0 and block_size % 16 == 0, else it dequantizes the
weight to A's type (fp32 multiply, one rounding) and multiplies with cuBLAS (fp32 accumulation),
rounds the product to A's type, then adds the bias (a second rounding). With ``a_scale``, A is
``T(e4m3(float(A) * (1 / a_scale)) * a_scale)``, saturating, round to nearest even.

:class:`BlockFp8MatMulPass` rewrites a quantized MatMul/Gemm whose weight is ``DequantizeLinear`` of a
2-D float8e4m3fn initializer (per tensor, per output channel, or blocks along K) into that op. A
static per-tensor E4M3 activation Q/DQ in front of it becomes ``a_scale`` (W8A8); any other input
(float, dynamic or per-token Q/DQ, E5M2) is A as it is (W8A16). A float32 A is cast to float16 and
the output back. :class:`EmulateBlockFp8MatMulPass` lowers the op to standard ONNX with the CUDA
kernel's default-path numerics, so that onnxruntime's CPU EP (and onnx.reference) can evaluate a
model written for the GPU; ``fp8onnx.numerics.gemm_float8_ref.matmul_block_quantized_fp8_weight`` is the
NumPy reference both are tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from ..numerics.formats import Fp8Format
from .common import initializer, transposed
from .known import constant, dim, graph_of, required_input
from .known import dtype as dtype_of
from .known import name as name_of
from .known import shape as shape_of

__all__ = [
    "BLOCK_FP8_OP",
    "BlockFp8MatMulPass",
    "BlockFp8Result",
    "EmulateBlockFp8MatMulPass",
    "block_fp8_reason",
    "has_block_fp8",
]

logger = logging.getLogger(__name__)
MS_DOMAIN = "com.microsoft"
BLOCK_FP8_OP = "MatMulBlockQuantizedFp8Weight"
_A_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_E4M3 = ir.DataType.FLOAT8E4M3FN


def block_fp8_reason(node: ir.Node, weight_format: Fp8Format) -> str | None:
    """Why ``node`` (before quantization) cannot take the fast form, or None: a MatMul/Gemm with a
    2-D constant weight, E4M3 weights, no transposed A."""
    if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} has no block-FP8 GEMM (MatMul/Gemm only)"
    if weight_format is not Fp8Format.E4M3FN:
        return f"{weight_format.value} weights (the op takes float8e4m3fn only)"
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or w.const_value is None or w.shape is None or len(w.shape) != 2:
        return "the weight is not a 2-D initializer"
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0:
        return "Gemm with transA=1"
    a = required_input(node, 0)
    if a.dtype not in (*_A_TYPES, ir.DataType.FLOAT):
        return f"input A is {a.dtype} (the op takes float16/bfloat16)"
    return None


def has_block_fp8(model: ir.Model) -> bool:
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    return any(n.op_type == BLOCK_FP8_OP and n.domain == MS_DOMAIN for n in nodes)


def _dq(value: ir.Value | None) -> ir.Node | None:
    producer = value.producer() if value is not None else None
    return producer if producer is not None and producer.op_type == "DequantizeLinear" else None


def _const(value: ir.Value | None) -> np.ndarray | None:
    return None if value is None or value.const_value is None else value.const_value.numpy()


def _no_zero_point(node: ir.Node) -> bool:
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    return zp is None or (zp.const_value is not None and not np.any(zp.const_value.numpy().astype(np.float32)))


def _weight(node: ir.Node) -> tuple[ir.Value, np.ndarray, int, bool] | str:
    """(float8 codes, b_scale [N, blocks], block_size, codes stored [K, N]) of the weight's DQ, or why not."""
    dq = _dq(node.inputs[1])
    if dq is None:
        return "the weight is not a DequantizeLinear output"
    codes, scale = required_input(dq, 0), _const(dq.inputs[1])
    if codes.const_value is None or codes.dtype != _E4M3 or codes.shape is None or len(codes.shape) != 2:
        return "the weight is not a 2-D float8e4m3fn initializer"
    if scale is None or not _no_zero_point(dq):
        return "the weight's scale is computed or it has a zero point"
    kn = not (node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0)  # stored [K, N]
    k, n = codes.shape.numpy() if kn else codes.shape.numpy()[::-1]
    k_axis = 0 if kn else 1
    scale = scale.astype(np.float32)
    block = dq.attributes.get_int("block_size", 0)
    axis = dq.attributes.get_int("axis", 1) % 2
    if scale.size == 1:
        b_scale, block = np.full((n, 1), scale.reshape(()), np.float32), k
    elif block:
        if axis != k_axis:
            return "blocks run along the output channels, not along K"
        b_scale = np.ascontiguousarray(scale.T if kn else scale)
    elif scale.ndim == 1 and axis != k_axis and scale.size == n:
        b_scale, block = scale.reshape(n, 1).copy(), k
    else:
        return "the weight's scales are neither per tensor, per output channel nor blocks along K"
    if node.op_type == "Gemm":
        b_scale *= np.float32(node.attributes.get_float("alpha", 1.0))
    return codes, b_scale, int(block), bool(kn)


def _static_e4m3(a: ir.Value | None) -> tuple[ir.Value, np.ndarray] | None:
    """(x, its scale) when ``a`` is DequantizeLinear(QuantizeLinear(x)) to E4M3 with one constant scale."""
    dq = _dq(a)
    if dq is None:
        return None
    a8 = required_input(dq, 0)
    q = a8.producer()
    if q is None or q.op_type != "QuantizeLinear" or a8.dtype != _E4M3:
        return None
    s_q, s_dq = _const(q.inputs[1]), _const(dq.inputs[1])
    if s_q is None or s_dq is None or s_q.size != 1 or s_dq.size != 1 or s_q.reshape(()) != s_dq.reshape(()):
        return None
    if not (_no_zero_point(q) and _no_zero_point(dq)) or q.attributes.get_int("block_size", 0) != 0:
        return None
    return required_input(q, 0), s_q.astype(np.float32).reshape(())


@dataclasses.dataclass
class BlockFp8Result(ir.passes.PassResult):
    """Nodes written as the op (W8A8 and W8A16), and the quantized MatMul/Gemm left as Q/DQ with why."""

    w8a8: list[str] = dataclasses.field(default_factory=list)
    w8a16: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        """What a report keeps: the op, the nodes in each numerics, the rest with why."""
        return {"op": f"{MS_DOMAIN}.{BLOCK_FP8_OP}", "w8a8": self.w8a8, "w8a16": self.w8a16, "kept_qdq": self.skipped}


class BlockFp8MatMulPass(ir.passes.InPlacePass):
    """requires: float8 Q/DQ (opset >= 21); ensures: every MatMul/Gemm whose weight is a DequantizeLinear
    of a 2-D float8e4m3fn initializer with per-tensor, per-channel or K-blocked scales is now
    ``com.microsoft.MatMulBlockQuantizedFp8Weight`` (the com.microsoft opset imported), with the same
    weight values (the same codes, transposed to [N, K], and the same scales)."""

    def requires(self, model: ir.Model) -> None:
        if model.opset_imports.get("", 0) < 21:
            raise ir.passes.PreconditionError("float8 Q/DQ with blocks needs opset >= 21")

    def ensures(self, model: ir.Model) -> None:
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx") and self._fits(node):
                raise ir.passes.PostconditionError(f"{node.name!r} could be written in the fast form and was not")
        if has_block_fp8(model) and MS_DOMAIN not in model.opset_imports:
            raise ir.passes.PostconditionError(f"{BLOCK_FP8_OP} without the {MS_DOMAIN} opset")

    @staticmethod
    def _fits(node: ir.Node) -> bool:
        if node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0:
            return False
        if required_input(node, 0).dtype not in (*_A_TYPES, ir.DataType.FLOAT):
            return False
        return not isinstance(_weight(node), str)

    def call(self, model: ir.Model) -> BlockFp8Result:
        result = BlockFp8Result(model, False)
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):  # If branches too
            if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
                continue
            weight = _weight(node)
            if isinstance(weight, str) or not self._fits(node):
                if _dq(node.inputs[0]) or _dq(node.inputs[1]):
                    result.skipped[name_of(node)] = weight if isinstance(weight, str) else "transposed or non-float A"
                continue
            static = _static_e4m3(node.inputs[0])
            self._write(model.graph, node, weight, static)  # constants in the main graph, seen from every branch
            (result.w8a8 if static else result.w8a16).append(name_of(node))
        if result.w8a8 or result.w8a16:
            ir.passes.common.RemoveUnusedNodesPass()(model)
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            result.modified = True
            logger.info(
                "wrote %d MatMul/Gemm as %s (%d W8A8, %d W8A16)",
                len(result.w8a8) + len(result.w8a16),
                BLOCK_FP8_OP,
                len(result.w8a8),
                len(result.w8a16),
            )
        return result

    def _write(
        self,
        graph: ir.Graph,
        node: ir.Node,
        weight: tuple[ir.Value, np.ndarray, int, bool],
        static: tuple[ir.Value, np.ndarray] | None,
    ) -> None:
        codes, b_scale, block, kn = weight
        # new nodes and values are named after the output, unique across If branches (node names may not be)
        out = node.outputs[0]
        name = out.name
        n, k = b_scale.shape[0], (dim(codes, 0) if kn else dim(codes, 1))
        if kn:  # the op reads B as [N, K]: the same codes, transposed when the model is written
            source = constant(codes)
            tensor = ir.LazyTensor(functools.partial(transposed, source), dtype=_E4M3, shape=ir.Shape([n, k]))
            codes = initializer(graph, f"{codes.name}/nk", tensor)
        tape = ir.tape.Tape()
        a, a_scale = (
            (static[0], initializer(graph, f"{name}/a_scale", static[1])) if static else (required_input(node, 0), None)
        )
        wide = a.dtype == ir.DataType.FLOAT  # the op takes float16/bfloat16: cast in and out
        if wide:
            a = tape.op("Cast", [a], {"to": int(ir.DataType.FLOAT16)}, name=f"{name}/a_fp16")
            a.name, a.dtype = f"{name}/a_fp16", ir.DataType.FLOAT16
        t = dtype_of(a)
        bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
        beta = node.attributes.get_float("beta", 1.0) if node.op_type == "Gemm" else 1.0
        fused = bias is not None and bias.shape is not None and bias.shape.numpy() == (n,) and beta == 1.0
        op_bias = None
        if fused and bias is not None:
            op_bias = bias if bias.dtype == t else tape.op("Cast", [bias], {"to": int(t)}, name=f"{name}/bias_cast")
        inputs = [a, codes, initializer(graph, f"{codes.name}/b_scale", b_scale), a_scale, op_bias]
        while inputs[-1] is None:
            inputs.pop()
        y = tape.op(BLOCK_FP8_OP, inputs, {"block_size": block}, domain=MS_DOMAIN, name=node.name)
        y.dtype = t
        if wide:
            y = tape.op("Cast", [y], {"to": int(ir.DataType.FLOAT)}, name=f"{name}/y_fp32")
        if bias is not None and not fused:
            if beta != 1.0:
                scaled = initializer(graph, f"{name}/beta", np.array(beta, dtype_of(bias).numpy()))
                bias = tape.op("Mul", [bias, scaled], name=f"{name}/beta_c")
            y = tape.op("Add", [y, bias], name=f"{name}/bias")
        for v in tape.nodes:
            for o in v.outputs:
                o.name = o.name or v.name
        _swap(node, tape.nodes, y)


class EmulateBlockFp8MatMulPass(ir.passes.InPlacePass):
    """requires: nothing; ensures: no ``MatMulBlockQuantizedFp8Weight`` is left. Each becomes standard
    ONNX with the CUDA kernel's default-path numerics: the weight dequantized in float32 and rounded to
    A's type (stored so, as a float32 [K, N] initializer); A, with ``a_scale``, multiplied by the
    scale's reciprocal, cast to E4M3 (saturating), times the scale, rounded to A's type; a float32
    MatMul; the product rounded to A's type, then the bias added in float32 and rounded again. The
    decode path (M <= 8) rounds only once; its results differ from these in the last bits."""

    def ensures(self, model: ir.Model) -> None:
        if has_block_fp8(model):
            raise ir.passes.PostconditionError(f"a {BLOCK_FP8_OP} node is left")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.op_type != BLOCK_FP8_OP or node.domain != MS_DOMAIN:
                continue
            self._lower(model.graph, node)
            count += 1
        if count:
            ir.passes.common.RemoveUnusedNodesPass()(model)
            if not _uses_domain(model, MS_DOMAIN):
                model.opset_imports.pop(MS_DOMAIN, None)
        return ir.passes.PassResult(model, bool(count))

    def _lower(self, graph: ir.Graph, node: ir.Node) -> None:
        out = node.outputs[0]
        name = out.name  # unique across If branches (node names may not be)
        a, codes, b_scale = (required_input(node, i) for i in range(3))
        a_scale = node.inputs[3] if len(node.inputs) > 3 else None
        bias = node.inputs[4] if len(node.inputs) > 4 else None
        block = node.attributes.get_int("block_size", 128)
        if codes.const_value is None or b_scale.const_value is None:
            raise ir.passes.PreconditionError(f"{name!r}: the weight or its scales are computed; cannot emulate")
        t = dtype_of(a)
        source, scales = codes.const_value, b_scale.const_value
        n, k = shape_of(codes).numpy()

        def dequantized():
            full = np.repeat(scales.numpy().astype(np.float32), block, axis=1)[:, :k]
            w = source.numpy().astype(np.float32) * full  # float32, as the kernel
            return ir.tensor(np.ascontiguousarray(w.astype(t.numpy()).astype(np.float32).T))

        w = initializer(
            graph,
            f"{codes.name}/emulated_{t.name.lower()}",
            ir.LazyTensor(dequantized, dtype=ir.DataType.FLOAT, shape=ir.Shape([k, n])),
        )
        tape = ir.tape.Tape()

        def op(op_type, inputs, suffix, **attrs):
            v = tape.op(op_type, inputs, attrs or None, name=f"{name}/{suffix}")
            v.name = f"{name}/{suffix}"
            return v

        f32 = int(ir.DataType.FLOAT)
        x = op("Cast", [a], "a_fp32", to=f32)
        if a_scale is not None:
            s = op("Cast", [a_scale], "a_scale_fp32", to=f32)
            q = op("Cast", [op("Mul", [x, op("Reciprocal", [s], "a_inv")], "a_over_scale")], "a_e4m3", to=int(_E4M3))
            back = op("Mul", [op("Cast", [q], "a_e4m3_fp32", to=f32), s], "a_dequantized")
            x = op("Cast", [op("Cast", [back], "a_rounded", to=int(t))], "a_rounded_fp32", to=f32)
        y = op("Cast", [op("MatMul", [x, w], "matmul_fp32")], "y", to=int(t))
        if bias is not None:
            b32 = op("Cast", [bias], "bias_fp32", to=f32)
            y = op("Cast", [op("Add", [op("Cast", [y], "y_fp32", to=f32), b32], "y_bias")], "y_b", to=int(t))
        _swap(node, tape.nodes, y)


def _swap(node: ir.Node, nodes, y: ir.Value) -> None:
    """``nodes`` in place of ``node``, ``y`` taking over its output (name, type, shape and readers)."""
    out = node.outputs[0]
    if out.dtype is not None:  # else left as it is: a Tensor(None) type would not serialize
        y.dtype = out.dtype
    y.shape = out.shape
    graph = graph_of(node)
    graph.insert_before(node, nodes)
    out.replace_all_uses_with(y, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    old = out.name
    out.name = f"{old}/replaced"
    y.name = old


def _uses_domain(model: ir.Model, domain: str) -> bool:
    return any(n.domain == domain for n in ir.traversal.RecursiveGraphIterator(model.graph))
