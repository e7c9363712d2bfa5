"""One setting of the GPU check's GEMM timing, in a process of its own (run_gpu_checks.py starts two: one
with ``ORT_FP8_MATMUL_DEEPGEMM=1`` in its environment, which the fast-form kernel reads when the session
is made, and one without).

    python tests/gpu/gemm_timing.py PLAN.json OUT.json

PLAN names the models ({width: {form: path}}), the Ms, the provider, warm-up and repeat counts and a
deadline (epoch seconds). For every width, form and M: inputs and outputs bound on the device (IO
binding), warm-up runs, then the median of CUDA-synchronised wall times of ``run_with_iobinding``, the
GPU's L2 cache flushed before each (untimed), as the other layers' weights flush it in a model.

Which kernel path ran (on CUDA), two ways:
- the kernels themselves, from a CUPTI trace (torch.profiler, which records every kernel of the
  process, onnxruntime's too): ``MatMulBlockScaledFp8GemvKernel`` (GEMV), ``...MmaGemvKernel``
  (tensor-core GEMV), ``deep_gemm::sm90_fp8_gemm_1d1d_impl`` (DeepGEMM), ``DequantizeBlockScaledFp8``
  + a cuBLAS GEMM (the default path); their summed device time per run is ``kernel_us``;
- onnxruntime's own log: in 1.31.1 the fast-form kernel logs one line, at VERBOSE, when it picks
  DeepGEMM ("MatMulBlockQuantizedFp8Weight: using SM90 DeepGEMM", the string in its CUDA provider
  library; the GEMV and dequantize + cuBLAS paths log nothing). The first run of the fast form at each M
  has the default logger and the run's at VERBOSE, between "@@probe" markers on stderr (the parent reads
  them), so that a line logged once per session shows too.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # after an installed fp8onnx (a source tree lacks fp8onnx.passes)

FAST = ("fast_w8a16", "fast_w8a8")


def expected_path(form: str, m: int, deepgemm: bool) -> str:
    """The fast form's path by the kernel's rules in onnxruntime 1.31.1 (its header, tests and
    strings): GEMV up to ``ORT_FP8_GEMV_MAX_M`` (default 32; scalar or tensor-core variant), DeepGEMM
    for W8A8 with block 128 above it when asked for, else dequantize + cuBLAS."""
    if form not in FAST:
        return ""
    if m <= int(os.environ.get("ORT_FP8_GEMV_MAX_M", "32")):
        return "gemv"
    return "deepgemm" if deepgemm and form == "fast_w8a8" and m <= 128 else "dequant+cublas"


def kernel_path(names: list[str]) -> str:
    """The fast form's path from the names of the kernels one run launched."""
    if any("sm90_fp8_gemm" in n or "deep_gemm" in n for n in names):
        return "deepgemm"
    if any("Fp8MmaGemv" in n for n in names):
        return "gemv-mma"
    if any("Fp8Gemv" in n for n in names):
        return "gemv"
    if any("DequantizeBlockScaledFp8" in n for n in names):
        return "dequant+cublas"
    return "other"


def make_session(ort, path: str, provider: str):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if provider == "cuda":
        return ort.InferenceSession(path, so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    from fp8onnx.graph.cpu_ep import cuda_only_ops, emulated

    so.add_session_config_entry("session.disable_quant_qdq", "1")  # onnxruntime 1.31's float8 fusion
    if not cuda_only_ops(path):
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    with emulated(path, None, "", str(path)) as model:
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def bound(ort, sess, x: np.ndarray, device: str):
    """An IO binding with ``x`` copied to the device once and the output allocated there."""
    binding = sess.io_binding()
    binding.bind_ortvalue_input(sess.get_inputs()[0].name, ort.OrtValue.ortvalue_from_numpy(x, device, 0))
    binding.bind_output(sess.get_outputs()[0].name, device)
    return binding


def l2_flush(torch):
    """A function that evicts the GPU's L2 cache (50 MB on an H200, where a Llama-7B weight in FP8, 16-45 MB,
    would stay between runs: in a model the other layers' weights evict it) by zeroing 256 MiB; none on
    the CPU."""
    if torch is None:
        return lambda: None
    buffer = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    return buffer.zero_


def wall_times(sess, binding, sync, flush, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each synchronised ``run_with_iobinding`` (the L2 cache flushed before, untimed)
    after ``warmup`` runs."""
    for _ in range(warmup):
        sess.run_with_iobinding(binding)
    sync()
    times = []
    for _ in range(repeats):
        flush()
        sync()
        start = time.perf_counter()
        sess.run_with_iobinding(binding)
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def log_probe(ort, sess, binding, label: str) -> None:
    """One run with onnxruntime's default logger and the run's logger at VERBOSE, between markers."""
    options = ort.RunOptions()
    options.log_severity_level = 0
    print(f"@@probe {label}", file=sys.stderr, flush=True)
    ort.set_default_logger_severity(0)
    try:
        sess.run_with_iobinding(binding, options)
    finally:
        ort.set_default_logger_severity(3)
        print("@@end", file=sys.stderr, flush=True)


def kernel_trace(torch, runs: dict, repeats: int = 3) -> dict:
    """{M: {"kernel_us": device time per run, "kernels": [[name, us per run], ...]}} from one CUPTI trace
    of ``repeats`` runs at each M (``runs``: {M: callable}), each M inside a named range: a kernel
    belongs to the range its start falls in (each range ends with a device synchronisation)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for m, run in runs.items():
            with record_function(f"gemm_m={m}"):
                for _ in range(repeats):
                    run()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_file))
        events = json.loads(trace_file.read_text()).get("traceEvents", [])
    return split_trace(events, repeats)


