"""REPA on the CPU: training step cost with vs without alignment, extraction cost with the encoder, and digits FD
against steps and wall-clock with vs without REPA (same seeds, seed noise floor printed).

Run: .venv/bin/python tests/bench/bench_repa.py [--out bench-repa] [--steps 600] [--skip-digits]

The encoder for the digits is `python -m data.make_encoder`: a tiny DINOv2-architecture ViT fitted to the digits,
NOT the digits FD network (evaluate/digits.py's CNN); see that module for the choice. Both arms train the demo's
DiT-T/2 with the flow objective (SiT, which REPA builds on) from the same seed on the same latent folder; the REPA
arm adds --repa-weight 0.5 at --repa-depth 2 of 6 (REPA: 8 of 28, about a third of the way in). Every stage runs
as a real subprocess of the real CLI. Timings on a shared machine are noisy: read the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.datasets.digits import build_digits  # noqa: E402
from data.make_vae import DEFAULT_OUT as VAE_DIR  # noqa: E402


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-repa"), help="work folder (kept: rerun resumes)")
    p.add_argument("--steps", type=int, default=600, help="training steps per digits arm")
    p.add_argument("--batch", type=int, default=64, help="global batch of the digits arms (the demo's: 64)")
    p.add_argument("--fd-steps", type=int, default=20, help="Euler sampling steps per FD sample")
    p.add_argument("--projector-dim", type=int, default=256,
                   help="REPA projector width P of the digits arm (REPA's 2048 would double DiT-T/2's step)")
    p.add_argument("--exports", type=int, default=4, help="EMA exports (FD points) per arm")
    p.add_argument("--fd-samples", type=int, default=200, help="samples per FD point")
    p.add_argument("--step-repeats", type=int, default=5, help="timed steps per step-cost setting (median kept)")
    p.add_argument("--extract-limit", type=int, default=500, help="images for the extraction-cost comparison")
    p.add_argument("--skip-digits", action="store_true", help="only the step and extraction costs")
    p.add_argument("--only-digits", action="store_true", help="only the digits FD comparison")
    return p.parse_args(argv)


def run(args: list, log: Path | None = None) -> tuple[float, str]:
    """Run `python ARGS` from the repository root; (seconds, stdout+stderr); fails loudly."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(map(str, args))}\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------------
# Training step cost (in process: the same Learner and train_step as python -m train)
# ---------------------------------------------------------------------------------------------------------

def step_seconds(model: str, latent: int, batch: int, features: tuple | None, depth: int, repeats: int) -> float:
    """Median seconds of one train_step of `model` on latents (4, latent, latent), with REPA when features=(T, E)."""
    from shared.network.models import ModelConfig
    from train.config import TrainConfig
    from train.memory import synthetic_batch
    from train.step import make_learner, train_step

    cfg = TrainConfig(latents="", results_dir="", model=model, objective="flow", global_batch_size=batch,
                      micro_batch_size=batch, total_steps=10,
                      column_options={"repa_weight": 0.5 if features else 0.0, "repa_depth": depth,
                                      "repa_feature_dim": features[1] if features else None})
    config = ModelConfig(model=model, input_size=latent, objective="flow")
    learner = make_learner(cfg, config)
    micro = synthetic_batch(config, batch, 0.1, objective=learner.objective,
                            extra={"repr": features} if features else None)
    train_step(learner, [micro])  # warm-up (allocations, optimizer state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_step(learner, [micro])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_cost(args) -> None:
    """Print step time with and without REPA at two sizes, and the projector's share of multiply-accumulates."""
    print("\n== training step cost, REPA on vs off (CPU, fp32, median of "
          f"{args.step_repeats}; features already in memory: reading them is bench_reader's) ==")
    rows = [("DiT-T/2 digits: 8x8 latents, 16 tokens, E 64, P 2048, batch 64", "DiT-T/2", 8, 64, (16, 64), 2),
            ("DiT-S/2 128 px: 16x16 latents, 64 tokens, E 768 (DINOv2-B), P 2048, batch 4", "DiT-S/2", 16, 4,
             (64, 768), 4)]  # the projector's share is per token: 128 px keeps the CPU time down
    for label, model, latent, batch, features, depth in rows:
        off = step_seconds(model, latent, batch, None, depth, args.step_repeats)
        on = step_seconds(model, latent, batch, features, depth, args.step_repeats)
        print(f"{label}: off {off * 1000:.0f} ms, on {on * 1000:.0f} ms, ratio {on / off:.3f}")
    # The projector's forward MACs per token (D*P + P*P + P*E) against the DiT's (FACTS.md: XL/2 118.6 GMAC / 256).
    for name, width, gmac in (("DiT-S/2", 384, 6.06), ("DiT-B/2", 768, 23.0), ("DiT-XL/2", 1152, 118.6)):
        proj = width * 2048 + 2048 * 2048 + 2048 * 768
        print(f"computed: {name} projector {proj / 1e6:.2f} M MAC/token vs the DiT's {gmac * 1e3 / 256:.1f} M: "
              f"+{100 * proj / (gmac * 1e9 / 256):.1f}% per step")


