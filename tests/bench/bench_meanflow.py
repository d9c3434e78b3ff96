"""MeanFlow against sit on the digits yardstick (issue 37, item 5): one training seed per run (--seed).

One training seed each, the recipe benchmark's data and explicit settings (tests/bench/bench_recipes.py: the digits
VAE's latents, DiT-T/2, batch 64, lr 1e-3, warmup 100, EMA 0.995), the same --steps for both:
- sit: --recipe sit, sampled with euler at --sit-steps (10) steps;
- meanflow: --recipe meanflow with its guidance folding off (--cfg-omega 1 --cfg-kappa 0), so both arms are unguided
  and sampled at --cfg-scale 1; sampled with the meanflow sampler at 1 and 2 steps.
- meanflow-ft (--ft-steps): MeanFlow fine-tuned from the sit arm's final export (--init-from).
- imf: --recipe imf (improved MeanFlow, guidance scales 1..8 drawn in training), ONE run sampled with the meanflow
  sampler at 1 and 2 steps at each --imf-scales guidance scale (issue 44): the scale is chosen at sampling.
Printed: the class match of 100 images (the demo's judge), the digits FD of --num-samples images (sampling seed 0)
of each final EMA export, the real-digits floor at that count (evaluate.digits.real_floor), network calls per image, sampling seconds per image (the evaluate run's wall
clock, Inception-free digits features included), the training seconds per step of each run (from its
metrics.jsonl; a shared machine makes these noisy), and the step cost ratio from --timing-steps in-process steps of
train/step.py's train_step per arm on a synthetic batch, interleaved so that load drifts hit both arms.

  .venv/bin/python tests/bench/bench_meanflow.py --out /tmp/bench-meanflow --steps 2000 --ft-steps 1000 --num-samples 300
(docs/objectives.md's table: that, for --seed 0 and 1, one thread each side by side.)
Every stage resumes: a rerun skips the finished extraction, training and evaluations.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_recipes import (ARMS, cumulative_seconds, fixed_flags, prepare_data,  # noqa: E402
                                       read_jsonl, run_cli)

UNGUIDED = ["--cfg-omega", 1.0, "--cfg-kappa", 0.0]  # MeanFlow without guidance folded in: comparable to sit at cfg 1
ARM_FLAGS = {"sit": ARMS["sit"], "meanflow": ["--recipe", "meanflow", *UNGUIDED]}
ARM_FLAGS["meanflow-ft"] = ARM_FLAGS["meanflow"]  # the same objective, started from the sit arm's weights
ARM_FLAGS["imf"] = ["--recipe", "imf"]


def train(args, arm: str, latents: Path, init_from: Path | None = None, steps: int | None = None) -> Path:
    """Train (or resume) one arm for `steps` (--steps), from `init_from`'s weights if given; OUT/runs/ARM-seedS."""
    from shared.runtime import rundir

    steps = steps or args.steps
    run = Path(args.out) / "runs" / f"{arm}-seed{args.seed}"
    if not rundir.export_path(run, steps).is_file():
        flags = ARM_FLAGS[arm] + (["--init-from", init_from] if init_from else [])
        argv = [*flags, *fixed_flags(flags), "--latents", latents, "--results-dir", run, "--max-steps", steps,
                "--ckpt-every", steps, "--keep-last", 1, "--num-workers", 0, "--seed", args.seed,
                "--sample-every", 0, "--log-every", 10, "--report-to", "none"]
        seconds = run_cli(args, "train", argv, f"train-{run.name}.log")
        print(f"trained {run.name} ({steps} steps) in {seconds:.0f}s", flush=True)
    return run


def evaluate(args, run: Path, sampler: str, steps: int, trained: int | None = None, cfg: float = 1.0) -> dict:
    """The export at `trained` (--steps) steps: digits FD with `sampler` at `steps` steps, guidance `cfg`, and its
    seconds."""
    from shared.runtime import rundir

    trained = trained or args.steps

    def row():
        return next((r for r in read_jsonl(rundir.eval_path(run)) if r["sampler"] == sampler and r["step"] == trained
                     and r["num_sampling_steps"] == steps and r["num_samples"] == args.num_samples
                     and r.get("cfg_scale", 1.0) == cfg), None)

    done = row()
    seconds = None
    if done is None:
        argv = ["run", run, "--features", "digits", "--num-samples", args.num_samples, "--sampler", sampler,
                "--num-sampling-steps", steps, "--cfg-scale", cfg, "--seed", 0, "--batch-size", args.num_samples,
                "--vae", args.vae, "--cpu"]
        start = time.perf_counter()
        run_cli(args, "evaluate", argv, f"evaluate-{run.name}.log")
        seconds = time.perf_counter() - start
        done = row()
    return {"fd": done["fid"], "calls_per_image": steps, "cfg_scale": cfg, "eval_seconds": seconds,
            "eval_seconds_per_image": seconds / args.num_samples if seconds else None}


