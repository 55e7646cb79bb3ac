#!/usr/bin/env bash
# GPU check (one H200 with PyTorch, no package registry): a transformers rollout and a DeepSpeed
# ZeRO-2 update of a Qwen2.5-0.5B-shaped model in bf16 through stagerl's code; prints a JSON summary
# (tokens/s, step time, MFU estimate). Packages missing there travel as wheels in .whl/ (at most
# 64 MiB): build them here with `make gpu-wheels`, then run with the device tool, carrying .whl:
#   bash bench/gpu_check.sh            (about 2-4 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 bench/gpu_check.py "$@"
