#!/usr/bin/env bash
# The one prepared GPU check (issue 34): one script, at most ~8 minutes on one GPU, no network (random weights,
# synthetic latents, made by tests/bench/gpu_fixtures.py). Not yet run: no device has been lent to this project since
# it was written. Usage on a CUDA machine, from the repository root, with torch (CUDA build) + requirements installed:
#   bash tests/bench/gpu_check.sh [OUT_DIR]
# It prints, side by side in one run:
#   1) the training step before issue 34 (eager, the host reading loss/grad norm every step) vs each change (no host
#      sync, foreach vs fused AdamW, regional compile, selective checkpointing, all together): DiT-XL/2 256 px, bf16,
#      micro-batch 256, uncapped: images/s, MFU, peak and reserved memory (python -m train.bench --preset changes-gpu);
#   2) the RTX 3090 setting: a real `python -m train` of DiT-XL/2, fp16, the planned micro-batch (auto), under a
#      23.3 GiB allocator cap (tests/bench/capped.py), its images/s and peak memory from metrics.jsonl;
#   3) `python -m train.plan --verify` at that setting under the cap: predicted vs measured peak;
#   4) DiTDH-XL (RAE) planned and verified under the cap;
#   5) sampling images/s of DiT-XL/2 at 256 px: DDPM 250 steps and DPM-Solver++ 20 steps, cfg 1.5, batch 64.
# Each part has its own time limit; a part that fails or runs out of time says so and the next one runs.
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
fx="$out/fixtures"
CAP=23.3  # GiB: what an RTX 3090 (24 GiB) leaves to one process
PY=${PYTHON:-python}

BUDGET=${GPU_CHECK_BUDGET:-480}  # seconds: a part never starts later than this, and is cut to what is left

part() {  # part NAME SECONDS CMD...: run, tee to OUT/NAME.txt, say how it ended
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -le 10 ]; then echo "== $name: skipped, the ${BUDGET} s budget is spent" | tee "$out/$name.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local code=${PIPESTATUS[0]}
  echo "== $name: exit $code after $((SECONDS - start)) s$([ "$code" = 124 ] && echo " (time limit $limit s)")"
}

seconds_of() {  # seconds_of CMD...: "START END" wall-clock stamps of a command (its output into the log)
  local start
  start=$(date +%s.%N)
  timeout 90 "$@" >>"$out/sample.txt" 2>&1 || echo "failed or over 90 s: $*" | tee -a "$out/sample.txt" >&2
  echo "$start $(date +%s.%N)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
part fixtures 90 $PY tests/bench/gpu_fixtures.py "$fx" --model DiT-XL/2 --image-size 256 --num-latents 512

# 1) today's eager step vs every change (MFU from the known H100/H200/A100/... peaks, train/bench.py)
part step-changes 180 $PY -m train.bench --preset changes-gpu --memory-cap-gib 0 --steps 4 --warmup 2 \
  --json "$out/step-changes.json"

# 2) the 3090 setting as a real training run (global batch 256, micro-batch and checkpointing planned for the cap)
part train-3090 120 $PY tests/bench/capped.py "$CAP" -m train --latents "$fx/latents" --results-dir "$out/run-3090" \
  --model DiT-XL/2 --precision fp16 --global-batch-size 256 --max-steps 8 --log-every 4 --ckpt-every 1000000 \
  --sample-every 0 --keep-last 1 --resume none
$PY - "$out/run-3090" <<'PYEOF' | tee -a "$out/train-3090.txt"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()] if (run / "metrics.jsonl").is_file() else []
config = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
print("3090 setting:", {k: config.get(k) for k in ("precision", "micro_batch_size", "grad_accum_steps", "grad_checkpoint")})
for row in rows:
    print(f"  step {row.get('step')}: {row.get('images_per_s', 0):.1f} images/s, peak {row.get('peak_mem_gb', 0):.2f} GiB "
          f"(before issue 34: 288 images/s at micro-batch 128 x 2, 18.69 GiB)")
PYEOF

# 3) the planner's prediction against the trainer's own step at the 3090 setting, under the cap
part plan-verify-3090 75 $PY tests/bench/capped.py "$CAP" -m train.plan --model DiT-XL/2 --image-size 256 \
  --precision fp16 --grad-checkpoint --gpu-memory 24GiB --global-batch-size 256 --verify

# 4) DiTDH-XL (RAE) on 768x16x16 DINOv2-B tokens, flow, bf16, RAE's global batch, under the cap
part plan-verify-ditdh-xl 75 $PY tests/bench/capped.py "$CAP" -m train.plan --model DiTDH-XL --objective flow \
  --image-size 224 --vae-factor 14 --latent-channels 768 --precision bf16 --grad-checkpoint --gpu-memory 24GiB \
  --global-batch-size 1024 --verify

# 5) sampling: the time of one batch of 64 (two DPM-Solver++ runs of 1 and 2 batches separate the loading time)
if [ $((BUDGET - SECONDS)) -gt 60 ]; then
  echo "== sampling (DiT-XL/2 256 px, random weights, cfg 1.5, batch 64)"
  common=(--ckpt "$fx/dit.pt" --vae "$fx/vae" --batch-size 64 --cfg-scale 1.5 --precision bf16 --vae-precision bf16)
  dpm1=$(seconds_of $PY -m sample "${common[@]}" --num-samples 64 --sampler dpmpp-2m --num-sampling-steps 20 --out "$out/s-dpm1")
  dpm2=$(seconds_of $PY -m sample "${common[@]}" --num-samples 128 --sampler dpmpp-2m --num-sampling-steps 20 --out "$out/s-dpm2")
  ddpm=$(seconds_of $PY -m sample "${common[@]}" --num-samples 64 --sampler ddpm --num-sampling-steps 250 --out "$out/s-ddpm")
  $PY - $dpm1 $dpm2 $ddpm <<'PYEOF' | tee -a "$out/sample.txt"
import sys
stamps = list(map(float, sys.argv[1:]))
dpm1, dpm2, ddpm = (end - start for start, end in zip(stamps[::2], stamps[1::2]))
batch = dpm2 - dpm1            # one batch of 64 with DPM-Solver++ 20 (loading cancels out)
load = max(dpm1 - batch, 0.0)  # loading the weights and the VAE, starting CUDA
print(f"sampling DiT-XL/2 256 px, batch 64, cfg 1.5, bf16: DPM-Solver++(2M) 20 steps {64 / batch:.1f} images/s; "
      f"DDPM 250 steps {64 / max(ddpm - load, 1e-9):.2f} images/s (loading {load:.1f} s subtracted); "
      f"50,000 images with DDPM 250: {50000 / (64 / max(ddpm - load, 1e-9)) / 3600:.2f} GPU-hours")
PYEOF
else
  echo "== sampling: skipped, the ${BUDGET} s budget is spent"
fi

# 6) sampling options side by side: the network loop eager fp32 vs bf16 vs bf16 + one compiled block, and the VAE
# decode fp32 vs bf16 with its pixel error (tests/bench/bench_sample.py; the graphs row is left to a longer run)
part bench-sample 120 $PY tests/bench/bench_sample.py --preset gpu --options bf16 bf16+blocks \
  --json "$out/bench-sample.json"

echo "== done after $SECONDS s: outputs in $out"
