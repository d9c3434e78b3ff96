#!/usr/bin/env bash
# The one prepared GPU check (not yet run: no device has been lent to this project so far).
# Usage on a CUDA machine, from the repository root, with torch (CUDA build) + requirements installed:
#   bash tests/bench/gpu_check.sh [OUT_DIR]
# 1) planner prediction vs a real step at the planned micro-batch (DiT-XL/2, 256, bf16, checkpointing);
# 2) the training-step matrix for DiT-XL/2 capped at 24 GiB (fast-DiT's table + MFU);
# 3) that with LightningDiT's block; 4) DiT^DH-XL (RAE) planned vs measured; 5) SiT parity when SIT_REPO is set.
set -euo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
python -m train.plan --model DiT-XL/2 --image-size 256 --precision bf16 --grad-checkpoint \
  --gpu-memory 24GiB --global-batch-size 256 --verify 2>&1 | tee "$out/plan-verify.txt"
python -m train.bench --preset gpu --memory-cap-gib 24 --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.txt"
# 3) the same step matrix with LightningDiT's block (RMSNorm + SwiGLU + RoPE; --recipe lightning trains it)
python -m train.bench --preset gpu --memory-cap-gib 24 --block lightning --json "$out/bench-gpu-lightning.json" \
  2>&1 | tee "$out/bench-gpu-lightning.txt"
# 4) DiT^DH-XL (RAE) on 768x16x16 tokens (DINOv2-B at 224 px), flow, bf16: the micro-batch the planner picks for
#    24 GiB, its predicted peak next to the measured one, and the step time there; with checkpointing every block
#    (the largest micro-batch) and off
for ckpt in 1 0; do
  python -m train.plan --model DiTDH-XL --objective flow --image-size 224 --vae-factor 14 --latent-channels 768 \
    --precision bf16 --grad-checkpoint "$ckpt" --gpu-memory 24GiB --global-batch-size 1024 --verify 2>&1 \
    | tee "$out/plan-verify-ditdh-xl-ckpt$ckpt.txt"
done
# 5) SiT parity at XL/2 size on the GPU, when a SiT checkout is given as SIT_REPO (loss and trajectories)
if [ -n "${SIT_REPO:-}" ]; then
  python tests/bench/check_sit_parity.py --sit-repo "$SIT_REPO" --model DiT-XL/2 --input-size 32 --batch 4 \
    2>&1 | tee "$out/sit-parity.txt"
fi