# ---------------------------------------------------------------------------------------------------------
# Extraction cost and the digits arms
# ---------------------------------------------------------------------------------------------------------

def extract_args(images: Path, out: Path, encoder: Path | None, limit: int | None) -> list:
    """The demo's extract flags (committed digits VAE, 32 px, no flips), optionally with the encoder."""
    extra = ["--repr-encoder", encoder, "--repr-image-size", 32] if encoder else []
    cap = ["--limit", limit] if limit else []
    return ["-m", "extract", "--data-path", images, "--out", out, "--vae", VAE_DIR, "--image-size", 32,
            "--flip", "none", "--batch-size", 256, "--num-workers", 0, *extra, *cap]


def encoded_rate(output: str) -> float:
    """Images per second from extract's summary line."""
    return float(re.search(r"\(([\d.]+) images/s", output).group(1))


def extraction_cost(args, images: Path, encoder: Path) -> None:
    """Extract the same images with and without the encoder; print both rates and the ratio."""
    print(f"\n== extraction cost: {args.extract_limit} digits, VAE only vs VAE + encoder ==")
    rates = {}
    for name, enc in (("vae", None), ("vae+encoder", encoder)):
        out = args.out / f"extract-cost-{name}"
        shutil.rmtree(out, ignore_errors=True)
        _, text = run(extract_args(images, out, enc, args.extract_limit))
        rates[name] = encoded_rate(text)
        print(f"{name}: {rates[name]:.1f} images/s")
    print(f"ratio (time with encoder / without): {rates['vae'] / rates['vae+encoder']:.2f}")


def train_arm(args, latents: Path, run_dir: Path, repa: bool) -> list:
    """The command line of one arm (a rerun resumes it)."""
    every = max(args.steps // args.exports, 1)
    flags = ["-m", "train", "--model", "DiT-T/2", "--latents", latents, "--results-dir", run_dir, "--objective",
             "flow", "--global-batch-size", args.batch, "--lr", 1e-3, "--warmup-steps", 50, "--ema-decay", 0.995,
             "--max-steps", args.steps, "--ckpt-every", every, "--keep-last", 1, "--keep-exports", 0,
             "--log-every", every, "--num-workers", 0, "--seed", 0, "--sample-every", 0, "--report-to", "none"]
    if repa:
        flags += ["--repa-weight", 0.5, "--repa-depth", 2, "--repa-projector-dim", args.projector_dim]
    return flags


def parallel(commands: list[list]) -> list[float]:
    """Run the commands side by side (each its own process), wait for all; seconds each; fails loudly."""
    logs = [Path(tempfile.mkstemp(prefix="bench-repa-", suffix=".log")[1]) for _ in commands]
    # Output goes to files, not pipes: a child outlives an interrupted benchmark instead of dying on a broken pipe.
    procs = [(time.perf_counter(), subprocess.Popen([sys.executable, *map(str, c)], cwd=ROOT, stdout=log.open("w"),
                                                    stderr=subprocess.STDOUT)) for c, log in zip(commands, logs)]
    seconds = []
    for (start, proc), command, log in zip(procs, commands, logs):
        proc.wait()
        seconds.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(map(str, command))}\n{log.read_text()[-3000:]}")
        log.unlink()
    return seconds


