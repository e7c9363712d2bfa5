"""Small graphs built in code, and the numeric checks every pass test uses."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

REPO = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = REPO / "models" / "decoder"


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref = np.asarray(reference, np.float64)
    noise = np.sum((ref - np.asarray(test, np.float64)) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref**2) / noise))


def run_ort(model: onnx.ModelProto | str | pathlib.Path, feed: dict, level: str = "default") -> list[np.ndarray]:
    """Run on the CPU EP at ORT's default optimisation level (as users do), or 'basic'."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if level == "basic":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feed)


def run_reference(model: onnx.ModelProto | str | pathlib.Path, feed: dict) -> list[np.ndarray]:
    m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    return ReferenceEvaluator(m).run(None, feed)


def mlp_model(
    path: pathlib.Path,
    *,
    opset: int = 17,
    hidden: int = 32,
    relu: bool = True,
    gemm: bool = True,
    dtype=np.float32,
    seed: int = 0,
    dynamic_batch: bool = True,
) -> pathlib.Path:
    """x[b,16] -> MatMul(W1) -> Relu -> Gemm(W2^T, bias, transB=1) -> y[b,8], plus an act x act MatMul."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((16, hidden)) * 0.3).astype(dtype)
    w2 = (rng.standard_normal((8, hidden)) * 0.3).astype(dtype)
    b2 = rng.standard_normal(8).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1")]
    act = "h"
    if relu:
        nodes.append(helper.make_node("Relu", ["h"], ["r"], name="relu"))
        act = "r"
    if gemm:
        nodes.append(helper.make_node("Gemm", [act, "w2", "b2"], ["y"], name="fc2", transB=1))
    else:
        nodes.append(helper.make_node("Transpose", ["w2"], ["w2t"], name="t", perm=[1, 0]))
        nodes.append(helper.make_node("MatMul", [act, "w2t"], ["y0"], name="fc2"))
        nodes.append(helper.make_node("Add", ["y0", "b2"], ["y"], name="bias"))
    # activation x activation: y^T y, opt-in only
    nodes.append(helper.make_node("Transpose", ["y"], ["yt"], name="yt", perm=[1, 0]))
    nodes.append(helper.make_node("MatMul", ["yt", "y"], ["gram"], name="gram"))
    batch = "batch" if dynamic_batch else 4
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", elem, [batch, 16])],
        [helper.make_tensor_value_info("y", elem, [batch, 8]), helper.make_tensor_value_info("gram", elem, [8, 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def mlp_data(path: pathlib.Path, n: int = 64, seed: int = 1, dtype=np.float32, **extra) -> pathlib.Path:
    x = np.random.default_rng(seed).standard_normal((n, 16)).astype(dtype)
    np.savez(path, x=x, **extra)
    return path


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def sqnr_floor_db(fmt, quantized_tensors: int, slack_db: float = 1.0) -> float:
    """The SQNR a chain of ``quantized_tensors`` per-tensor quantizations in ``fmt`` should beat.

    Rounding to a grid with relative step ``eps`` adds noise of relative power eps**2/12 per tensor
    (uniform error); independent errors add up, so n tensors cost 10*log10(n) dB more.
    """
    import ml_dtypes

    eps = float(ml_dtypes.finfo(fmt.np_dtype).eps)
    return 20 * np.log10(2 * np.sqrt(3) / eps) - 10 * np.log10(quantized_tensors) - slack_db


# Float results that onnxruntime's or the BLAS's kernels compute differ in their last bits across
# CPUs (AVX2 vs AVX-512, Intel vs AMD) and thread counts: the summation order of a dot product is
# the kernel's choice (SPEC §11). Tests compare such results of two different graphs or shapes within
# the bound below, and compare exactly only what fp8onnx computes itself (float8 bytes, scales from
# NumPy, graph structure).
UNIT_ROUNDOFF = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float16): 2.0**-11, np.dtype(np.float64): 2.0**-53}


def summation_tolerance(terms: int, magnitude, dtype=np.float32):
    """How far apart two computations of one sum of ``terms`` products may land, each in any order,
    with or without fused multiply-add: each is within gamma_n * sum|x_i y_i| of the exact sum
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5), gamma_n =
    n u / (1 - n u), u the unit roundoff; so they differ by at most twice that. ``magnitude`` is
    sum|x_i y_i| (an array, e.g. |x| @ |w|, or an upper bound)."""
    u = UNIT_ROUNDOFF[np.dtype(dtype)]
    gamma = terms * u / (1 - terms * u)
    return 2 * gamma * np.asarray(magnitude, np.float64)


def assert_same_sums(a, b, terms: int, magnitude, dtype=np.float32) -> None:
    """``a`` and ``b``: one float computation (a MatMul, Gemm, Conv) done by two kernels; equal up to
    the summation order (see ``summation_tolerance``)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    excess = np.abs(a - b) - summation_tolerance(terms, magnitude, dtype)
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} of {a.size} values differ by more than the summation bound"


