#!/usr/bin/env bash
# On the lent GPU machine, after onnxruntime-gpu is installed into .ortgpu/site (../shared/hooks/gpu/README.md):
#   bash tests/gpu/run_gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/.ortgpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 tests/gpu/run_gpu_checks.py --out "${OUT:-.}"
