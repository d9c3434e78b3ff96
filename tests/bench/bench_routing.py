"""Token routing (TREAD) per-step cost: forward FLOPs counted from the modules and trainer-step seconds, routed vs plain.

Run: .venv/bin/python tests/bench/bench_routing.py [--repeats 7] [--threads 1] [--skip-timing]

FLOPs: torch's FlopCounterMode over a real routed training forward (train/memory.py forward_macs with `kept`), on the
meta device, so XL/2 costs nothing to count. A training step is about 3x its forward (backward 2x). Seconds: the
trainer's own step (train/step.py make_learner + train_step, AdamW, EMA) on synthetic latents, plain and routed
steps interleaved so load drifts hit both alike; median and the spread (min..max) of the timed steps. On a shared
machine the seconds are noisy: read the ratios, and the spread beside them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.network.models import PRESETS  # noqa: E402
from shared.network.routing import PAPER_RATIO, PAPER_START, kept_tokens, paper_end  # noqa: E402

# (label, preset, latent side, batch, route start, route end): the digits demo's model with the recipes bench's
# route and with TREAD's rule, and a 128 px DiT-S/2 with TREAD's route.
TIMED = [("DiT-T/2 digits (8x8 latents, 16 tokens), batch 64, route 2..3", "DiT-T/2", 8, 64, 2, 3),
         ("DiT-T/2 digits, batch 64, TREAD's route 2..depth-4 = 2..2", "DiT-T/2", 8, 64, PAPER_START, paper_end(6)),
         ("DiT-S/2 128 px (16x16 latents, 64 tokens), batch 8, route 2..8", "DiT-S/2", 16, 8, PAPER_START, paper_end(12))]
# (preset, latent side, route start, route end): the digits demo's model, and 256 px (32x32 latents) with TREAD's route.
COUNTED = [("DiT-T/2", 8, 2, 3), ("DiT-S/2", 32, PAPER_START, paper_end(12)), ("DiT-B/2", 32, PAPER_START, paper_end(12)),
           ("DiT-XL/2", 32, PAPER_START, paper_end(28))]


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=PAPER_RATIO, help="share of tokens that skip the route (TREAD 0.5)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per arm and row (after one warm-up step)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    p.add_argument("--skip-timing", action="store_true", help="only the FLOP counts")
    return p.parse_args(argv)


def counted_flops(ratio: float) -> list[str]:
    """Per-image training GFLOPs (3x forward) plain vs routed, counted from the modules on the meta device."""
    from shared.network.models import ModelConfig
    from train.memory import forward_macs

    lines = ["== forward FLOPs counted from the modules (x3 for a training step), per image =="]
    for name, latent, start, end in COUNTED:
        model = ModelConfig(name, latent).build(device="meta")
        plain = forward_macs(model)["total"]
        tokens = model.x_embedder.num_patches
        model.set_routing(start, end)
        routed = forward_macs(model, kept=kept_tokens(tokens, ratio))["total"]
        lines.append(f"{name} on {latent}x{latent} latents ({tokens} tokens), route {start}..{end} of "
                     f"{PRESETS[name]['depth']} blocks, ratio {ratio}: plain {6 * plain / 1e9:.2f} GFLOP, routed "
                     f"{6 * routed / 1e9:.2f} GFLOP, routed/plain {routed / plain:.3f}")
    return lines


def learner_and_batch(name: str, latent: int, batch: int, route: tuple | None):
    """The trainer's Learner (flow objective, fp32, CPU) and one synthetic micro-batch shaped like the loader's."""
    from shared.network.models import ModelConfig
    from train.config import TrainConfig
    from train.memory import synthetic_batch
    from train.step import make_learner

    extra = dict(route_ratio=route[0], route_start=route[1], route_end=route[2]) if route else {}
    cfg = TrainConfig(latents="", results_dir="", model=name, objective="flow", global_batch_size=batch,
                      micro_batch_size=batch, grad_checkpoint=0, precision="fp32", total_steps=10, **extra)
    config = ModelConfig(model=name, input_size=latent, num_classes=10, objective="flow")
    learner = make_learner(cfg, config)
    return learner, synthetic_batch(config, batch, 0.1, objective=learner.objective, route=learner.route)


def timed_rows(ratio: float, repeats: int) -> list[str]:
    """Seconds per trainer step, plain and routed interleaved; median, spread and the ratio of medians."""
    from train.step import train_step

    lines = [f"== seconds per trainer step on the CPU ({torch.get_num_threads()} thread(s)), median (min..max) of "
             f"{repeats}, plain and routed interleaved =="]
    for label, name, latent, batch, start, end in TIMED:
        arms = {"plain": learner_and_batch(name, latent, batch, None),
                "routed": learner_and_batch(name, latent, batch, (ratio, start, end))}
        times = {arm: [] for arm in arms}
        for i in range(repeats + 1):
            for arm, (learner, micro) in arms.items():
                begin = time.perf_counter()
                train_step(learner, [micro])
                if i:  # the first step of each arm allocates the optimizer state
                    times[arm].append(time.perf_counter() - begin)
        plain, routed = (statistics.median(times[a]) for a in ("plain", "routed"))
        spread = {a: f"{min(t) * 1e3:.0f}..{max(t) * 1e3:.0f}" for a, t in times.items()}
        lines.append(f"{label}: plain {plain * 1e3:.0f} ms ({spread['plain']}), routed {routed * 1e3:.0f} ms "
                     f"({spread['routed']}), routed/plain {routed / plain:.3f}")
    return lines


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print("\n".join(counted_flops(args.ratio)))
    if not args.skip_timing:
        print("\n".join(timed_rows(args.ratio, args.repeats)))


if __name__ == "__main__":
    main()
