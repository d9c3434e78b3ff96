#!/usr/bin/env bash
# The one prepared GPU check (issues 34, 45): one script, at most 480 s on one GPU, no network (random weights,
# synthetic latents, made by tests/bench/gpu_fixtures.py). Usage on a CUDA machine, from the repository root, with
# torch (CUDA build) + requirements installed (diffusers and pytest missing: gpu_fixtures.py's header lists the wheels):
#   bash tests/bench/gpu_check.sh [OUT_DIR]
#   GPU_CHECK_DRY=1 bash tests/bench/gpu_check.sh [OUT_DIR]   every part's command at a tiny size on the CPU (flags
#                                                             parse, code runs; limits x GPU_CHECK_DRY_SCALE, default 3)
# The parts, most valuable first (a part whose limit does not fit in what is left of the budget is skipped, never
# started to be cut; a part that fails or runs out of time says so and the next one runs; each part's limit includes
# the 5 s timeout leaves between SIGTERM and SIGKILL; train.bench keeps the rows it measured when cut):
#   part                   limit s   sum s   what
#   gpu-info                    10      10   nvidia-smi, torch and CUDA versions
#   step-changes               140     150   the step before issue 34 (eager, host reading loss/grad norm every step) vs
#                                            each change (no host sync, foreach vs fused AdamW, regional compile,
#                                            selective checkpointing, all together): DiT-XL/2 256 px, bf16, the largest
#                                            micro-batch up to 256 the planner fits in the free memory, uncapped
#   fixtures-latents            20     170   512 synthetic 32x32x4 latents
#   train-3090                  70     240   a real `python -m train` of DiT-XL/2, fp16, the planned micro-batch (auto),
#                                            under a 23.3 GiB cap (tests/bench/capped.py): images/s, peak memory
#   plan-verify-3090            40     280   `python -m train.plan --verify` at that setting under the cap
#   plan-verify-ditdh-xl        40     320   DiTDH-XL (RAE) planned and verified under the cap
#   fixtures-weights            30     350   random DiT-XL/2 weights and a random SD-VAE (needs diffusers)
#   sample-dpm1                 25     375   sampling DiT-XL/2 256 px, cfg 1.5, batch 64: DPM-Solver++ 20 steps, 1 batch
#   sample-dpm2                 30     405   the same, 2 batches (the difference is one batch: loading cancels out)
#   sample-ddpm                 35     440   DDPM 250 steps, 1 batch
#   bench-sample                30     470   eager fp32 vs bf16 network loop, VAE decode fp32 vs bf16 and its pixel
#                                            error (tests/bench/bench_sample.py, DPM-Solver++ only; compile rows are
#                                            left to a longer run)
# The 10 s left over cover the summaries the script prints between parts.
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
fx="$out/fixtures"
PY=${PYTHON:-python}
GRACE=5  # seconds timeout waits after SIGTERM before SIGKILL: part of each part's limit

if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  # the same commands at a tiny size on the CPU: a check that they parse and run, not a measurement
  export CUDA_VISIBLE_DEVICES=""
  export TORCH_COMPILE_DISABLE=1  # the compile rows run eager: inductor on a CPU takes minutes per row
  SCALE=${GPU_CHECK_DRY_SCALE:-3}
  DIT=DiT-T/2 DITDH=DiTDH-T IMAGE=32 DH_IMAGE=28 LATENTS=16 BATCH=8 DH_BATCH=8 CAP=0 P16=fp32 PBF=fp32
  MAX_STEPS=2 LOG_EVERY=1 SAMPLE_BATCH=2 DPM_STEPS=2 DDPM_STEPS=4
  BENCH=(--model DiT-T/2 --image-size 32 --steps 1 --warmup 0 --threads 1 --device cpu)
  VERIFY=()  # --verify runs a CUDA step: the plan alone here
  VAE=(--tiny-vae) SAMPLE_DEVICE=(--cpu)
  BENCH_SAMPLE=(--preset cpu --batch 2 --solver-steps 2 --threads 1 --device cpu)
else
  SCALE=1
  DIT=DiT-XL/2 DITDH=DiTDH-XL IMAGE=256 DH_IMAGE=224 LATENTS=512 BATCH=256 DH_BATCH=1024
  CAP=23.3  # GiB: what an RTX 3090 (24 GiB) leaves to one process
  P16=fp16 PBF=bf16 MAX_STEPS=8 LOG_EVERY=4 SAMPLE_BATCH=64 DPM_STEPS=20 DDPM_STEPS=250
  BENCH=(--steps 4 --warmup 2)
  VERIFY=(--verify)
  VAE=() SAMPLE_DEVICE=()
  BENCH_SAMPLE=(--preset gpu)
fi
BUDGET=$((${GPU_CHECK_BUDGET:-480} * SCALE))  # seconds for the whole script

part() {  # part NAME SECONDS CMD...: run if it fits what is left, tee to OUT/NAME.txt; OUT/NAME.seconds: START END EXIT
  local name=$1 limit=$(($2 * SCALE))
  shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$limit" -gt "$left" ]; then
    echo "== $name: skipped, its $limit s limit does not fit the $left s left of the $BUDGET s budget" \
      | tee "$out/$name.txt"
    return
  fi
  echo "== $name"
  local start
  start=$(date +%s.%N)
  timeout -k "$GRACE" "$((limit - GRACE))" "$@" 2>&1 | tee "$out/$name.txt"
  local code=${PIPESTATUS[0]}
  echo "$start $(date +%s.%N) $code" >"$out/$name.seconds"
  echo "== $name: exit $code after $(awk '{printf "%.1f", $2 - $1}' "$out/$name.seconds") s$(
    [ "$code" -ge 124 ] && echo " (cut at the $limit s limit)")"
}

