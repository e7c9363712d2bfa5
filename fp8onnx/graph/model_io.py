"""Reading models and writing them safely.

Reading goes through onnx_ir, whose external tensors are memory-mapped on first use, so a large
model is never loaded whole. Writing checks the model (``onnx.checker``, then an onnxruntime
session) *before* anything reaches the output path, writes to a temporary file in the same folder
and renames it into place: a failure leaves the previous file at that path untouched and no partial
file behind. The input model is never overwritten.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
from collections.abc import Callable

import onnx
import onnx_ir as ir

from fp8onnx.base.errors import Fp8OnnxError, first_line
from fp8onnx.base.phases import phase
from fp8onnx.base.scratch import held_signals, make_dir, make_file, remove
from fp8onnx.graph.embedded import externalized
from fp8onnx.graph.guard import side_file
from fp8onnx.graph.runtime import inline_proto, machine_memory, make_session, weight_bytes
from fp8onnx.passes.common import proto_graphs

__all__ = [
    "EXTERNAL_META",
    "check_external_data",
    "load_model",
    "save_model",
    "write_bytes_atomic",
    "write_text_atomic",
]

logger = logging.getLogger(__name__)
# Models with more weights than this are written with a side file of weights (``<name>.data``),
# tensor by tensor, instead of one protobuf held whole in memory (protobuf's own limit is 2 GiB).
EXTERNAL_DATA_THRESHOLD = 512 << 20
# Set by load_model: whether the model read had its weights in external data (its output keeps that form).
EXTERNAL_META = "fp8onnx.external_data"
SOURCE_META = "fp8onnx.source"  # the model file it was loaded from (text data finds a tokenizer beside it)


def model_file(path: str | os.PathLike) -> pathlib.Path:
    """``path``, or for an export folder (Optimum, transformers, onnxruntime-genai) the
    ``model.onnx`` inside it."""
    path = pathlib.Path(path)
    if path.is_dir():
        inside = path / "model.onnx"
        if not inside.is_file():
            raise Fp8OnnxError(f"Model folder {str(path)!r} has no model.onnx.")
        return inside
    return path


def load_model(path: str | os.PathLike) -> ir.Model:
    """Parse ``path`` (weights in external data stay on disk, memory-mapped on first use), check every
    external-data reference before any data file is opened, then run onnx.checker on the file."""
    path = pathlib.Path(path)
    if not path.exists():
        raise Fp8OnnxError(f"Model file {str(path)!r} does not exist.")
    path = model_file(path)
    if not path.is_file():
        raise Fp8OnnxError(f"Model path {str(path)!r} is not a regular file.")
    parsed = externalized(path) or path  # a large single file: its weights moved to a side file first
    fmt = onnx.serialization.registry.get_format_from_file_extension(parsed.suffix) or "protobuf"
    try:
        blob = parsed.read_bytes()  # read once, for the parse here and onnx.checker below
        model = ir.serde.deserialize_model(onnx.load_model_from_string(blob, format=fmt))
        ir.external_data.set_base_dir(model.graph, parsed.parent)  # as ir.load: external data beside the file
    except Exception as exc:
        _explain_graph(path)
        raise Fp8OnnxError(
            f"Model file {str(path)!r} is not a readable ONNX model ({type(exc).__name__}: {first_line(exc)})."
        ) from exc
    _check_names(model, path)
    check_external_data(model, parsed)
    external = any(True for _ in _external_tensors(model))
    model.meta[EXTERNAL_META] = parsed == path and external
    check_memory(model, path)
    # The checker finds external data through the file's path; a model without any it parses from the bytes read.
    checked = blob if fmt == "protobuf" and not external else parsed
    del blob
    check_onnx(checked, f"Model file {str(path)!r}")
    model.meta[SOURCE_META] = str(path)
    return model


# Default-domain ops that ONNX does not define (onnxruntime's SimplifiedLayerNormalization and
# friends) or has deprecated at the model's opset are moved here for onnx.checker, which would stop
# at them; onnxruntime checks them (and the opset upgrade converts the deprecated ones).
_UNCHECKED_DOMAIN = "fp8onnx.unchecked"


def _hide_unknown_ops(proto: onnx.ModelProto) -> list[str]:
    """Move default-domain nodes without an ONNX schema at the model's opset to a private domain, in
    every graph and function of ``proto``; returns their op types."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    moved = []
    roots = [(proto.graph, opset)]
    for fn in proto.functions:
        roots.append((fn, next((o.version for o in fn.opset_import if o.domain in ("", "ai.onnx")), opset)))
    for root, version in roots:
        for graph in proto_graphs(root):
            for node in graph.node:
                if node.domain in ("", "ai.onnx") and version and not _defined(node.op_type, version):
                    node.domain = _UNCHECKED_DOMAIN
                    moved.append(node.op_type)
    if moved:
        proto.opset_import.append(onnx.helper.make_opsetid(_UNCHECKED_DOMAIN, 1))
        for fn in proto.functions:
            fn.opset_import.append(onnx.helper.make_opsetid(_UNCHECKED_DOMAIN, 1))
    return sorted(set(moved))


