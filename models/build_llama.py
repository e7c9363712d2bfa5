"""Build a Llama-style decoder of about 1B parameters with random weights, as ONNX with external data.

For measuring time and memory on a model larger than 2 GB (protobuf's limit): the weights are
random (normal, std 0.02), so accuracy numbers on it say how close FP8 stays to FP32 on the same
graph, not how well a language model predicts text. Same blocks as the sample decoder (RMSNorm,
rotary position embeddings, causal multi-head attention, SwiGLU MLP), written as the ops a torch
export produces, at opset 18. Weights are written to the data file one tensor at a time, so
building it needs no more memory than its largest tensor; no torch needed.

Default shape (about TinyLlama's, 16 layers): d_model 2048, 16 heads, MLP 5632, vocabulary 32000:
954M parameters, 3.8 GB as FP32.

Writes to ``models/llama1b/`` (not committed):
  llama1b.onnx + llama1b.onnx.data   input ``input_ids`` int64 [batch, seq], output ``logits``
  calib.npz (``input_ids`` [32, 128])  eval.npz (``input_ids`` [16, 128]), uniform random tokens

Llama 3.1 8B's widths (8.0B parameters, 16 GB as float16): ``--layers 32 --dim 4096 --heads 32 --kv-heads 8
--ffn 14336 --vocab 128256 --dtype float16 --out models/llama8b``.

Usage: python models/build_llama.py [--layers N --dim D --ffn F --heads H --kv-heads KV --vocab V
       --dtype float32|float16|bfloat16 --out DIR]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

OUT = pathlib.Path(__file__).resolve().parent / "llama1b"
_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _cast(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` (float32) as ``dtype``'s bytes: float16 as NumPy's, bfloat16 as ml_dtypes'."""
    if dtype == "bfloat16":
        import ml_dtypes

        return array.astype(ml_dtypes.bfloat16)
    return array.astype(np.float16 if dtype == "float16" else np.float32)


OPSET = 18
_ALIGN = 4096  # page-aligned offsets: onnxruntime can memory-map each tensor