part gpu-info 10 bash -c "{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,\
driver_version --format=csv,noheader || echo 'no nvidia-smi'; }; $PY -c \"import torch; print('torch', \
torch.__version__, 'cuda', torch.version.cuda)\""

# 1) today's eager step vs every change (MFU from the known H100/H200/A100/... peaks, train/bench.py)
part step-changes 140 "$PY" -m train.bench --preset changes-gpu --memory-cap-gib 0 "${BENCH[@]}" \
  --json "$out/step-changes.json"

# 2) the 3090 setting as a real training run (global batch 256, micro-batch and checkpointing planned for the cap)
part fixtures-latents 20 "$PY" tests/bench/gpu_fixtures.py "$fx" --what latents --image-size "$IMAGE" \
  --num-latents "$LATENTS"
part train-3090 70 "$PY" tests/bench/capped.py "$CAP" -m train --latents "$fx/latents" --results-dir "$out/run-3090" \
  --model "$DIT" --precision "$P16" --global-batch-size "$BATCH" --max-steps "$MAX_STEPS" --log-every "$LOG_EVERY" \
  --ckpt-every 1000000 --sample-every 0 --keep-last 1 --resume none
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
part plan-verify-3090 40 "$PY" tests/bench/capped.py "$CAP" -m train.plan --model "$DIT" --image-size "$IMAGE" \
  --precision "$P16" --grad-checkpoint --gpu-memory 24GiB --global-batch-size "$BATCH" "${VERIFY[@]}"

# 4) DiTDH-XL (RAE) on 768x16x16 DINOv2-B tokens, flow, bf16, RAE's global batch, under the cap
part plan-verify-ditdh-xl 40 "$PY" tests/bench/capped.py "$CAP" -m train.plan --model "$DITDH" --objective flow \
  --image-size "$DH_IMAGE" --vae-factor 14 --latent-channels 768 --precision "$PBF" --grad-checkpoint \
  --gpu-memory 24GiB --global-batch-size "$DH_BATCH" "${VERIFY[@]}"

# 5) sampling: the time of one batch (two DPM-Solver++ runs of 1 and 2 batches separate the loading time)
part fixtures-weights 30 "$PY" tests/bench/gpu_fixtures.py "$fx" --what dit,vae --model "$DIT" --image-size "$IMAGE" \
  "${VAE[@]}"
sample=(--ckpt "$fx/dit.pt" --model "$DIT" --image-size "$IMAGE" --vae "$fx/vae" --batch-size "$SAMPLE_BATCH"
        --cfg-scale 1.5 --precision "$PBF" --vae-precision "$PBF" "${SAMPLE_DEVICE[@]}")
if [ -f "$fx/dit.pt" ] && [ -d "$fx/vae" ]; then
  part sample-dpm1 25 "$PY" -m sample "${sample[@]}" --num-samples "$SAMPLE_BATCH" --sampler dpmpp-2m \
    --num-sampling-steps "$DPM_STEPS" --out "$out/s-dpm1"
  part sample-dpm2 30 "$PY" -m sample "${sample[@]}" --num-samples $((2 * SAMPLE_BATCH)) --sampler dpmpp-2m \
    --num-sampling-steps "$DPM_STEPS" --out "$out/s-dpm2"
  part sample-ddpm 35 "$PY" -m sample "${sample[@]}" --num-samples "$SAMPLE_BATCH" --sampler ddpm \
    --num-sampling-steps "$DDPM_STEPS" --out "$out/s-ddpm"
  $PY - "$out" "$SAMPLE_BATCH" "$DPM_STEPS" "$DDPM_STEPS" <<'PYEOF' | tee "$out/sample.txt"
import sys
from pathlib import Path
out, n, dpm_steps, ddpm_steps = Path(sys.argv[1]), *map(int, sys.argv[2:])
def seconds(name):
    """Wall-clock seconds of a part that ran and ended with exit 0, else None."""
    stamps = out / f"{name}.seconds"
    start, end, code = stamps.read_text().split() if stamps.is_file() else ("0", "0", "skipped")
    return float(end) - float(start) if code == "0" else None
dpm1, dpm2, ddpm = (seconds(name) for name in ("sample-dpm1", "sample-dpm2", "sample-ddpm"))
if None in (dpm1, dpm2, ddpm):
    sys.exit("sampling: a sampling part failed or was skipped; no images/s")
batch = max(dpm2 - dpm1, 1e-9)  # one batch with DPM-Solver++ (loading cancels out)
load = max(dpm1 - batch, 0.0)   # loading the weights and the VAE, starting CUDA
rate = n / max(ddpm - load, 1e-9)
print(f"sampling, batch {n}, cfg 1.5: DPM-Solver++(2M) {dpm_steps} steps {n / batch:.1f} images/s; DDPM "
      f"{ddpm_steps} steps {rate:.2f} images/s (loading {load:.1f} s subtracted); 50,000 images with DDPM: "
      f"{50000 / rate / 3600:.2f} GPU-hours")
PYEOF
else
  echo "== sampling: skipped, fixtures-weights wrote no weights or VAE (see $out/fixtures-weights.txt)" \
    | tee "$out/sample.txt"
fi

# 6) sampling options side by side (tests/bench/bench_sample.py): eager fp32 vs bf16, decode fp32 vs bf16
part bench-sample 30 "$PY" tests/bench/bench_sample.py "${BENCH_SAMPLE[@]}" --options bf16 --ddpm-steps 0 \
  --json "$out/bench-sample.json"

echo "== done after $SECONDS s of the $BUDGET s budget: outputs in $out"
