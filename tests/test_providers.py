"""Provider truth (fp8onnx.graph.providers): onnxruntime-gpu lists the CUDA EP whether or not its CUDA
libraries load, and a session asked for CUDA then comes up on the CPU EP, saying why only on stderr.
Here onnxruntime is made to behave that way (a GPU build without its libraries, as measured with
onnxruntime-gpu 1.31.1 on a machine without CUDA): --provider cuda is one sentence with onnxruntime's
reason and the command that fixes it (exit 2), auto runs on the CPU EP and says so once, and a CUDA-only
form is emulated as on the CPU EP, never refused with onnxruntime's INVALID_GRAPH."""

import logging
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from fp8onnx.base.errors import Fp8OnnxError
from fp8onnx.cli import main
from fp8onnx.graph import cpu_ep, providers, run_settings, runtime

from helpers import REPO, mlp_data, mlp_model

REAL_SESSION = ort.InferenceSession
LOAD_ERROR = (
    "\x1b[1;31m2026-12-04 05:26:04 [E:onnxruntime:Default, provider_bridge_ort.cc:2458 operator()] "
    "Failed to load library /site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so with error: "
    "libcublasLt.so.13: cannot open shared object file: No such file or directory\x1b[m\n"
)


class _GpuBuildWithoutLibraries(REAL_SESSION):
    """A session asked for CUDA logs onnxruntime's load error on fd 2 and comes up on the CPU EP alone."""

    def __init__(self, src, sess_options=None, providers=None, **kwargs):
        if providers and "CUDAExecutionProvider" in providers:
            os.write(2, LOAD_ERROR.encode())
            providers = [p for p in providers if p != "CUDAExecutionProvider"]
        super().__init__(src, sess_options, providers=providers, **kwargs)


class _GpuBuildWithoutDevice(REAL_SESSION):
    def __init__(self, src, sess_options=None, providers=None, **kwargs):
        if providers and "CUDAExecutionProvider" in providers:
            raise RuntimeError("CUDA failure 100: no CUDA-capable device is detected ; GPU=0")
        super().__init__(src, sess_options, providers=providers, **kwargs)