def evaluate_command(args, run_dir: Path, seed: int = 0) -> list:
    """python -m evaluate run: digits FD of every export of run_dir."""
    return ["-m", "evaluate", "run", run_dir, "--features", "digits", "--num-samples", args.fd_samples, "--vae",
            VAE_DIR, "--sampler", "euler", "--num-sampling-steps", args.fd_steps, "--cfg-scale", 1.0, "--seed", seed,
            "--batch-size", 100, "--cpu"]


def evaluate_arm(args, run_dir: Path, seed: int = 0, ran: bool = False) -> list[dict]:
    """Rows of run_dir/eval.jsonl with this seed (evaluated first unless `ran`)."""
    if not ran:
        run(evaluate_command(args, run_dir, seed))
    rows = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("seed", r.get("settings", {}).get("seed")) == seed] or rows


def fd_of(row: dict) -> float:
    """The digits FD of an eval.jsonl row."""
    return float(row.get("fid", row.get("digits_fd", float("nan"))))


def noise_floor(args, run_dir: Path, seed0: float) -> list[float]:
    """FD of the final export with sampling seeds 0 (given), 1 and 2: the spread a difference must exceed."""
    final = sorted((run_dir / "exports").iterdir())[-1]
    floors = {seed: args.out / f"floor-{run_dir.name}-seed{seed}" for seed in (1, 2)}
    for floor in floors.values():
        (floor / "exports").mkdir(parents=True, exist_ok=True)
        shutil.copy2(final, floor / "exports" / final.name)
    parallel([evaluate_command(args, floor, seed) for seed, floor in floors.items()])
    return [seed0] + [fd_of(evaluate_arm(args, floor, seed, ran=True)[-1]) for seed, floor in floors.items()]


def digits(args, images: Path, encoder: Path) -> None:
    """Train both arms, evaluate their exports, print FD against steps and wall-clock side by side."""
    latents = args.out / "latents"
    if not (latents / "index.json").exists():
        run(extract_args(images, latents, encoder, None))
    names = {"flow": False, "flow+repa": True}
    dirs = {name: args.out / f"run-{name}" for name in names}
    # Both arms side by side (two processes: on a shared machine each gets its share; the ratio stays fair).
    seconds = parallel([train_arm(args, latents, dirs[n], repa) for n, repa in names.items()])
    parallel([evaluate_command(args, dirs[n]) for n in names])
    arms = {n: (sec, {int(r["step"]): fd_of(r) for r in evaluate_arm(args, dirs[n], ran=True)})
            for n, sec in zip(names, seconds)}
    print(f"\n== digits FD ({args.fd_samples} samples, Euler {args.fd_steps} steps, no guidance) vs training steps, "
          f"batch {args.batch}, same seeds ==")
    steps = sorted(set().union(*(fd.keys() for _, fd in arms.values())))
    print("step    " + "".join(f"{name:>14}" for name in arms))
    for step in steps:
        print(f"{step:<8}" + "".join(f"{fd.get(step, float('nan')):>14.1f}" for _, fd in arms.values()))
    for name, (seconds, fd) in arms.items():
        print(f"{name}: {args.steps} steps in {seconds:.0f} s of training subprocess (incl. checkpoints, exports; "
              f"both arms ran side by side)")
    base = arms["flow"][1][max(arms["flow"][1])]
    reached = [s for s, v in sorted(arms["flow+repa"][1].items()) if v <= base]
    print(f"flow's final FD {base:.1f}: flow+repa reaches it at step "
          f"{reached[0] if reached else 'never (within this budget)'}")
    fd = arms["flow"][1]
    values = noise_floor(args, args.out / "run-flow", fd[max(fd)])  # one arm: the machine is shared
    print(f"noise floor, flow's final export, sampling seeds 0/1/2: "
          f"{', '.join(f'{v:.1f}' for v in values)} (spread {max(values) - min(values):.1f})")


def main(argv=None) -> None:
    """Run the comparisons and print them."""
    args = parse_args(argv)
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    print("note: measured on a CPU shared with other work; timings are noisy, compare the ratios")
    images = args.out / "images"
    if not images.exists():
        build_digits(images, progress=False)
    encoder = args.out / "encoder-digits"
    if not (encoder / "config.json").exists():
        run(["-m", "data.make_encoder", "--out", encoder])
    if not args.skip_digits:
        digits(args, images, encoder)
    if not args.only_digits:
        extraction_cost(args, images, encoder)
        step_cost(args)


if __name__ == "__main__":
    main()
