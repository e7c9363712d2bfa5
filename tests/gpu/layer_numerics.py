"""One GEMM's numbers on the CUDA EP against what fp8onnx computes for it on the CPU.

The sample decoder's W8A8 fast form differs from its CPU emulation by a relative L2 of 0.033 on the
H200 (W8A16: 0.001). A model cannot tell a wrong emulation from float8 rounding flips that upstream
float16 differences set off and later layers carry on; one GEMM fed the same float16 input can. For
each form fp8onnx writes for ``--target onnxruntime-cuda`` (``tests/gpu/gemm_models.py``), at M = 4 (the
decode GEMV) and M = 256 (dequantize + cuBLAS): the CUDA EP's output against the CPU one, which is
fp8onnx's emulation for the fast form and the NumPy reference of ``fp8onnx.numerics.gemm_float8_ref``
(evaluated with onnx.reference) for GemmFloat8. Relative L2, max abs, the share of bit-equal outputs,
and the relative L2 of each to the FP16 GEMM's output (what the quantization itself costs).

Usage: python tests/gpu/layer_numerics.py OUT.json [--provider cuda|cpu]   (cpu: a dry run)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parents[1]))  # after an installed fp8onnx (a source tree lacks fp8onnx.passes)

FORMS = ("fast_w8a16", "fast_w8a8", "gemm_float8")
K, N = 1024, 1024


def _reference(path: str, x: np.ndarray) -> np.ndarray:
    """GemmFloat8's graph on onnx.reference with the NumPy reference as the op."""
    import onnx

    from fp8onnx.numerics.gemm_float8_ref import run_with_gemm_float8

    return run_with_gemm_float8(onnx.load(path), {"x": x})[0]


def _compare(got: np.ndarray, want: np.ndarray) -> dict:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return {
        "rel_l2": float(np.linalg.norm(g - w) / np.linalg.norm(w)),
        "max_abs": float(np.abs(g - w).max()),
        "bit_equal": float(np.mean(got == want)),
    }


def layer_numerics(provider: str) -> dict:
    """{form: {M: comparisons}} for one GEMM at K = N = 1,024 on ``provider`` (cpu: a dry run, where the
    fast form is compared with itself and GemmFloat8, which has no CPU kernel, is an error row)."""
    import gemm_models
    import onnxruntime as ort

    from fp8onnx.graph.runtime import make_session

    results: dict = {"onnxruntime": ort.__version__, "provider": provider, "k": K, "n": N, "forms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = gemm_models.build_width(pathlib.Path(tmp), K, N, ("fp16", *FORMS))
        for m in (4, 256):
            x = np.random.default_rng(2).standard_normal((m, K)).astype(np.float16)  # calibration's distribution
            fp16 = make_session(paths["fp16"], provider, "FP16").run(None, {"x": x})[0]
            for form in FORMS:
                try:
                    device = make_session(paths[form], provider, form).run(None, {"x": x})[0]
                    cpu = _reference(paths[form], x) if form == "gemm_float8" else None
                    if cpu is None:
                        cpu = make_session(paths[form], "cpu", form).run(None, {"x": x})[0]
                    row = {"vs_cpu": _compare(device, cpu), "device_vs_fp16": _compare(device, fp16)}
                    row["cpu_vs_fp16"] = _compare(cpu, fp16)
                except Exception as exc:  # the check reports every form, GemmFloat8 on a CPU too
                    row = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                results["forms"].setdefault(form, {})[str(m)] = row
                print(f"layers {form} M={m}: {json.dumps(row)}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    if args.provider == "cuda":
        import onnxruntime as ort

        ort.preload_dlls()
    args.out.write_text(json.dumps(layer_numerics(args.provider), indent=1) + "\n")


if __name__ == "__main__":
    main()
