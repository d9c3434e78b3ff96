#!/usr/bin/env bash
# The one prepared GPU check (not yet run: no device has been lent to this project so far).
# Usage on a CUDA machine, from the repository root, with torch (CUDA build) + requirements installed:
#   bash tests/bench/gpu_check.sh [OUT_DIR]
# 1) planner prediction vs a real step at the planned micro-batch (DiT-XL/2, 256, bf16, checkpointing);
# 2) the training-step matrix for DiT-XL/2 capped at 24 GiB (fast-DiT's table + MFU).
set -euo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
python -m train.plan --model DiT-XL/2 --image-size 256 --precision bf16 --grad-checkpoint \
  --gpu-memory 24GiB --global-batch-size 256 --verify 2>&1 | tee "$out/plan-verify.txt"
python -m train.bench --preset gpu --memory-cap-gib 24 --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.txt"