def class_match(args, run: Path, sampler: str, steps: int, count: int = 100, cfg: float = 1.0) -> float:
    """The demo's judge on `count` images (10 per digit, seed 0, guidance `cfg`) of the run's newest export."""
    import numpy as np

    from data.judge import class_match as judged

    out = Path(args.out) / "judge" / (f"{run.name}-{sampler}{steps}" + ("" if cfg == 1 else f"-cfg{cfg:g}"))
    if not (out / "samples.npz").is_file():
        argv = ["--ckpt", run, "--vae", args.vae, "--num-samples", count, "--cfg-scale", cfg, "--sampler", sampler,
                "--num-sampling-steps", steps, "--batch-size", count, "--seed", 0, "--out", out, "--npz"]
        run_cli(args, "sample", argv, f"sample-{out.name}.log")
    with np.load(out / "samples.npz") as npz:
        return judged(npz["arr_0"], npz["labels"])


def seconds_per_step(run: Path) -> float:
    """Training seconds per step over the whole run (its metrics.jsonl)."""
    from shared.runtime import rundir

    seconds = cumulative_seconds(read_jsonl(rundir.metrics_path(run)))
    last = max(seconds)
    return seconds[last] / last


def interleaved_step_seconds(arms: dict, steps: int, batch: int = 64) -> dict:
    """Median seconds of train/step.py's train_step per arm on one synthetic batch of the digits shape (4x8x8 latents,
    DiT-T/2, 10 classes), the arms' steps interleaved (sit, meanflow, ..., sit, ...) so machine load drifts hit all."""
    from shared.runtime.cli import given_flags
    from train.config import build_parser, config_from_args, model_config_for, resolve_block
    from train.memory import synthetic_batch
    from train.step import make_learner, train_step

    learners = {}
    for arm, flags in arms.items():
        parser, argv = build_parser(), [str(a) for a in [*flags, "--latents", "x", "--results-dir", "x"]]
        cfg = resolve_block(config_from_args(parser.parse_args(argv), given_flags(parser, argv)))
        cfg.global_batch_size = cfg.micro_batch_size = batch  # the CPU's resolved "auto"s: one micro-batch, fp32,
        cfg.grad_accum_steps, cfg.precision, cfg.grad_checkpoint = 1, "fp32", 0  # no checkpointing
        config = model_config_for(cfg, (4, 8, 8), 10)
        learner = make_learner(cfg, config)
        learners[arm] = (learner, synthetic_batch(config, batch, cfg.class_dropout_prob, learner.objective))
    times = {arm: [] for arm in arms}
    for i in range(steps + 2):  # two warm-up steps each
        for arm, (learner, data) in learners.items():
            start = time.perf_counter()
            train_step(learner, [data])
            if i >= 2:
                times[arm].append(time.perf_counter() - start)
    return {arm: sorted(t)[len(t) // 2] for arm, t in times.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/bench-meanflow", help="folder for the latents, runs, logs and results")
    p.add_argument("--steps", type=int, default=400, help="training steps of each arm")
    p.add_argument("--seed", type=int, default=0, help="training seed")
    p.add_argument("--num-samples", type=int, default=500, help="images per FD")
    p.add_argument("--sit-steps", type=int, default=10, help="euler steps of the sit arm")
    p.add_argument("--vae", default=str(ROOT / "data" / "vae-digits"), help="the digits VAE (the demo's)")
    p.add_argument("--timing-steps", type=int, default=10, help="interleaved in-process steps per arm for the cost ratio")
    p.add_argument("--ft-steps", type=int, default=0, help="also fine-tune MeanFlow from the sit arm's final export "
                                                          "for this many steps (0: no fine-tuned arm)")
    p.add_argument("--arms", default="sit,meanflow,imf", help="comma-separated arms to train and score: sit, "
                                                               "meanflow, imf")
    p.add_argument("--imf-scales", default="1,1.5,2.5", help="guidance scales the imf run is sampled at")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    args = p.parse_args(argv)
    args.recipes, args.report = ["sit"], False  # what bench_recipes' prepare_data and run_cli read
    arms = args.arms.split(",")
    latents = prepare_data(args)
    runs = {arm: train(args, arm, latents) for arm in arms}
    from evaluate.digits import real_floor

    rows = [{"arm": "sit", "sampler": "euler", **evaluate(args, runs["sit"], "euler", args.sit_steps)}] \
        if "sit" in runs else []
    rows += [{"arm": "meanflow", "sampler": "meanflow", **evaluate(args, runs["meanflow"], "meanflow", k)}
             for k in (1, 2) if "meanflow" in runs]
    rows += [{"arm": "imf", "sampler": "meanflow", **evaluate(args, runs["imf"], "meanflow", k, cfg=float(w))}
             for k in (1, 2) for w in args.imf_scales.split(",") if "imf" in runs]
    if args.ft_steps:  # MeanFlow fine-tuned from the sit arm's final export (issue 37.2), unguided as the others
        runs["meanflow-ft"] = train(args, "meanflow-ft", latents, init_from=runs["sit"], steps=args.ft_steps)
        rows += [{"arm": "meanflow-ft", "sampler": "meanflow",
                  **evaluate(args, runs["meanflow-ft"], "meanflow", k, trained=args.ft_steps)} for k in (1, 2)]
    for r in rows:
        r["class_match"] = class_match(args, runs[r["arm"]], r["sampler"], r["calls_per_image"], cfg=r["cfg_scale"])
    timing = {arm: seconds_per_step(run) for arm, run in runs.items()}
    timed = {"sit": ARM_FLAGS["sit"], "meanflow": ARM_FLAGS["meanflow"], "meanflow-guided": ["--recipe", "meanflow"],
             "imf": ARM_FLAGS["imf"]}  # the recipe's folded guidance: + one 2N forward; imf: + a 2N forward always
    step = interleaved_step_seconds({arm: [*flags, *fixed_flags(flags)] for arm, flags in timed.items()},
                                    args.timing_steps)
    results = {"steps": args.steps, "ft_steps": args.ft_steps, "seed": args.seed, "num_samples": args.num_samples,
               "real_floor": real_floor(args.num_samples), "rows": rows, "run_seconds_per_step": timing,
               "interleaved_seconds_per_step": step,
               "step_cost_ratio_meanflow_to_sit": step["meanflow"] / step["sit"],
               "step_cost_ratio_guided_meanflow_to_sit": step["meanflow-guided"] / step["sit"],
               "step_cost_ratio_imf_to_sit": step["imf"] / step["sit"]}
    print(f"digits FD at {args.num_samples} images, {args.steps} training steps, seed {args.seed} "
          f"(real-digits floor {results['real_floor']:.2f}):")
    for r in rows:
        per = f"{r['eval_seconds_per_image'] * 1e3:.1f} ms" if r["eval_seconds_per_image"] else "(earlier run)"
        print(f"  {r['arm']:9s} {r['sampler']:8s} {r['calls_per_image']:2d} calls/image  cfg {r['cfg_scale']:g}  "
              f"FD {r['fd']:.2f}  "
              f"evaluate wall clock {per}/image  class match {100 * r['class_match']:.0f}% of 100")
    print("training seconds per step over each run: " + ", ".join(f"{arm} {t:.3f}" for arm, t in timing.items()))
    print(f"train_step, {args.timing_steps} interleaved steps each (median): sit {step['sit']:.3f} s, meanflow "
          f"{step['meanflow']:.3f} s (ratio {results['step_cost_ratio_meanflow_to_sit']:.2f}), meanflow with the "
          f"recipe's folded guidance {step['meanflow-guided']:.3f} s (ratio "
          f"{results['step_cost_ratio_guided_meanflow_to_sit']:.2f}), imf {step['imf']:.3f} s (ratio "
          f"{results['step_cost_ratio_imf_to_sit']:.2f}); the noise: the ratios of two seeds' runs side by side")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
