"""Writes fp8onnx/graph/cpu_kernels.json, the CPU EP's kernel table the placement predictor falls back to
where the installed onnxruntime cannot list its own (onnxruntime-gpu without its CUDA libraries ends the
process inside ``get_all_opkernel_def()``; see fp8onnx/graph/kernels.py).

Run it with a CPU build of onnxruntime installed, the version the GPU wheels have (the file shipped was
written with onnxruntime 1.31.1, the newest onnxruntime-gpu on the package index):

    python -m venv /tmp/ort131 && /tmp/ort131/bin/pip install onnxruntime==1.31.1
    /tmp/ort131/bin/python tests/bench/cpu_kernel_table.py

It imports only onnxruntime (not fp8onnx), so any interpreter with that build will do.
"""

from __future__ import annotations

import json
import pathlib

import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

OUT = pathlib.Path(__file__).resolve().parents[2] / "fp8onnx" / "graph" / "cpu_kernels.json"


def main() -> None:
    if set(ort.get_available_providers()) - {"CPUExecutionProvider", "AzureExecutionProvider"}:
        raise SystemExit(f"install the CPU build of onnxruntime: this one lists {ort.get_available_providers()}")
    kernels = sorted(
        (
            {
                "domain": k.domain,
                "op": k.op_name,
                "since": k.version_range[0],
                "until": k.version_range[1],
                "constraints": {p: sorted(t) for p, t in sorted(k.type_constraints.items())},
            }
            for k in C.get_all_opkernel_def()
            if k.provider == "CPUExecutionProvider"
        ),
        key=lambda k: json.dumps(k, sort_keys=True),
    )
    source = f"onnxruntime {ort.__version__}'s CPU build, get_all_opkernel_def()"
    doc = {"source": source, "kernels": kernels}
    lines = ",\n".join(json.dumps(k, sort_keys=True) for k in kernels)
    OUT.write_text('{"source": ' + json.dumps(source) + ',\n"kernels": [\n' + lines + "\n]}\n")
    assert json.loads(OUT.read_text()) == doc
    print(f"wrote {OUT}: {len(kernels)} kernels")


if __name__ == "__main__":
    main()
