"""Writes fp8onnx/graph/cuda_kernels.json, the CUDA EP's kernel table the placement predictor reads, from a
parse of onnxruntime's registration tables.

Input (a folder, argument 1): ``cuda_kernels.json`` (one entry per ``BuildKernelCreateInfo<...>`` line
of ``core/providers/cuda/cuda_execution_provider.cc`` and ``contrib_ops/cuda/cuda_contrib_kernels.cc``:
domain, op, since, until, template type, preprocessor guard, whether a default pip build has it) and
``type_constraints.json`` (the ``TypeConstraint`` lists of the kernels fp8onnx's outputs use, read from
their .cc files with the preprocessor). Only the CUDA build carries the registry itself, so the
table is read from source; the ``source`` line of the output says which commits.

Usage: python tests/bench/cuda_kernel_table.py PARSED_DIR "SOURCE DESCRIPTION"
"""

from __future__ import annotations

import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parents[2] / "fp8onnx" / "graph" / "cuda_kernels.json"
TYPES = {
    "float": "float", "double": "double", "MLFloat16": "float16", "BFloat16": "bfloat16", "bool": "bool",
    "int8_t": "int8", "uint8_t": "uint8", "int16_t": "int16", "uint16_t": "uint16", "int32_t": "int32",
    "uint32_t": "uint32", "int64_t": "int64", "uint64_t": "uint64", "Float8E4M3FN": "float8e4m3fn",
    "Float8E5M2": "float8e5m2", "Int4x2": "int4", "UInt4x2": "uint4",
}  # fmt: skip


def _norm(template: str | None) -> str | None:
    return None if template is None else template.replace(", ", "_").replace(",", "_")


def main(folder: str, source: str) -> None:
    root = pathlib.Path(folder)
    entries = json.loads((root / "cuda_kernels.json").read_text())
    constraints = json.loads((root / "type_constraints.json").read_text())
    kernels = []
    for e in entries:
        if not e["enabled_in_default_build"] or e["domain"].startswith("com.ms.internal"):
            continue  # not in a pip build; NHWC kernels replace nodes the layout transformer rewrote
        known = constraints.get(f"{e['op']}@{e['domain']}@{e['since']}")
        k = {"domain": e["domain"], "op": e["op"], "since": e["since"], "until": e["until"]}
        if known is not None:
            if e["type"] is None:
                k["constraints"] = {p: t for p, t in known.items() if not p.startswith("_")}
            else:
                typed = [i for i in known.get("_typed_instances", []) if _norm(i["template"]) == _norm(e["type"])]
                k["constraints"] = typed[0]["constraints"] if typed else None
        elif e["type"] in TYPES:  # a typed kernel: the type of its first input
            k["type"] = f"tensor({TYPES[e['type']]})"
        kernels.append(k)
    doc = {"source": source, "kernels": kernels}
    lines = ",\n".join(json.dumps(k, sort_keys=True) for k in kernels)
    OUT.write_text('{"source": ' + json.dumps(source) + ',\n"kernels": [\n' + lines + "\n]}\n")
    assert json.loads(OUT.read_text()) == doc
    print(f"wrote {OUT}: {len(kernels)} kernels")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
