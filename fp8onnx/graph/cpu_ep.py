"""What onnxruntime's CPU EP needs from a model before a session: fp8onnx's own sessions apply it.

- ``com.microsoft.MatMulBlockQuantizedFp8Weight`` (CUDA only; what ``--gemm-op block-fp8`` writes) has
  no CPU kernel: it is lowered to standard ops with the CUDA kernel's numerics
  (:class:`fp8onnx.passes.EmulateBlockFp8MatMulPass`), in memory;
- bfloat16 compute in a graph fp8onnx converted for the CUDA EP (``--precision bf16``, marked in its
  metadata; the CPU EP has bfloat16 kernels for few ops) runs in float32 with every result rounded to
  bfloat16 (:class:`fp8onnx.passes.EmulateBfloat16Pass`), in memory;
- onnxruntime 1.32's NchwcTransformer crashes the process (SIGSEGV) on float16 Conv graphs (the corpus
  ViT's patch embedding at --precision fp16): such a session leaves it out (it only changes the layout
  of float32 Convs).

Each is told from the serialized model by a byte search first; a model is parsed only when it names
what is searched for.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os

import numpy as np
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.base.scratch import temporary_dir
from fp8onnx.graph import known
from fp8onnx.passes import EmulateBfloat16Pass, EmulateBlockFp8MatMulPass

__all__ = ["BFLOAT16_COMPUTE", "BFLOAT16_MARK", "PROTO_BYTES", "cuda_only_ops", "emulated", "float16_conv"]

logger = logging.getLogger(__name__)
# An emulated model with more weights than this goes to onnxruntime as a file (protobuf's limit is 2 GiB).
PROTO_BYTES = 1 << 30
_CUDA_ONLY = (b"MatMulBlockQuantizedFp8Weight",)  # ops fp8onnx writes that only the CUDA EP runs
# the metadata key of a graph fp8onnx converted to bfloat16 for the CUDA EP (--precision bf16)
BFLOAT16_MARK = "fp8onnx_bfloat16"
BFLOAT16_COMPUTE = "bfloat16 compute"
# NodeProto.op_type (field 4, a string) "Conv" / "ConvTranspose" as serialized: a node name or a
# tensor name that contains "Conv" (GPT-2's Conv1D modules) does not match
_CONV_OP_TYPES = (b'"\x04Conv', b'"\rConvTranspose')


def _mentions(model: bytes | str | os.PathLike, words: tuple[bytes, ...]) -> list[bytes]:
    """Which of ``words`` a serialized model (or a model file: its graph only, weights in a side file
    are not read) contains; a byte search, no parse."""
    if isinstance(model, bytes):
        return [w for w in words if w in model]
    try:
        with open(model, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return [w for w in words if data.find(w) >= 0]
    except (OSError, ValueError):  # not a readable file, or empty: onnxruntime says what is wrong
        return []


def cuda_only_ops(model: bytes | str | os.PathLike) -> list[str]:
    """What a serialized model (or a model file) has that only the CUDA EP runs and fp8onnx emulates: op
    types, and :data:`BFLOAT16_COMPUTE` for a graph fp8onnx converted to bfloat16 for the CUDA EP (its
    metadata says so: :data:`BFLOAT16_MARK`). Another bfloat16 model is not emulated: the CPU EP cannot
    run it, and says so."""
    found = _mentions(model, (*_CUDA_ONLY, BFLOAT16_MARK.encode()))
    return [BFLOAT16_COMPUTE if w == BFLOAT16_MARK.encode() else w.decode() for w in found]


def float16_conv(model: bytes | str | os.PathLike) -> bool:
    """Whether the model has a Conv and float16 tensors (its graph parsed only when it has a Conv node)."""
    if not _mentions(model, _CONV_OP_TYPES):
        return False
    import onnx

    try:
        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
    except Exception:  # onnxruntime says what is wrong with it
        return False
    g, half = proto.graph, onnx.TensorProto.FLOAT16
    return any(n.op_type.startswith("Conv") for n in g.node) and (
        any(t.data_type == half for t in g.initializer)
        or any(v.type.tensor_type.elem_type == half for v in (*g.input, *g.output, *g.value_info))
        or any(a.name == "to" and a.i == half for n in g.node for a in n.attribute)
    )


@contextlib.contextmanager
def emulated(model: bytes | str | os.PathLike, weights: dict[str, np.ndarray] | None, in_memory: str, what: str):
    """``model`` (serialized, with ``weights`` handed over as arrays where its initializers point at the
    external location ``in_memory``; or a file) with its CUDA-only ops lowered to standard ones: one
    self-contained serialized model, or where its weights pass :data:`PROTO_BYTES` (a 1B LLM's float8
    weights: protobuf refuses "Failed to serialize proto"), a model file with a side file of weights in
    a temporary folder, removed when the block ends (a session has read or mapped it by then). A model
    that cannot be lowered is one sentence naming ``what``."""
    with temporary_dir("fp8onnx-emulated-") as folder:
        try:
            loaded = _lowered(model, weights, in_memory)
            held = sum(v.const_value.nbytes for v in loaded.graph.initializers.values() if v.const_value is not None)
            if held < PROTO_BYTES:
                source: bytes | str = ir.to_proto(loaded).SerializeToString()
            else:
                source = os.path.join(folder, "model.onnx")
                ir.save(loaded, source, external_data="model.onnx.data")
            del loaded
        except Exception as exc:
            raise Fp8OnnxError(f"{what} does not load in onnxruntime (cpu, emulated): {first_line(exc)}") from exc
        logger.info("%s: CUDA-only ops emulated on the CPU EP (standard ops, the CUDA kernel's numerics)", what)
        yield source


def _lowered(model: bytes | str | os.PathLike, weights: dict[str, np.ndarray] | None, in_memory: str) -> ir.Model:
    import onnx

    if isinstance(model, bytes):
        loaded = ir.serde.deserialize_model(onnx.load_from_string(model))
        for value in loaded.graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.location == in_memory and weights:
                value.const_value = ir.tensor(weights[known.name(value)], dtype=tensor.dtype, name=value.name)
    else:
        loaded = ir.load(os.fspath(model))
    EmulateBlockFp8MatMulPass()(loaded)  # first: it writes the op's bfloat16 roundings as Casts
    EmulateBfloat16Pass()(loaded)
    ir.external_data.load_to_model(loaded)
    return loaded