def value_of(model: onnx.ModelProto | str | pathlib.Path, name: str, feed: dict) -> np.ndarray:
    """A graph value (an intermediate one too) as onnx.reference computes it: NumPy's element-wise
    arithmetic, the same bits on every CPU for DequantizeLinear, Reshape, Transpose."""
    m = onnx.ModelProto()
    m.CopyFrom(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)))
    given = {t.name: t for t in m.graph.initializer}
    if name in given:
        return numpy_helper.to_array(given[name])
    if name in feed:
        return feed[name]
    last = max(i for i, n in enumerate(m.graph.node) if name in n.output)
    del m.graph.node[last + 1 :]  # only what computes it (onnx.reference runs every node it is given)
    return ReferenceEvaluator(m).run([name], feed)[0]


def sum_magnitude(
    model: onnx.ModelProto | str | pathlib.Path,
    feed: dict,
    op_types=("MatMul", "Gemm", "Conv", "ConvTranspose"),
    output: str | None = None,
):
    """(terms, sum|x_i w_i| at every output) of the model's one MatMul/Gemm/Conv/ConvTranspose node
    for ``feed`` (or of the node that writes ``output``): what ``assert_same_sums`` needs. Its inputs are
    read with onnx.reference; the sums of absolute values are the node itself (same attributes, no
    bias) run by onnxruntime on |A| and |B| (all terms positive: within a relative n*u of exact,
    nothing the bound notices)."""
    m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    (node,) = [n for n in m.graph.node if (output in n.output if output else n.op_type in op_types)]
    a, b = (np.abs(value_of(m, name, feed)).astype(np.float32) for name in node.input[:2])
    attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if node.op_type == "MatMul":
        terms = a.shape[-1]
    elif node.op_type == "Gemm":
        terms = a.shape[0] if attrs.get("transA") else a.shape[1]
    elif node.op_type == "Conv":
        terms = int(np.prod(b.shape[1:]))
    else:  # ConvTranspose: each output sums at most C/group x kh x kw products
        terms = b.shape[0] // attrs.get("group", 1) * int(np.prod(b.shape[2:]))
    one = helper.make_node(node.op_type, ["a", "b"], ["y"], **attrs)
    f = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        [one],
        "abs",
        [helper.make_tensor_value_info("a", f, None), helper.make_tensor_value_info("b", f, None)],
        [helper.make_tensor_value_info("y", f, None)],
    )
    opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    magnitude = run_ort(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), {"a": a, "b": b})[0]
    if len(node.input) > 2 and node.input[2]:
        bias = np.abs(value_of(m, node.input[2], feed)).astype(np.float64)
        if node.op_type.startswith("Conv"):  # one bias per output channel (axis 1)
            bias = bias.reshape(-1, *[1] * (magnitude.ndim - 2))
        magnitude = magnitude + bias
        terms += 1
    return terms, magnitude


def assert_same_histogram(a: np.ndarray, b: np.ndarray, moved: float = 1e-3) -> None:
    """Histogram counts of one tensor computed by two kernels (SPEC §11): a value on a bin's edge may
    land in the neighbouring bin; at most a fraction ``moved`` of the values moves, by one bin."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    assert a.shape == b.shape and a.sum() == b.sum()
    drift = np.abs(np.cumsum(a - b))  # a value moved one bin shows as 1 at that edge only
    assert drift.sum() <= max(1, moved * a.sum()), f"{int(drift.sum())} of {int(a.sum())} values moved"


def assert_same_model(a, b, rel: float = 1e-5, codes: float = 1e-3) -> None:
    """Two quantized models whose statistics were measured by different graphs, batchings or executors
    (SPEC §11): the same nodes, attributes and initializer names, types and shapes; float initializers
    (scales, biases) within ``rel``; float8 codes identical but for a fraction ``codes`` of them, each
    one grid step away (a rounding tie that a last-bit difference in an amax or X^T X flipped)."""
    ma, mb = (x if isinstance(x, onnx.ModelProto) else onnx.load(str(x)) for x in (a, b))
    ga, gb = ma.graph, mb.graph
    assert [(n.op_type, list(n.input), list(n.output)) for n in ga.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in gb.node
    ]
    ta, tb = ({t.name: t for t in g.initializer} for g in (ga, gb))
    kinds = [{k: (t.data_type, list(t.dims)) for k, t in tensors.items()} for tensors in (ta, tb)]
    assert kinds[0] == kinds[1]
    for name, t in ta.items():
        x, y = numpy_helper.to_array(t), numpy_helper.to_array(tb[name])
        if x.dtype.kind == "f" and x.dtype.itemsize >= 2:
            np.testing.assert_allclose(x, y, rtol=rel, atol=0, err_msg=name)
        elif x.dtype.itemsize == 1 and x.dtype.kind not in "iub":  # float8: codes ordered by value
            differ = x.view(np.uint8) != y.view(np.uint8)
            assert differ.mean() <= codes, f"{name}: {differ.mean():.2%} of the float8 codes differ"
            values = np.arange(256, dtype=np.uint8).view(x.dtype).astype(np.float32)
            grid = np.unique(values[np.isfinite(values)])  # -0 and +0 one point
            ra, rb = (np.searchsorted(grid, v[differ].astype(np.float32)) for v in (x, y))
            assert (np.abs(ra - rb) <= 1).all(), f"{name}: codes more than one step apart"
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)
