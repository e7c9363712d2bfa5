"""GPU check for fp8onnx on onnxruntime's CUDA EP: where FP8 pays. Not run in CI.

On a lent H200 with onnxruntime-gpu staged (../shared/hooks/gpu/README.md): ``bash tests/gpu/run_gpu_checks.sh``
(or ``python tests/gpu/run_gpu_checks.py --out "$OUT"``); it fits one 10-minute call (``--budget-s``,
default 450 s: a time guard skips what would not fit, and says so). ``--dry-run`` runs the same steps on
the CPU EP at tiny widths (the suite's tests/test_gpu_script.py).

Steps (``--steps``, in this order; the rest as time allows):

layers   One GEMM (K = N = 1,024) at M = 4 and 256 in each CUDA form, its output on the CUDA EP against
         fp8onnx's CPU side: the fast form's emulation, GemmFloat8's NumPy reference (about 10 s;
         tests/gpu/layer_numerics.py).
gemm     Single-GEMM models at Llama-7B widths (K x N = 4096x4096, 4096x11008, 11008x4096; float16
         activations, opset 21), one per form: FP16 MatMul (the baseline), the fast form
         ``MatMulBlockQuantizedFp8Weight`` W8A16 and W8A8 (block 128), GemmFloat8 and float8 Q/DQ, each
         written by fp8onnx (tests/gpu/gemm_models.py). Timed at M = 1, 2, 4, 8 (decode), 16-128 (mid)
         and 1,024, 4,096 (prefill) in two processes, without and with ``ORT_FP8_MATMUL_DEEPGEMM=1``
         (tests/gpu/gemm_timing.py): IO binding on the device, warm-up, median synchronised wall time,
         the kernels of each run from a CUPTI trace (the path that ran, and device time) and onnxruntime's
         VERBOSE log. Ratios to FP16 at the same M and width, in a table and in ``gemm.rows``.
genai    onnxruntime-genai tokens per second: an FP16 folder from its model builder for a Llama-style
         model with random weights and real widths (about 1 B parameters), against fp8onnx's
         ``--target onnxruntime-cuda`` folder of it; greedy generation of 128 tokens from fixed prompts,
         tokens per second, whether the greedy texts agree (tests/gpu/genai_tps.py). Built on the
         machine in the background while the GEMMs are timed (``--genai NAME=FOLDER``, repeated, gives
         folders instead: the first is the baseline). Needs the onnxruntime-genai-cuda wheel carried
         (run_gpu_checks.sh installs it); without it the step says so and is skipped.
decoder  The sample decoder (tests/gpu/decoder_checks.py): placement per provider from the profiler,
         accuracy of FP16, Q/DQ, the fast form and GemmFloat8, the fast form against its CPU emulation,
         weight blocks of 32 in the CUDA EP's per-axis form.

Writes gpu_checks.json (and gpu_checks_table.txt) into --out, after every step.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE)]
sys.path.append(str(REPO))  # after an installed fp8onnx (a source tree lacks fp8onnx.passes)

import gemm_models  # noqa: E402
import gemm_report  # noqa: E402
from gpu_common import ort_module, write_json  # noqa: E402

STEPS = ("layers", "gemm", "genai", "decoder")
GENAI_RESERVE_S = 60  # loading both folders and generating, after the build
DECODER_NEEDS_S = 100


class Clock:
    """The time guard: seconds left of the budget, counted from the start."""

    def __init__(self, budget_s: float):
        self.deadline = time.time() + budget_s

    def left(self) -> float:
        return self.deadline - time.time()


def timing_process(plan: dict, setting: str, tmp: pathlib.Path, deadline: float) -> tuple[dict, str]:
    """One setting's results (gemm_timing.py in a process of its own) and its stderr."""
    plan_file, out_file, err_file = (tmp / f"{setting}.{ext}" for ext in ("plan.json", "json", "stderr"))
    plan_file.write_text(json.dumps({**plan, "deadline": deadline}))
    env = {k: v for k, v in os.environ.items() if k != "ORT_FP8_MATMUL_DEEPGEMM"}
    if setting == "deepgemm_on":
        env["ORT_FP8_MATMUL_DEEPGEMM"] = "1"  # read when the kernel is made: before the session, in this process
    print(f"GEMM timing, {setting}:", flush=True)
    with err_file.open("w") as err:
        try:
            done = subprocess.run(
                [sys.executable, str(HERE / "gemm_timing.py"), str(plan_file), str(out_file)],
                env=env,
                stderr=err,
                timeout=max(30.0, deadline - time.time() + 60),
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    stderr = err_file.read_text(errors="replace")
    if code != 0 or not out_file.exists():
        tail = "\n".join(line for line in stderr.splitlines() if not line.startswith("@@"))[-1500:]
        print(f"  the {setting} process ended with {code}:\n{tail}", flush=True)
        return {"error": f"exit {code}", "stderr_tail": tail}, stderr
    return json.loads(out_file.read_text()), stderr


def gemm_step(results: dict, args, clock: Clock, out: pathlib.Path) -> None:
    widths = gemm_models.DRY_WIDTHS if args.dry_run else gemm_models.WIDTHS
    forms = gemm_models.FORMS
    with tempfile.TemporaryDirectory(prefix="fp8onnx-gemm-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        start = time.perf_counter()
        models = gemm_models.build_all(tmp, widths, forms, workers=1 if args.dry_run else len(widths))
        built_s = time.perf_counter() - start
        print(f"built {sum(map(len, models.values()))} single-GEMM models in {built_s:.1f} s", flush=True)
        built = {w: sorted(m) for w, m in models.items()}
        if args.dry_run:  # GemmFloat8 has no CPU kernel (and no emulation): built, not run
            models = {w: {f: p for f, p in m.items() if f in gemm_models.CPU_FORMS} for w, m in models.items()}
        plan = {
            "models": models,
            "ms": list(gemm_models.DRY_MS if args.dry_run else gemm_models.MS),
            "provider": "cpu" if args.dry_run else "cuda",
            "warmup": args.warmup,
            "repeats": args.repeats,
            "repeats_prefill": max(3, args.repeats // 2),
        }
        settings, logs = {}, {}
        reserve = (GENAI_RESERVE_S if "genai" in args.steps else 0) + (30 if "decoder" in args.steps else 0)
        for i, setting in enumerate(gemm_report.SETTINGS):
            share = (clock.left() - reserve) / (len(gemm_report.SETTINGS) - i)  # the second gets what is left
            settings[setting], stderr = timing_process(plan, setting, tmp, time.time() + share)
            logs[setting] = gemm_report.logged_deepgemm(stderr)
    rows = gemm_report.rows(settings, logs)
    results["gemm"] = {
        "widths": list(models),
        "ms": plan["ms"],
        "forms": list(forms),
        "built": built,
        "build_s": built_s,
        "settings": {k: {kk: vv for kk, vv in v.items() if kk != "results"} for k, v in settings.items()},
        "rows": rows,
    }
    text = gemm_report.table(rows)
    print(text, flush=True)
    (out / "gpu_checks_table.txt").write_text(text + "\n")


def start_genai_build(args) -> tuple[subprocess.Popen | None, pathlib.Path | None, str | None]:
    """(the background build of the two folders, its folder, or why there is none)."""
    if args.genai:
        return None, None, None
    if args.dry_run:
        return None, None, "the dry run builds no onnxruntime-genai folders (--genai NAME=FOLDER gives some)"
    from genai_tps import genai_cuda_missing

    missing = genai_cuda_missing()
    if missing:
        why = f"{missing}: ../shared/hooks/gpu stages only onnxruntime-gpu; carry the onnxruntime-genai-cuda wheel"
        return None, None, why + " in .ortgpu/genai/ (tests/gpu/run_gpu_checks.sh installs it)"
    where = pathlib.Path(tempfile.mkdtemp(prefix="fp8onnx-genai-"))
    command = ["nice", "-n", "10", sys.executable, str(HERE / "genai_tps.py"), "build", str(where)]
    command += ["--dims", json.dumps(args.genai_dims)] if args.genai_dims else []
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    log = (where / "build.log").open("w")
    print(f"building the onnxruntime-genai folders in the background ({where})", flush=True)
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), where, None


def genai_step(results: dict, args, clock: Clock, build) -> None:
    from genai_tps import genai_checks

    process, where, skipped = build
    if skipped:
        results["genai"] = {"skipped": skipped}
        print(f"genai: skipped: {skipped}", flush=True)
        return
    folders = dict(item.split("=", 1) for item in args.genai)
    if process is not None:
        try:
            process.wait(timeout=max(1.0, clock.left() - GENAI_RESERVE_S))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        log = (where / "build.log").read_text(errors="replace")
        if process.returncode != 0 or not (where / "folders.json").exists():
            why = "the time guard stopped it" if process.returncode == -9 else f"exit {process.returncode}"
            results["genai"] = {"skipped": f"building the folders failed ({why})", "build_log_tail": log[-2000:]}
            print(f"genai: skipped: building the folders failed ({why}):\n{log[-1500:]}", flush=True)
            return
        built = json.loads((where / "folders.json").read_text())
        folders = {"fp16": built["fp16"], "fp8": built["fp8"]}
        results["genai_build"] = built
    results["genai"] = genai_checks(folders, new_tokens=args.genai_tokens)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", "--cpu-dry-run", dest="dry_run", action="store_true", help="CPU EP, tiny widths")
    ap.add_argument("--steps", default=None, help=f"comma-separated, of {','.join(STEPS)} (dry run: layers,gemm,genai)")
    ap.add_argument("--only", choices=STEPS, help="this step alone (the same as --steps STEP)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="the time guard: seconds for the whole check")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30, help="timed runs per M (half at prefill M)")
    ap.add_argument("--genai", action="append", default=[], metavar="NAME=FOLDER", help="folders to generate with")
    ap.add_argument("--genai-dims", type=json.loads, default=None, help="the on-machine model's sizes (JSON)")
    ap.add_argument("--genai-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    steps = args.only or args.steps or ("layers,gemm,genai" if args.dry_run else ",".join(STEPS))
    args.steps = [s for s in STEPS if s in steps.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ort = ort_module(cuda=not args.dry_run)
    provider = "cpu" if args.dry_run else "cuda"
    print(f"onnxruntime {ort.__version__}, available providers {ort.get_available_providers()}", flush=True)
    if provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        sys.exit("no CUDA EP in this onnxruntime")
    results: dict = {"onnxruntime": ort.__version__, "provider": provider, "dry_run": args.dry_run}
    results.update(budget_s=args.budget_s, steps=args.steps)
    build = start_genai_build(args) if "genai" in args.steps else (None, None, None)
    if "layers" in args.steps:
        from layer_numerics import layer_numerics

        results["layers"] = layer_numerics(provider)
        write_json(results, out)
    if "gemm" in args.steps:
        gemm_step(results, args, clock, out)
        write_json(results, out)  # kept if a later step takes the process down
    if "genai" in args.steps:
        genai_step(results, args, clock, build)
        write_json(results, out)
    if "decoder" in args.steps:
        if clock.left() < DECODER_NEEDS_S:
            results["decoder"] = {"skipped": f"time guard: {clock.left():.0f} s left of {args.budget_s:.0f}"}
            print(f"decoder: skipped ({results['decoder']['skipped']})", flush=True)
        else:
            from decoder_checks import decoder_checks

            results["decoder"] = decoder_checks(provider)
    results["elapsed_s"] = args.budget_s - clock.left()
    print(f"wrote {write_json(results, out)} after {results['elapsed_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