def split_trace(events: list[dict], repeats: int) -> dict:
    """Device kernels of a chrome trace grouped by the "gemm_m=M" range their start falls in."""
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(e["name"].split("=")[1]))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("gemm_m=")
    )
    per_m: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "at::native" in str(e.get("name")):
            continue  # torch's own kernels (the L2 flush) are not the GEMM's
        start = float(e["ts"])
        owner = [m for lo, hi, m in ranges if lo <= start <= hi] or [m for lo, _, m in ranges if lo <= start][-1:]
        if owner:
            per_m[owner[0]][e["name"]] += float(e.get("dur", 0)) / repeats
    out = {}
    for m, kernels in per_m.items():
        top = sorted(kernels.items(), key=lambda kv: -kv[1])
        out[m] = {"kernel_us": sum(kernels.values()), "kernels": [[name[:160], us] for name, us in top[:4]]}
    return out


def time_form(ort, torch, path: str, plan: dict, form: str, label: str) -> dict:
    """{M: cell} for one model: wall times at each M, then (CUDA) the kernel trace and the log probe."""
    provider, device = plan["provider"], "cuda" if plan["provider"] == "cuda" else "cpu"
    sess = make_session(ort, path, provider)
    if provider == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"the session runs on {sess.get_providers()}, not the CUDA EP")
    sync = torch.cuda.synchronize if torch is not None else (lambda: None)
    flush = l2_flush(torch)
    k = sess.get_inputs()[0].shape[-1]
    rng = np.random.default_rng(2)
    cells, bindings = {}, {}
    for m in plan["ms"]:
        if time.time() > plan["deadline"]:
            cells[m] = {"skipped": "time guard"}
            continue
        try:
            binding = bound(ort, sess, rng.standard_normal((m, k)).astype(np.float16), device)
            if form in FAST:  # the first run at this M, where a line logged once per session shows too
                log_probe(ort, sess, binding, f"{label} {m}")
            repeats = plan["repeats"] if m < 1024 else plan["repeats_prefill"]
            times = wall_times(sess, binding, sync, flush, plan["warmup"], repeats)
        except Exception as exc:  # one shape the kernel refuses (cuBLASLt's FP8 alignment, say): noted, not fatal
            cells[m] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
            continue
        bindings[m] = binding
        cells[m] = {"wall_ms": statistics.median(times), "wall_ms_min": min(times), "runs": len(times)}
    if torch is not None and bindings:
        try:
            runs = {m: (lambda b=b: (flush(), sess.run_with_iobinding(b))) for m, b in bindings.items()}
            trace = kernel_trace(torch, runs)
        except Exception as exc:  # no CUPTI: the log probe and the documented rules remain
            trace = {}
            print(f"  kernel trace failed: {type(exc).__name__}: {exc}", flush=True)
        for m, seen in trace.items():
            cells[m].update(seen, path=kernel_path([n for n, _ in seen["kernels"]]))
    return cells


def run(plan: dict) -> dict:
    """{width: {form: {M: cell}}} for every model of the plan (each cell: wall_ms, kernel_us, path, or
    error / skipped), and the setting's environment."""
    torch = None
    if plan["provider"] == "cuda":
        import torch  # first: its CUDA 13 libraries (the nvidia-* packages) for onnxruntime-gpu's provider
    from gpu_common import ort_module

    ort = ort_module(cuda=plan["provider"] == "cuda")
    deepgemm = os.environ.get("ORT_FP8_MATMUL_DEEPGEMM") == "1"
    results: dict = {}
    for width, forms in plan["models"].items():
        results[width] = {}
        for form, path in forms.items():
            label = f"{form} {width}"
            if time.time() > plan["deadline"]:
                results[width][form] = {"skipped": "time guard"}
                continue
            start = time.perf_counter()
            try:
                cells = time_form(ort, torch, path, plan, form, label)
            except Exception as exc:  # a form the EP cannot load: the others still run
                results[width][form] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"}
                print(f"  {label}: {results[width][form]['error']}", flush=True)
                continue
            for m, cell in cells.items():
                cell["expected_path"] = expected_path(form, m, deepgemm)
            results[width][form] = cells
            shown = ", ".join(f"M={m} {c['wall_ms']:.3f}" for m, c in cells.items() if "wall_ms" in c)
            print(f"  {label} ({time.perf_counter() - start:.1f} s): {shown} ms", flush=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("ORT_FP8_")}
    device = torch.cuda.get_device_name(0) if torch is not None else "cpu"
    return {"env": env, "onnxruntime": ort.__version__, "device": device, "results": results}


def main() -> None:
    plan_file, out_file = sys.argv[1:3]
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    result = run(json.loads(pathlib.Path(plan_file).read_text()))
    pathlib.Path(out_file).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