def _external_to_inputs(proto: onnx.ModelProto) -> None:
    """A checker copy whose external weights are graph inputs of the same type: checked without a
    folder to find their files in (check_external_data has checked those)."""
    graph = proto.graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    names = {v.name for v in graph.input}
    for tensor in external:
        graph.initializer.remove(tensor)
        if tensor.name not in names:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))


def _defined(op_type: str, version: int) -> bool:
    """Whether ONNX defines ``op_type`` at ``version`` and has not deprecated it there (onnx 1.23's
    checker refuses e.g. GroupNormalization-18, which onnxruntime runs and the upgrade converts)."""
    if not onnx.defs.has(op_type, version, ""):
        return False
    return not onnx.defs.get_schema(op_type, version, "").deprecated


def check_onnx(source: bytes | pathlib.Path, what: str) -> None:
    """onnx.checker on a model file or serialized bytes. A model is acceptable when onnxruntime can
    load it (SPEC §5): complaints about default-domain ops ONNX does not know are not fatal; the
    rest of the model is still checked."""
    try:
        onnx.checker.check_model(source if isinstance(source, bytes) else str(source))
        return
    except Exception as exc:
        error = exc
    try:
        proto = (
            onnx.load_from_string(source)
            if isinstance(source, bytes)
            else onnx.load(str(source), load_external_data=False)
        )
        moved = _hide_unknown_ops(proto)
        _external_to_inputs(proto)
    except Exception:
        moved = []
    if moved:
        try:
            onnx.checker.check_model(proto)
            logger.info("%s: onnx.checker does not know %s (onnxruntime ops); the rest passes", what, moved)
            return
        except Exception as exc:
            error = exc
    raise Fp8OnnxError(f"{what} fails onnx.checker: {first_line(error)}")


