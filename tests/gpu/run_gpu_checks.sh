#!/usr/bin/env bash
# The GPU check on a lent H200 (../shared/hooks/gpu/README.md), from the repo root, two device calls back to back:
#   1. run(command="mkdir -p ~/ortgpu && cp -r .ortgpu/c1 ~/ortgpu/", carry=[".ortgpu/c1"], timeout_s=60)
#   2. run(command="bash tests/gpu/run_gpu_checks.sh", carry=[".ortgpu/c2", ".ortgpu/genai"], timeout_s=600)
# Call 1 starts the machine and keeps the first part outside the tree: a call that carries .ortgpu/c2 removes
# every other path under .ortgpu/ there (seen on 2026-12-04), .ortgpu/c1 and an unpacked .ortgpu/site too.
# Call 2 unpacks onnxruntime-gpu into .ortgpu/site (unless there already), installs next to it the
# onnxruntime-genai-cuda wheel staged in .ortgpu/genai/ (the genai step is skipped, saying so, without it),
# and runs tests/gpu/run_gpu_checks.py (about 7.5 minutes: its --budget-s time guard, default 450 s), its
# output also in $OUT/gpu_checks.log; gpu_checks.json and gpu_checks_table.txt come back in $OUT.
# Staging, here, before call 1: ../shared/hooks/gpu/stage-ort-gpu.sh (.ortgpu/c1 ~52 MB, .ortgpu/c2 ~13 MB),
# then the wheel (16.7 MB, for the machine's Python 3.12):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .ortgpu/genai onnxruntime-genai-cuda==0.18.0
# Arguments are passed on to run_gpu_checks.py (e.g. --steps gemm, --budget-s 400).
# Folders staged by tests/gpu/stage_genai.py (.gpucarry/p0 ...) are still taken: joined, unpacked and passed
# as --genai NAME=FOLDER, with the wheel among them installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.}
mkdir -p "$out"
# fp8onnx as pip installs it (pyproject's package-dir: passes/ and models/ are fp8onnx.passes and fp8onnx.models),
# without installing (the machine reaches no index): a folder of links, first on the path.
pkg=.ortgpu/pkg/fp8onnx
rm -rf .ortgpu/pkg && mkdir -p "$pkg"
for entry in fp8onnx/*; do ln -s "$PWD/$entry" "$pkg/"; done
ln -s "$PWD/passes" "$pkg/passes" && ln -s "$PWD/models" "$pkg/models"
export PYTHONPATH="$PWD/.ortgpu/site:$PWD/.ortgpu/pkg:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -P -c 'import fp8onnx.passes, fp8onnx.models' || { echo "fp8onnx does not import from $PWD/.ortgpu/pkg" >&2; exit 2; }
if [ ! -e .ortgpu/c1/cuda.so.xz ] && [ -e ~/ortgpu/c1/cuda.so.xz ]; then mkdir -p .ortgpu && cp -r ~/ortgpu/c1 .ortgpu/; fi
if [ -f .ortgpu/c2/unpack.py ] && [ ! -e .ortgpu/site/onnxruntime/capi/libonnxruntime_providers_cuda.so ]; then
  python3 .ortgpu/c2/unpack.py .ortgpu/site
fi
install_wheel() { python3 -m pip install -q --no-index --no-deps --no-compile --target .ortgpu/site "$1"; }
for wheel in .ortgpu/genai/*.whl; do
  if [ -e "$wheel" ]; then install_wheel "$wheel"; fi
done
genai=()
if ls .gpucarry/p*/genai.tar.part >/dev/null 2>&1; then
  rm -rf .gpucarry/genai
  for part in $(ls -d .gpucarry/p* | sort -V); do cat "$part/genai.tar.part"; done | tar -x -C .gpucarry
  for wheel in .gpucarry/genai/wheel/*.whl; do
    if [ -e "$wheel" ]; then install_wheel "$wheel"; fi
  done
  for name in $(python3 -c 'import json; print(" ".join(json.load(open(".gpucarry/genai/folders.json"))))'); do
    folder=$(python3 -c "import json; print(json.load(open('.gpucarry/genai/folders.json'))['$name'])")
    genai+=("--genai=$name=$PWD/.gpucarry/genai/$folder")
  done
fi
python3 tests/gpu/run_gpu_checks.py --out "$out" ${genai[@]+"${genai[@]}"} "$@" 2>&1 | tee "$out/gpu_checks.log"