@pytest.fixture
def gpu_build(monkeypatch):
    """onnxruntime-gpu 1.31.1 as installed by `pip install onnxruntime-gpu` (no extras): the CUDA EP listed."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", _GpuBuildWithoutLibraries)
    monkeypatch.setattr(ort, "preload_dlls", lambda: print("Failed to load libcudart.so.13"), raising=False)
    versions = {"onnxruntime-gpu": "1.31.1"}
    monkeypatch.setattr(providers, "_distribution", versions.get)
    caches = (providers.cuda_unavailable, providers.auto_provider)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:  # the answers of a faked onnxruntime must not outlive the test
        cache.cache_clear()


def test_asked_for_cuda_and_got_cpu_is_one_sentence_with_the_reason_and_the_fix(gpu_build, capfd):
    with pytest.raises(Fp8OnnxError) as info:
        run_settings.resolve_provider("cuda")
    text = str(info.value)
    assert "\n" not in text and text.startswith("Provider 'cuda' was asked for, but onnxruntime")
    assert "(libonnxruntime_providers_cuda.so: libcublasLt.so.13: cannot open shared object file" in text
    assert text.endswith("install its CUDA libraries: pip install 'onnxruntime-gpu[cuda,cudnn]==1.31.1' (what "
                         "pip install 'fp8onnx[gpu]' brings).")  # fmt: skip
    assert "libcublasLt" not in capfd.readouterr().err  # onnxruntime's own log was caught, not shown


def test_the_cli_exits_2_on_cuda_it_cannot_start(gpu_build, tmp_path):
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    commands = (
        ["compare", str(model), str(model), "--data", str(data)],
        ["quantize", str(model), "-o", str(tmp_path / "q.onnx"), "--calib", str(data)],
    )
    for args in commands:
        r = CliRunner().invoke(main, [*args, "--provider", "cuda"])
        assert r.exit_code == 2, r.output
        errors = [line for line in r.output.splitlines() if line.startswith("fp8onnx: error:")]
        assert len(errors) == 1 and "cannot start its CUDA EP here (libonnxruntime_providers_cuda.so" in errors[0]
    assert not (tmp_path / "q.onnx").exists()


def test_auto_says_once_that_it_runs_on_the_cpu(gpu_build, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="fp8onnx.graph.providers"):
        assert run_settings.resolve_provider("auto") == "cpu"
        assert run_settings.resolve_provider("auto") == "cpu"
    said = [r for r in caplog.records if "--provider auto" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "cannot start its CUDA EP here (libonnxruntime_providers_cuda.so: libcublasLt.so.13" in (
        said[0].getMessage()
    )
    model, data = mlp_model(tmp_path / "m.onnx"), mlp_data(tmp_path / "d.npz")
    r = CliRunner().invoke(main, ["compare", str(model), str(model), "--data", str(data)])
    assert r.exit_code == 0, r.output
    assert "vs the FP32 reference (cpu)" in r.output and "MiB: heap the session holds (cpu)" in r.output


def _block_fp8_model(path):
    """One com.microsoft.MatMulBlockQuantizedFp8Weight: a CUDA-only op (the CPU EP has no kernel)."""
    k, n = 32, 8
    rng = np.random.default_rng(0)
    inits = [
        helper.make_tensor("b", TensorProto.FLOAT8E4M3FN, [n, k], rng.standard_normal(n * k).astype(np.float32)),
        numpy_helper.from_array(np.full((n, 1), 0.05, np.float32), "b_scale"),
    ]
    node = helper.make_node(
        "MatMulBlockQuantizedFp8Weight", ["a", "b", "b_scale"], ["y"], domain="com.microsoft", block_size=k
    )
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT16, [2, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, n])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(helper.make_graph([node], "g", [a], [y], inits), opset_imports=opsets), path)
    return path


def test_a_cuda_only_form_without_cuda_is_emulated_never_invalid_graph(gpu_build, tmp_path):
    path = _block_fp8_model(tmp_path / "fast.onnx")
    session = runtime.make_session(path, "auto", "The fast form")
    assert session.get_providers() == ["CPUExecutionProvider"]
    out = session.run(None, {"a": np.ones((2, 32), np.float16)})[0]
    assert out.shape == (2, 8) and np.isfinite(out).all()
    with pytest.raises(Fp8OnnxError, match="cannot start its CUDA EP"):
        runtime.make_session(path, "cuda", "The fast form")


def test_a_session_that_lost_cuda_after_the_probe_is_one_sentence(gpu_build, monkeypatch, tmp_path):
    monkeypatch.setattr(providers, "cuda_unavailable", lambda: None)  # the probe said yes
    with pytest.raises(Fp8OnnxError, match=r"^The model was to run on onnxruntime's CUDA EP but its session has"):
        runtime.make_session(mlp_model(tmp_path / "m.onnx"), "cuda", "The model")


def test_no_device_names_the_driver_not_pip(gpu_build, monkeypatch):
    monkeypatch.setattr(ort, "InferenceSession", _GpuBuildWithoutDevice)
    with pytest.raises(Fp8OnnxError) as info:
        run_settings.resolve_provider("cuda")
    assert "(CUDA failure 100: no CUDA-capable device is detected ; GPU=0)" in str(info.value)
    assert "check that the GPU and its driver are visible" in str(info.value)


def test_the_cpu_build_says_to_install_the_gpu_one(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setattr(providers, "_distribution", {"onnxruntime": "1.32.0"}.get)
    providers.cuda_unavailable.cache_clear()
    try:
        with pytest.raises(Fp8OnnxError, match="has no CUDA EP") as info:
            run_settings.resolve_provider("cuda")
        assert "pip uninstall -y onnxruntime && pip install 'fp8onnx[gpu]'" in str(info.value)
        monkeypatch.setattr(providers, "_distribution", {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}.get)
        providers.cuda_unavailable.cache_clear()
        with pytest.raises(Fp8OnnxError, match="both installed") as info:
            run_settings.resolve_provider("cuda")
        assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install 'fp8onnx[gpu]'" in str(info.value)
    finally:
        providers.cuda_unavailable.cache_clear()


def test_this_install_tells_the_truth():
    """Whatever this machine has: 'auto' is 'cuda' exactly where a CUDA session really starts."""
    missing = providers.cuda_unavailable()
    assert run_settings.resolve_provider("auto") == ("cuda" if missing is None else "cpu")
    if missing is not None:
        with pytest.raises(Fp8OnnxError, match="cannot start its CUDA EP here"):
            run_settings.resolve_provider("cuda")


def test_without_onnxruntime_the_command_names_the_two_installs():
    """fp8onnx's own dependencies name no runtime (its [cpu] and [gpu] extras do): without one, the
    console script says which command installs it, and `import fp8onnx` fails with the same sentence."""
    hide = "import sys; sys.modules['onnxruntime'] = None; "
    script = hide + "sys.argv = ['fp8onnx', 'demo']; import fp8onnx_boot; fp8onnx_boot.entry()"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "fp8onnx: error: fp8onnx needs onnxruntime, which is not installed: pip install 'fp8onnx[cpu]' for the "
        "CPU build, or 'fp8onnx[gpu]' for the CUDA one (not both)."
    )
    done = subprocess.run([sys.executable, "-c", hide + "import fp8onnx"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1 and done.stderr.strip().endswith(
        "ModuleNotFoundError: fp8onnx needs onnxruntime, which is not installed: pip install 'fp8onnx[cpu]' for the "
        "CPU build, or 'fp8onnx[gpu]' for the CUDA one (not both)."
    )


def test_an_emulated_model_over_protobufs_limit_loads_from_a_file(monkeypatch, tmp_path):
    """requires: a CUDA-only form checked on the CPU EP; ensures: where its emulated copy holds more weights
    than one serialized model may (a 1B LLM's fast form: "Failed to serialize proto" on the H200), it is
    loaded from a temporary file with external data instead, with the same outputs, and the file is gone."""
    path = _block_fp8_model(tmp_path / "fast.onnx")
    feed = {"a": np.random.default_rng(1).standard_normal((2, 32)).astype(np.float16)}
    in_memory = runtime.make_session(path.read_bytes(), "cpu", "The fast form").run(None, feed)[0]
    monkeypatch.setattr(cpu_ep, "PROTO_BYTES", 0)
    made = []
    real_save = cpu_ep.ir.save
    monkeypatch.setattr(cpu_ep.ir, "save", lambda model, p, **kw: (made.append(p), real_save(model, p, **kw))[1])
    from_file = runtime.make_session(path.read_bytes(), "cpu", "The fast form").run(None, feed)[0]
    assert len(made) == 1 and not os.path.exists(made[0])  # written, loaded, removed
    np.testing.assert_allclose(from_file, in_memory, rtol=1e-3, atol=1e-3)  # the same graph, as onnxruntime computes it
