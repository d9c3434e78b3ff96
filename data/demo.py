"""`python -m data.demo [--out demo-out] [--quick]`: the whole pipeline on handwritten digits, on the CPU.

digits ImageFolder -> extract (the committed tiny VAE, no flips) -> train (DiT-T/2, sit recipe) -> sample -> a judge's
class match and the digits FD -> `evaluate run` over the EMA exports. Every stage runs as a subprocess of the real CLI;
rerunning the same command resumes.
"""
from shared.runtime.interrupt import EXIT_STATUS, QUIET_ENV, guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.datasets.digits import IMAGE_SIZE, NUM_CLASSES, build_digits
from data.make_vae import DEFAULT_OUT as VAE_DIR
from shared.runtime import rundir
from shared.runtime.errors import UserError, exit_with

PROG = "python -m data.demo"
ROOT = Path(__file__).resolve().parents[1]  # the repository: stages run as `python -m <stage>` from here


@dataclass(frozen=True)
class Recipe:
    """The knobs of one demo mode: training length and sampling effort."""
    name: str
    train_steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    ema_decay: float
    per_class: int        # samples per class: one grid row of this many images per digit
    cfg_scale: float
    sampling_steps: int   # steps of `sampler`
    # The training recipe (train/recipes.py). sit (flow matching) won the issue-27 benchmark at the demo's budget:
    # digits FD 35.0 against dit's 434.9 at step 1000, 42.3 against 97.3 at step 2000 (docs/recipes.md).
    train_recipe: str = "sit"
    sampler: str = "sde"         # the flow objective's own sampler (SiT's, for its FID); 1 network call per step
    guide_channels: str = "all"  # the DiT release guides 3 of 4 channels; all 4 lift class match (cfg 4: 97% -> 100%)
    curve_per_class: int = 3     # samples per class and EMA export for the quality curve (python -m evaluate run)
    curve_sampler: str = "euler"  # deterministic, so successive exports are drawn from the same noise path
    curve_steps: int = 10        # its steps: the curve costs about a third of the sample stage


# Measured on a quiet 2-core CPU machine (docs/demo.md): 5 minutes, class match 100% at cfg 1.5 with
# digits FD 59.6 at N = 100, on the real digits' floor (the dit recipe needed cfg 4 for 100%, at FD 330).
# lr 1e-3 (10x DiT's) and a short EMA suit a 4M-parameter model trained for minutes rather than days.
FULL = Recipe("full", train_steps=2000, batch_size=64, lr=1e-3, warmup_steps=100, ema_decay=0.995,
              per_class=10, cfg_scale=1.5, sampling_steps=50)
# Smoke run for tests: every stage end to end, no quality expected.
QUICK = Recipe("quick", train_steps=20, batch_size=32, lr=1e-3, warmup_steps=5, ema_decay=0.9,
               per_class=2, cfg_scale=1.5, sampling_steps=5, curve_per_class=1, curve_steps=2)


def stage_dirs(out: Path, recipe: Recipe) -> dict:
    """Folders of each stage; the quick mode trains and samples in its own folders so the two never clash."""
    suffix = "" if recipe is FULL else f"-{recipe.name}"
    return {"images": out / "images", "latents": out / "latents", "run": out / f"run{suffix}",
            "samples": out / f"samples{suffix}"}


def run_stage(name: str, args: list) -> float:
    """Run `python -m <name> args...` from the repository root with its output on screen; return seconds."""
    cmd = [sys.executable, "-m", name, *map(str, args)]
    print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    # Its own process group: a Ctrl-C is passed on to it and waited for.
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, QUIET_ENV: "1"}, start_new_session=True)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):  # it may have ended in between
            os.killpg(proc.pid, signal.SIGINT)  # its group: its DataLoader workers and watcher too, as a terminal does
        proc.wait()
        raise
    if rc == EXIT_STATUS:  # the stage alone was interrupted: the demo stops the same way
        raise KeyboardInterrupt
    if rc != 0:
        raise UserError(
            f"The {name} stage failed with exit status {rc} (its message is printed above). Fix what it says "
            f"and rerun the same command: finished stages are resumed, not redone; or pass a new --out.")
    return time.time() - start


def extract_args(dirs: dict) -> list:
    """Flags of the extract stage: the committed digits VAE at 32x32, originals only."""
    return ["--data-path", dirs["images"], "--out", dirs["latents"], "--vae", VAE_DIR,
            "--image-size", IMAGE_SIZE, "--flip", "none", "--batch-size", 256, "--num-workers", 0]


