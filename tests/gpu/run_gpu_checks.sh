#!/usr/bin/env bash
# On the lent GPU machine, after onnxruntime-gpu is installed into .ortgpu/site (../shared/hooks/gpu/README.md):
#   bash tests/gpu/run_gpu_checks.sh
# Step 7 (onnxruntime-genai tokens per second) runs when tests/gpu/stage_genai.py's parts were carried
# (.gpucarry/p0 ...): they are joined and unpacked, and the onnxruntime-genai-cuda wheel among them is
# installed next to onnxruntime-gpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/.ortgpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
genai=()
if ls .gpucarry/p*/genai.tar.part >/dev/null 2>&1; then
  rm -rf .gpucarry/genai
  for part in $(ls -d .gpucarry/p* | sort -V); do cat "$part/genai.tar.part"; done | tar -x -C .gpucarry
  for wheel in .gpucarry/genai/wheel/*.whl; do
    [ -e "$wheel" ] && python3 -m pip install -q --no-index --no-deps --target .ortgpu/site "$wheel"
  done
  for name in $(python3 -c 'import json; print(" ".join(json.load(open(".gpucarry/genai/folders.json"))))'); do
    folder=$(python3 -c "import json; print(json.load(open('.gpucarry/genai/folders.json'))['$name'])")
    genai+=("--genai=$name=$PWD/.gpucarry/genai/$folder")
  done
fi
python3 tests/gpu/run_gpu_checks.py --out "${OUT:-.}" ${genai[@]+"${genai[@]}"}
