"""What the GPU check's modules share: onnxruntime with its CUDA libraries loaded, and the JSON file."""

from __future__ import annotations

import json
import pathlib


def ort_module(cuda: bool = True):
    """onnxruntime, after torch (where installed) and ``preload_dlls()`` for ``cuda``: onnxruntime-gpu's CUDA
    provider, and onnxruntime-genai's CUDA build, find the CUDA 13 libraries of the nvidia-* packages only
    when they are loaded first (docs/gpu.md)."""
    if cuda:
        try:
            import torch  # noqa: F401  (its CUDA libraries, loaded globally)
        except ImportError:
            pass
    import onnxruntime as ort

    if cuda and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    return ort


def write_json(results: dict, where, name: str = "gpu_checks.json") -> pathlib.Path:
    out = pathlib.Path(where)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path