def train_args(dirs: dict, recipe: Recipe, seed: int) -> list:
    """Flags of the train stage: DiT-T/2 on the CPU, checkpoints, EMA export, previews decoded beside it."""
    return ["--model", "DiT-T/2", "--recipe", recipe.train_recipe, "--latents", dirs["latents"],
            "--results-dir", dirs["run"], "--global-batch-size", recipe.batch_size, "--lr", recipe.lr,
            "--warmup-steps", recipe.warmup_steps, "--ema-decay", recipe.ema_decay, "--max-steps", recipe.train_steps,
            "--ckpt-every", max(recipe.train_steps // 4, 1), "--keep-last", 1,
            "--log-every", max(recipe.train_steps // 20, 1), "--num-workers", 0, "--seed", seed,
            "--sample-every", max(recipe.train_steps // 4, 1), "--sample-steps", recipe.sampling_steps,
            "--watch-vae", VAE_DIR]  # the watcher process decodes each preview into run/samples/step-*.png


def sample_args(dirs: dict, recipe: Recipe, seed: int) -> list:
    """Flags of the sample stage: per_class images of every digit (label i = i % 10), guided."""
    return ["--ckpt", dirs["run"], "--vae", VAE_DIR, "--num-samples", recipe.per_class * NUM_CLASSES,
            "--cfg-scale", recipe.cfg_scale, "--guide-channels", recipe.guide_channels,
            "--sampler", recipe.sampler, "--num-sampling-steps", recipe.sampling_steps,
            "--batch-size", recipe.per_class * NUM_CLASSES, "--seed", seed, "--out", dirs["samples"], "--npz"]


def curve_args(dirs: dict, recipe: Recipe, seed: int) -> list:
    """Flags of `python -m evaluate run`: the digits distance of every EMA export, a few samples each."""
    count = recipe.curve_per_class * NUM_CLASSES
    return ["run", dirs["run"], "--features", "digits", "--num-samples", count, "--vae", VAE_DIR,
            "--sampler", recipe.curve_sampler, "--num-sampling-steps", recipe.curve_steps,
            "--cfg-scale", recipe.cfg_scale, "--guide-channels", recipe.guide_channels, "--batch-size", count,
            "--seed", seed, "--cpu"]


def digits_distance(samples_dir: Path) -> tuple[float, float]:
    """Digits Fréchet distance of samples.npz and of as many real digits (the floor at that count)."""
    from evaluate.digits import digits_fd, real_floor
    with np.load(samples_dir / "samples.npz") as npz:
        images = npz["arr_0"]
    return digits_fd(images), real_floor(len(images))


def curve_png(run: Path) -> Path:
    """The quality-curve PNG that `python -m evaluate run` draws in the run folder."""
    from shared.runtime.rundir import eval_plot_path
    return eval_plot_path(run).resolve()


def run_demo(out: Path, recipe: Recipe, seed: int) -> None:
    """Build the data, run the three stages, judge the samples and print the summary lines."""
    from data.judge import class_match
    start = time.time()
    dirs = stage_dirs(out, recipe)
    print(f"== digits: writing the ImageFolder to {dirs['images']}", flush=True)
    build_digits(dirs["images"])
    times = {"extract": run_stage("extract", extract_args(dirs)),
             "train": run_stage("train", train_args(dirs, recipe, seed)),
             "sample": run_stage("sample", sample_args(dirs, recipe, seed)),
             "evaluate": run_stage("evaluate", curve_args(dirs, recipe, seed)),
             "curves": run_stage("train.plot", [dirs["run"]])}  # redrawn: training's last one had no eval.jsonl yet
    with np.load(dirs["samples"] / "samples.npz") as npz:  # arr_0 uint8 N x H x W x 3, labels
        images, labels = npz["arr_0"], npz["labels"]
    match, count = class_match(images, labels), len(labels)
    distance, floor = digits_distance(dirs["samples"])
    spent = ", ".join(f"{name} {secs:.0f}s" for name, secs in times.items())
    print(f"\n== done in {time.time() - start:.0f}s ({spent})")
    print(f"grid: {(dirs['samples'] / 'grid.png').resolve()}")
    previews = sorted((dirs["run"] / rundir.SAMPLES).glob("step-*.png"))  # labelled grids by the watcher
    print(f"preview grid: {previews[-1].resolve() if previews else 'none decoded (see run/watch.log)'}")
    print(f"curves: {rundir.curves_path(dirs['run']).resolve()}")
    print(f"class match: {100 * match:.1f}% ({count} images, cfg {recipe.cfg_scale:g})")
    print(f"digits FD: {distance:.1f} (real digits, {count} of them: {floor:.1f}; lower is better)")
    print(f"quality curve: {curve_png(dirs['run'])}")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("demo-out"),
                   help="folder for the images, latents, training run and samples (default: demo-out)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK.train_steps} training steps and {QUICK.sampling_steps} sampling "
                        f"steps (about 1-2 minutes; the class match means nothing)")
    p.add_argument("--seed", type=int, default=0, help="seed of training and sampling")
    return p.parse_args(argv)


@interruptible(PROG)
def main(argv=None) -> None:
    """Entry point: run the demo; a stage failure or bad flag becomes one clear paragraph."""
    args = parse_args(argv)
    try:
        if not VAE_DIR.joinpath("config.json").is_file():
            raise UserError(f"The demo's VAE is missing from {VAE_DIR}: recreate it with `python -m data.make_vae`.")
        run_demo(args.out.resolve(), QUICK if args.quick else FULL, args.seed)
    except UserError as err:
        exit_with(err, PROG)


if __name__ == "__main__":
    main(sys.argv[1:])