class _Writer:
    """Builds the graph and appends each weight to the external data file as soon as it is made."""

    def __init__(self, data_path: pathlib.Path, seed: int, dtype: str = "float32"):
        self.data_path = data_path
        self.dtype = dtype  # of the weights and of the graph's float values: float32, float16 or bfloat16
        self.fh = open(data_path, "wb")
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0
        self.params = 0

    def weight(self, name: str, shape: tuple[int, ...], std: float | None) -> str:
        """A weight of the model's dtype: normal(0, std), or ones when std is None; written out at once (a
        large one in slices of rows, so that building needs no more memory than a slice)."""
        offset = self.fh.tell()
        pad = -offset % _ALIGN
        self.fh.write(b"\0" * pad)
        offset += pad
        rows = max(1, (64 << 20) // (4 * int(np.prod(shape[1:], dtype=np.int64)) or 1))
        nbytes = 0
        for start in range(0, shape[0], rows):
            part = (min(rows, shape[0] - start), *shape[1:])
            if std is None:
                array = np.ones(part, np.float32)
            else:
                array = self.rng.standard_normal(part, dtype=np.float32)
                array *= np.float32(std)
            data = _cast(array, self.dtype).tobytes()
            self.fh.write(data)
            nbytes += len(data)
        tensor = TensorProto(name=name, data_type=_TYPES[self.dtype], dims=shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data_path.name), ("offset", offset), ("length", nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        self.inits.append(tensor)
        self.params += int(np.prod(shape, dtype=np.int64))
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        """A small constant; a float32 one in the model's dtype."""
        if array.dtype == np.float32 and self.dtype != "float32":
            tensor = helper.make_tensor(
                name, _TYPES[self.dtype], array.shape, _cast(array, self.dtype).tobytes(), raw=True
            )
            self.inits.append(tensor)
            return name
        self.inits.append(onnx.numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: list[str], name: str | None = None, **attrs) -> str:
        self.count += 1
        out = name or f"{op_type.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"/{out}", **attrs))
        return out

    def finish(self) -> None:
        self.fh.close()


def rms_norm(w: _Writer, x: str, prefix: str, dim: int) -> str:
    sq = w.op("Mul", [x, x], f"{prefix}/sq")
    mean = w.op("ReduceMean", [sq, "axes_last"], f"{prefix}/mean", keepdims=1)
    rstd = w.op("Reciprocal", [w.op("Sqrt", [w.op("Add", [mean, "eps"], f"{prefix}/var_eps")], f"{prefix}/std")])
    return w.op("Mul", [w.op("Mul", [x, rstd], f"{prefix}/normed"), w.weight(f"{prefix}.weight", (dim,), None)])


def rotary(w: _Writer, x: str, prefix: str) -> str:
    x1, x2 = f"{prefix}/x1", f"{prefix}/x2"
    w.nodes.append(helper.make_node("Split", [x, "halves"], [x1, x2], name=f"/{prefix}/split", axis=-1))
    rot = w.op("Concat", [w.op("Neg", [x2], f"{prefix}/neg"), x1], f"{prefix}/rotated", axis=-1)
    return w.op("Add", [w.op("Mul", [x, "cos"], f"{prefix}/xcos"), w.op("Mul", [rot, "sin"], f"{prefix}/xsin")])


def build(
    out: pathlib.Path,
    *,
    layers: int,
    dim: int,
    heads: int,
    ffn: int,
    vocab: int,
    seed: int = 0,
    opset: int = OPSET,
    kv_heads: int | None = None,
    dtype: str = "float32",
) -> pathlib.Path:
    """Write ``out/<name>.onnx`` and its ``.data`` file; returns the model path. ``kv_heads`` (default
    ``heads``): grouped-query attention, each key/value head shared by ``heads / kv_heads`` query heads (Llama
    3's 8 of 32). ``dtype``: the weights' and the graph's float type (the rotary angles are computed in
    float32 and cast)."""
    out.mkdir(parents=True, exist_ok=True)
    model_path = out / f"{out.name}.onnx"
    w = _Writer(out / f"{model_path.name}.data", seed, dtype)
    kv = kv_heads or heads
    if heads % kv:
        raise SystemExit(f"--heads {heads} is not a multiple of --kv-heads {kv}")
    hd = dim // heads
    f = _TYPES[dtype]
    std, std_out = 0.02, 0.02 / math.sqrt(2 * layers)
    w.const("axes_last", np.array([-1], np.int64))
    w.const("eps", np.array(1e-5, np.float32))
    w.const("halves", np.array([hd // 2, hd // 2], np.int64))
    w.const("heads_shape", np.array([0, 0, heads, hd], np.int64))
    w.const("kv_shape", np.array([0, 0, kv, hd], np.int64))
    w.const("kv_repeats", np.array([1, 1, heads // kv, 1, 1], np.int64))
    w.const("axes_2", np.array([2], np.int64))
    w.const("grouped_shape", np.array([0, heads, -1, hd], np.int64))
    w.const("merge_shape", np.array([0, 0, dim], np.int64))
    w.inits.append(  # float32 whatever the dtype: the angles are cast once computed
        onnx.numpy_helper.from_array(
            (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)[None, :], "inv_freq"
        )
    )
    w.const("inv_sqrt_hd", np.array(1 / math.sqrt(hd), np.float32))
    w.const("zero_i", np.array(0, np.int64))
    w.const("one_i", np.array(1, np.int64))
    w.const("neg_big", np.array(-1e9 if dtype == "float32" else -1e4, np.float32))  # float16's max is 65504

    # Positions, rotary tables and the causal mask, from the sequence length.
    seq = w.op("Gather", [w.op("Shape", ["input_ids"], "ids_shape"), "one_i"], "seq_len", axis=0)
    pos = w.op("Cast", [w.op("Range", ["zero_i", seq, "one_i"], "positions")], "positions_f", to=TensorProto.FLOAT)
    freqs = w.op("Mul", [w.op("Unsqueeze", [pos, "axes_last"], "pos_col"), "inv_freq"], "freqs")
    angles = w.op("Concat", [freqs, freqs], "angles", axis=-1)
    if dtype == "float32":
        w.op("Cos", [angles], "cos")
        w.op("Sin", [angles], "sin")
    else:
        w.op("Cast", [w.op("Cos", [angles], "cos32")], "cos", to=f)
        w.op("Cast", [w.op("Sin", [angles], "sin32")], "sin", to=f)
    sq_shape = w.op("Concat", [w.op("Unsqueeze", [seq, "axes_0"], "seq_1d")] * 2, "mask_shape", axis=0)
    w.const("axes_0", np.array([0], np.int64))
    ones = w.op("ConstantOfShape", [sq_shape], "mask_ones", value=helper.make_tensor("v", f, [1], [1.0]))
    upper = w.op("Trilu", [ones, "one_i"], "mask_upper", upper=1)
    mask = w.op("Mul", [upper, "neg_big"], "mask")

    x = w.op("Gather", [w.weight("embed_tokens.weight", (vocab, dim), std), "input_ids"], "embedded", axis=0)
    for i in range(layers):
        p = f"layers.{i}"
        h = rms_norm(w, x, f"{p}.input_layernorm", dim)

        def heads_of(t: str, name: str, shape: str = "heads_shape", p=p) -> str:
            r = w.op("Reshape", [t, shape], f"{p}/{name}_heads")
            return w.op("Transpose", [r], f"{p}/{name}_bhsd", perm=[0, 2, 1, 3])

        def shared(t: str, name: str, p=p) -> str:
            """[b, kv, s, hd] -> [b, heads, s, hd]: each key/value head repeated for its query heads."""
            if kv == heads:
                return t
            tiled = w.op(
                "Tile", [w.op("Unsqueeze", [t, "axes_2"], f"{p}/{name}_5d"), "kv_repeats"], f"{p}/{name}_tiled"
            )
            return w.op("Reshape", [tiled, "grouped_shape"], f"{p}/{name}_grouped")

        kv_dim = kv * hd
        q = heads_of(w.op("MatMul", [h, w.weight(f"{p}.self_attn.q_proj.weight", (dim, dim), std)], f"{p}/q"), "q")
        k = heads_of(
            w.op("MatMul", [h, w.weight(f"{p}.self_attn.k_proj.weight", (dim, kv_dim), std)], f"{p}/k"), "k", "kv_shape"
        )
        v = heads_of(
            w.op("MatMul", [h, w.weight(f"{p}.self_attn.v_proj.weight", (dim, kv_dim), std)], f"{p}/v"), "v", "kv_shape"
        )
        q, k = rotary(w, q, f"{p}/q_rot"), shared(rotary(w, k, f"{p}/k_rot"), "k")
        v = shared(v, "v")
        kt = w.op("Transpose", [k], f"{p}/k_t", perm=[0, 1, 3, 2])
        scores = w.op("Mul", [w.op("MatMul", [q, kt], f"{p}/qk"), "inv_sqrt_hd"], f"{p}/scaled")
        probs = w.op("Softmax", [w.op("Add", [scores, mask], f"{p}/masked")], f"{p}/probs", axis=-1)
        ctx = w.op("Transpose", [w.op("MatMul", [probs, v], f"{p}/ctx")], f"{p}/ctx_bshd", perm=[0, 2, 1, 3])
        ctx = w.op("Reshape", [ctx, "merge_shape"], f"{p}/ctx_merged")
        o = w.op("MatMul", [ctx, w.weight(f"{p}.self_attn.o_proj.weight", (dim, dim), std_out)], f"{p}/o")
        x = w.op("Add", [x, o], f"{p}/resid_attn")
        h = rms_norm(w, x, f"{p}.post_attention_layernorm", dim)
        gate = w.op("MatMul", [h, w.weight(f"{p}.mlp.gate_proj.weight", (dim, ffn), std)], f"{p}/gate")
        up = w.op("MatMul", [h, w.weight(f"{p}.mlp.up_proj.weight", (dim, ffn), std)], f"{p}/up")
        act = w.op("Mul", [w.op("Mul", [gate, w.op("Sigmoid", [gate], f"{p}/sig")], f"{p}/silu"), up], f"{p}/act")
        down = w.op("MatMul", [act, w.weight(f"{p}.mlp.down_proj.weight", (ffn, dim), std_out)], f"{p}/down")
        x = w.op("Add", [x, down], f"{p}/resid_mlp")
    x = rms_norm(w, x, "norm", dim)
    w.op("MatMul", [x, w.weight("lm_head.weight", (dim, vocab), std)], "logits")
    w.finish()

    graph = helper.make_graph(
        w.nodes,
        "llama",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", f, ["batch", "seq", vocab])],
        initializer=w.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="fp8onnx-models")
    model.ir_version = 10
    model.metadata_props.add(key="fp8onnx_sample", value=f"random weights, {w.params} parameters")
    onnx.save(model, model_path)
    onnx.checker.check_model(str(model_path))
    return model_path


def write_data(out: pathlib.Path, vocab: int, seq: int, calib: int, evals: int, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    np.savez(out / "calib.npz", input_ids=rng.integers(0, vocab, (calib, seq), dtype=np.int64))
    np.savez(out / "eval.npz", input_ids=rng.integers(0, vocab, (evals, seq), dtype=np.int64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: --heads)")
    ap.add_argument("--dtype", choices=sorted(_TYPES), default="float32", help="weights and graph (float32)")
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--opset", type=int, default=OPSET, help="18 (as torch exports) or later")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = build(
        args.out,
        layers=args.layers,
        dim=args.dim,
        heads=args.heads,
        ffn=args.ffn,
        vocab=args.vocab,
        opset=args.opset,
        kv_heads=args.kv_heads,
        dtype=args.dtype,
    )
    write_data(args.out, args.vocab, args.seq, args.calib, args.eval)
    size = path.stat().st_size + path.with_name(path.name + ".data").stat().st_size
    print(f"wrote {path} ({size / 1e9:.2f} GB) and its data in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
