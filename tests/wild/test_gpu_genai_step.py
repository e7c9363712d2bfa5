"""Step 7 of the prepared GPU check (onnxruntime-genai tokens per second) runs on the CPU: folders built
by tests/gpu/stage_genai.py the way it builds them for the device (onnxruntime-genai's builder, then
fp8onnx), generated from with onnxruntime-genai's CPU build, and staged in parts a device call carries."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

pytestmark = pytest.mark.wild
SMALL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 512}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    if any(importlib.util.find_spec(n) is None for n in ("transformers", "onnxruntime_genai", "tokenizers")):
        pytest.skip("needs the [wild] extra (pip install -e .[wild])")
    import stage_genai

    return stage_genai.build(tmp_path_factory.mktemp("genai"), cpu=True, dims=SMALL)


def test_the_genai_step_dry_runs_on_the_cpu(folders, tmp_path):
    assert list(folders) == ["fp32", "fp8"]
    args = [f"--genai={name}={path}" for name, path in folders.items()]
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(REPO / "tests/gpu/run_gpu_checks.py"), "--cpu-dry-run"]
        + ["--only", "genai", *args]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])  # a crash: where
    genai = json.loads((tmp_path / "gpu_checks.json").read_text())["genai"]
    base, fp8 = genai["folders"]["fp32"], genai["folders"]["fp8"]
    assert "error" not in base and "error" not in fp8, genai
    assert len(base["tokens"]) == 5 and all(len(t) == genai["new_tokens"] for t in base["tokens"])
    assert base["tokens_per_s"] > 0 and fp8["speed_vs_baseline"] > 0
    assert 0 <= fp8["token_agreement"] <= 1 and 0 <= fp8["identical_sequences"] <= 5
    assert "placement" not in json.loads((tmp_path / "gpu_checks.json").read_text())  # --only genai


def test_the_staged_parts_join_into_the_folders(folders, tmp_path, monkeypatch):
    import stage_genai

    monkeypatch.setattr(stage_genai, "REPO", tmp_path)  # .gpucarry under a scratch root, not the checkout
    (tmp_path / ".git" / "info").mkdir(parents=True)
    root = next(iter(folders.values())).parent
    parts = stage_genai.stage(root, None)
    assert parts and all((p / "genai.tar.part").stat().st_size <= stage_genai.PART_BYTES for p in parts)
    assert "/.gpucarry/" in (tmp_path / ".git" / "info" / "exclude").read_text()
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join((p / "genai.tar.part").read_bytes() for p in sorted(parts)))
    subprocess.run(["tar", "-xf", str(joined), "-C", str(tmp_path)], check=True)
    names = json.loads((tmp_path / "genai" / "folders.json").read_text())
    assert set(names) == set(folders)
    for name, folder in folders.items():
        assert (tmp_path / "genai" / names[name] / "genai_config.json").read_bytes() == (
            folder / "genai_config.json"
        ).read_bytes()