def _explain_graph(path: pathlib.Path) -> None:
    """After onnx_ir refused a model: name a tensor that two nodes write, the usual cause."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:
        return
    for graph in proto_graphs(proto.graph):
        writers = {v.name: "a graph input" for v in graph.input}
        writers.update({t.name: "an initializer" for t in graph.initializer})
        for node in graph.node:
            this = f"node {node.name!r} ({node.op_type})" if node.name else f"an unnamed {node.op_type} node"
            for out in node.output:
                if out and out in writers:
                    raise Fp8OnnxError(
                        f"Model file {str(path)!r} is not a valid graph: tensor {out!r} is written by "
                        f"{writers[out]} and by {this}."
                    )
                writers[out] = this


def _texts(model: ir.Model):
    """Every string the model carries: names, types, domains, doc strings, string attributes, metadata."""
    yield model.producer_name, model.producer_version, model.domain, model.doc_string
    yield from model.metadata_props.items()
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.graph.subgraphs(), *model.functions.values()]
    for graph in graphs:
        yield graph.name, graph.doc_string
        yield from graph.metadata_props.items()
        for value in (*graph.inputs, *graph.outputs):
            yield value.name, value.doc_string
        for node in graph:
            yield node.name, node.op_type, node.domain, node.doc_string
            yield from node.metadata_props.items()
            yield tuple(v.name for v in (*node.inputs, *node.outputs) if v is not None)
            for attr in node.attributes.values():
                if attr.type in (ir.AttributeType.STRING, ir.AttributeType.STRINGS):
                    yield attr.value if isinstance(attr.value, (list, tuple)) else (attr.value,)
    for graph in (model.graph, *model.graph.subgraphs()):
        yield tuple(graph.initializers)


def _check_names(model: ir.Model, path: pathlib.Path) -> None:
    """onnx.checker lets strings that are not valid UTF-8 through (a corrupt byte in a name); refuse them."""
    for group in _texts(model):
        for text in group:
            if text is not None and not isinstance(text, str):
                raise Fp8OnnxError(
                    f"Model file {str(path)!r} has a name or text that is not valid UTF-8 ({text!r}); is it corrupt?"
                )


def _external_tensors(model: ir.Model):
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                yield value.name, value.const_value


def check_external_data(model: ir.Model, path: pathlib.Path) -> None:
    """Refuse external data that points outside the model's folder (``..``, absolute paths, symlinks
    leading out), that is missing, or that is shorter than the tensor it claims to hold."""
    folder = path.resolve().parent
    for name, tensor in _external_tensors(model):
        location = str(tensor.location)
        where = f"Tensor {name!r} of {str(path)!r}"
        if os.path.isabs(location) or pathlib.PurePath(location).drive:
            raise Fp8OnnxError(f"{where} has an absolute external-data path {location!r}; refused.")
        target = folder / location
        if not _inside(os.path.normpath(target), folder) or not _inside(os.path.realpath(target), folder):
            raise Fp8OnnxError(f"{where} has external data {location!r} outside the model's folder; refused.")
        if not target.exists():
            raise Fp8OnnxError(f"{where} needs external data file {location!r}, which is missing.")
        if not target.is_file():
            raise Fp8OnnxError(f"{where} needs external data file {location!r}, which is not a regular file.")
        if tensor.length is not None and tensor.length < tensor.nbytes:
            raise Fp8OnnxError(f"{where} declares {tensor.length} bytes of external data but needs {tensor.nbytes}.")
        end = (tensor.offset or 0) + tensor.nbytes
        size = target.stat().st_size
        if end > size:
            raise Fp8OnnxError(f"{where} reads bytes up to {end} of {location!r}, which has only {size} (truncated?).")


def check_memory(model: ir.Model, path: pathlib.Path) -> None:
    """Refuse a model with a tensor larger than this machine's memory: no session can hold it, not
    even layer by layer (one node's weights are a segment's least). A model larger than memory as a
    whole is calibrated layer by layer; a session that would load it whole refuses it then
    (:func:`fp8onnx.graph.runtime.session_for_model`)."""
    declared = largest = 0
    name: str | None = ""  # the largest tensor's, for the message
    for graph in (model.graph, *model.graph.subgraphs()):
        for v in graph.initializers.values():
            if v.const_value is None:
                continue
            try:
                size = v.const_value.nbytes
            except (TypeError, ValueError) as exc:  # e.g. a corrupt data type
                raise Fp8OnnxError(f"Tensor {v.name!r} of {str(path)!r} is malformed ({exc}).") from exc
            declared += size
            if size > largest:
                largest, name = size, v.name
    total = machine_memory()
    if largest > total:
        raise Fp8OnnxError(
            f"Model file {str(path)!r} declares {declared / 2**30:.1f} GiB of weights; this machine has "
            f"{total / 2**30:.1f} GiB of memory, too little for onnxruntime to hold its tensor {name!r} "
            f"({largest / 2**30:.1f} GiB) even layer by layer."
        )


def _inside(candidate: str | os.PathLike, folder: pathlib.Path) -> bool:
    candidate = os.path.normcase(os.fspath(candidate))
    base = os.path.normcase(os.fspath(folder))
    return candidate == base or candidate.startswith(base.rstrip(os.sep) + os.sep)


def save_model(
    model: ir.Model,
    out: str | os.PathLike,
    *,
    provider: str | None = "cpu",
    what: str = "output model",
    external_data: bool = False,
) -> pathlib.Path:
    """Check ``model`` with onnx.checker and an onnxruntime session on ``provider`` (None: no session,
    for graphs whose ops only another EP has), then write it atomically to ``out``: as one file, or
    with its weights in ``<out>.data`` when ``external_data`` is set or they exceed 512 MiB.

    The session is created without graph optimizations: it checks that every node loads, and on the
    CPU EP constant folding would turn each weight's DequantizeLinear back into a float32 copy."""
    out = pathlib.Path(out)
    parent = out.resolve().parent
    if not external_data and weight_bytes(model) < EXTERNAL_DATA_THRESHOLD:
        with phase("serialize (lazy weights computed here)"):
            data = inline_proto(model).SerializeToString()  # serialized once: checker, session and file share it
        with phase("onnx.checker"):
            check_onnx(data, f"The {what}")
        # The load check (onnxruntime releases the GIL) runs while the bytes go to disk; the file is
        # renamed into place only once it passed. MiniLM: 0.09 s check and 0.04-0.19 s write+fsync.
        check = None if provider is None else lambda: make_session(data, provider, f"The {what}", optimize=False)
        with phase("onnxruntime load check and write, side by side"):
            write_bytes_atomic(out, data, check=check)
        logger.info("wrote %s (%d bytes)", out, len(data))
        return out
    return _save_external(model, out, parent, provider, what)


def _save_external(
    model: ir.Model, out: pathlib.Path, parent: pathlib.Path, provider: str | None, what: str
) -> pathlib.Path:
    data_name = side_file(out).name
    tmp = make_dir(f".{out.name}.", dir=parent)
    try:
        tmp_model = pathlib.Path(tmp) / out.name
        with phase("serialize and write (lazy weights computed here)"):
            ir.save(model, tmp_model, external_data=data_name)
        with phase("onnx.checker"):
            check_onnx(tmp_model, f"The {what}")
        if provider is not None:
            with phase("onnxruntime load check"):
                make_session(tmp_model, provider, f"The {what}", optimize=False)
        # Data first: the model file that appears last always finds its weights beside it; a stopping
        # signal waits until both are in place (never a new side file beside the previous model)
        with held_signals():
            os.replace(pathlib.Path(tmp) / data_name, parent / data_name)
            os.replace(tmp_model, out)
    finally:
        remove(tmp)
    logger.info("wrote %s with external data %s", out, data_name)
    return out


def umask() -> int:
    """The process's umask, read without changing it where the OS allows (Linux states it)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere it can only be read by setting it
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permissions an ordinary new file gets here: 0666 less the umask."""
    return 0o666 & ~umask()


def new_folder_mode() -> int:
    """The permissions an ordinary new folder gets here: 0777 less the umask."""
    return 0o777 & ~umask()


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, check: Callable[[], object] | None = None) -> None:
    """Write to a temporary file in the target folder, fsync, rename: all or nothing. ``check`` runs
    in another thread meanwhile; the file is renamed into place only when it returned, and its
    exception propagates with nothing replaced."""
    path = pathlib.Path(path)
    parent = path.resolve().parent
    if not parent.is_dir():
        raise Fp8OnnxError(f"Output folder {str(parent)!r} does not exist.")
    pool = concurrent.futures.ThreadPoolExecutor(1) if check is not None else None
    checked = pool.submit(check) if pool is not None and check is not None else None
    tmp = None
    try:
        try:
            fd, tmp = make_file(f".{path.name}.", suffix=".tmp", dir=parent)
        except OSError as exc:
            raise Fp8OnnxError(f"Cannot write {str(path)!r}: {exc.strerror}.") from exc
        try:
            os.fchmod(fd, new_file_mode())  # mkstemp's 0600 would hide the output from other accounts
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if checked is not None:
                checked.result()
            os.replace(tmp, path)
        except OSError as exc:
            raise Fp8OnnxError(
                f"Cannot write {str(path)!r}: {exc.strerror or exc}; the previous file, if any, is untouched."
            ) from exc
    finally:
        if pool is not None:
            pool.shutdown(wait=True)  # a failed write still waits for the check: no session outlives the call
        if tmp is not None:
            remove(tmp)  # gone already when it was renamed into place


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))
