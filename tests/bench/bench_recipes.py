"""Time to quality of the training recipes and options on the digits yardstick (issues 19, 27).

Arms (ARMS): dit, sit, lightning (the --recipe presets), sit-repa (sit + REPA with the digits encoder), sit-route
(sit + token routing, TREAD), combined (the flags of the --combine arms together; default sit-repa + sit-route) and
sit-rae (issue 26: the sit recipe on the digits RAE's tokens, `python -m data.make_rae`, with DiT-T/1, against sit on
the digits VAE's latents).

Run (the full budget: 4,000+ steps per run, hours, alone on a quiet machine):
  .venv/bin/python tests/bench/bench_recipes.py --out /tmp/bench-recipes --steps 4000 --every 500 \
      --timing-steps 30 --solvers --plot docs/recipes.png --json /tmp/bench-recipes/results.json
Smoke run (minutes): add --steps 40 --every 20 --seeds 0 --num-samples 100 --num-sampling-steps 4.

1. Data: the digits ImageFolder (shared.datasets.digits.build_digits), the digits encoder (`python -m
   data.make_encoder`) and `python -m extract` with the committed digits VAE, exactly as the demo does
   (data.demo.extract_args) plus the encoder's tokens (--repr-encoder), into OUT/latents once. Every arm trains on
   this folder but sit-rae; only the REPA arms read the tokens. sit-rae: the same images extracted once with the
   digits RAE (--rae, an AutoencoderRAE folder) into OUT/latents-rae; its samples are decoded by the RAE, so its
   digits FD is measured on images, as the others'.
2. Training: `python -m train` with each arm's flags for every seed, DiT-T/2 with the demo's explicit settings
   (batch 64, lr 1e-3, warmup 100, EMA 0.995) given to every arm. Explicit flags win over a recipe, so the lr
   is the same for all (lightning's own 2e-4 is for batch 1024): what differs is each recipe's objective (DDPM or
   flow), time sampling (uniform or logit-normal), cosine loss, block (DiT or RMSNorm+SwiGLU+RoPE), AdamW betas,
   and the options: REPA (weight 0.5 at depth 2 of 6, REPA's 8 of 28 scaled; projector 256 wide) and routing
   (half the tokens skip blocks 2..3 of 6: TREAD's B/2 route 2..8 of 12 scaled to six blocks, two full blocks
   after it, and REPA's depth 2 before it). An EMA export is written every --every steps.
3. Seconds: the training loop's wall clock up to each export, summed from the run's metrics.jsonl (every logged
   window lasted steps / steps_per_s seconds). It counts the steps and the checkpoint writes, not process start-up
   or model building, and stays right across a resumed run (metrics are truncated to the resumed step).
   --timing-steps K: a separate short run of K logged steps per arm (OUT/timing) for seconds per step with their
   spread (median, min..max over the steps, the first two and the last left out); run it alone on the machine.
4. Evaluation: `python -m evaluate run` on every export at each --cfg-scales, the same sampling seed for all: the
   digits Fréchet distance (evaluate/digits.py, lower is better) of --num-samples images drawn with the
   objective's fast deterministic sampler (ddim for ddpm, euler for flow) in --num-sampling-steps steps.
5. Noise floor: each arm's final export of the first seed drawn again with --floor-seed (a folder holding only
   that export, so one evaluation): |FD(seed) - FD(floor seed)| is the sampling noise of one point. The real floor
   is N real digits against all of them (evaluate.digits.real_floor), what a perfect model scores at N. The verdict
   (`verdicts`) calls an arm better or worse than dit only when the gap of their final mean FDs exceeds the noise
   floor: the largest of the sampling gap and the training-seed spread (max - min) of either arm's final FD.
6. Guidance interval (Kynkaenniemi et al. 2024): the final export of --interval-recipes' first seed at
   --interval-cfg with and without --cfg-interval (--ddpm-interval in DiT timesteps, --flow-interval in flow noise
   level), with the network rows per image: counted by running the sampler's own loop with a zero network
   through shared.generative.guidance's GuidedModelFn (a guided step costs 2 rows, one outside the interval 1).
7. Tables: FD per export step with its seconds, per arm (mean over seeds and each seed); the first step and
   second at which each arm's mean FD reaches the dit recipe's final mean FD (linear interpolation between the
   two exports around the crossing; an export already at or below the target counts as reaching it there), with
   the ratios dit / arm (> 1: the arm is faster); each arm's seconds per step. Timings on a shared machine are
   noisy: they are printed, never asserted.
8. --solvers: the samplers on the same trained models, first seed's final exports: the flow samplers (euler,
   heun, sde, dopri5) at several step counts on the sit model, DDPM-250 and DPM-Solver++(2M) on the dit model,
   each at --solver-cfg with --solver-samples images; network rows per image counted on the real model (dopri5
   is adaptive); and the fewest rows at which each sampler reaches the FD of DDPM-250 on the dit model.
Every stage resumes: rerunning skips finished extraction, training, evaluated exports and drawn sample folders.
Runs go seed-major (every arm's first seed, then the second seeds), and --report prints the tables from what has
finished so far without starting anything, so a run stopped part-way still reports every finished arm.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RECIPE_NAMES = ("dit", "sit", "lightning")
REPA = ["--repa-weight", 0.5, "--repa-depth", 2, "--repa-projector-dim", 256]  # bench_repa's digits arm
ROUTE = ["--route-ratio", 0.5, "--route-start", 2, "--route-end", 3]  # half the tokens skip blocks 2..3 of 6
# The digits RAE's 4x4x64 tokens at patch 1: 16 tokens of 64 values, as DiT-T/2 sees 16 tokens of 2x2x4 = 16 values
# of the VAE's 8x8x4 latents, with the same width (192 >= 64: no DiT^DH head needed) and blocks.
RAE_MODEL = "DiT-T/1"
ARMS = {"dit": ["--recipe", "dit"], "sit": ["--recipe", "sit"], "lightning": ["--recipe", "lightning"],
        "sit-repa": ["--recipe", "sit", *REPA], "sit-route": ["--recipe", "sit", *ROUTE],
        "sit-rae": ["--recipe", "sit", "--model", RAE_MODEL]}
OWN_LATENTS = {"sit-rae": "latents-rae"}  # arms on another tokenizer's latents (OUT/<folder>); the rest: OUT/latents
ARM_NAMES = (*ARMS, "combined")
DEMO_TRAIN = {"--model": "DiT-T/2", "--global-batch-size": 64, "--lr": 1e-3, "--warmup-steps": 100,
              "--ema-decay": 0.995}  # data/demo.py's FULL recipe, given explicitly so every recipe trains alike
LOG_EVERY = 50


# ---------------------------------------------------------------------------------------------------------
# Pure helpers (tested in tests/test_bench_recipes.py)
# ---------------------------------------------------------------------------------------------------------

def cumulative_seconds(metrics: list[dict]) -> dict[int, float]:
    """Step -> training seconds up to it, from metrics.jsonl rows (each window: its steps / steps_per_s)."""
    out, last_step, total = {}, 0, 0.0
    for row in sorted(metrics, key=lambda r: r["step"]):
        steps = row["step"] - last_step
        if steps <= 0 or not row.get("steps_per_s"):
            continue
        total += steps / row["steps_per_s"]
        out[row["step"]] = total
        last_step = row["step"]
    return out


def seconds_at(seconds: dict[int, float], step: float) -> float | None:
    """Training seconds at a (fractional) step, linearly interpolated between logged steps; None past the end."""
    points = sorted([(0, 0.0)] + list(seconds.items()))
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return None


def mean_curve(curves: list[list[float]]) -> list[float]:
    """Pointwise mean of equally long curves (one per seed)."""
    return [sum(values) / len(values) for values in zip(*curves)]


def first_reach(steps: list[float], fds: list[float], target: float) -> float | None:
    """First (fractional) step at which the FD curve falls to `target`, linear between exports; None if never."""
    for i, (step, fd) in enumerate(zip(steps, fds)):
        if fd <= target:
            if i == 0:
                return float(step)  # no point before the first export: count it as reached there
            s0, f0 = steps[i - 1], fds[i - 1]
            return s0 + (step - s0) * (f0 - target) / (f0 - fd)
    return None


def last(points: dict[int, float]) -> float:
    """The value at the highest step."""
    return points[max(points)]


def reach_table(curves: dict[str, dict], reference: str = "dit") -> dict[str, dict]:
    """Recipe -> {step, seconds, step_ratio, seconds_ratio} to reach the reference's final mean FD.

    `curves` maps recipe -> {"steps": [...], "fd": mean FD per step, "seconds": mean seconds per step}.
    """
    ref = curves[reference]
    target = ref["fd"][-1]
    reached = {}
    for name, curve in curves.items():
        step = first_reach(curve["steps"], curve["fd"], target)
        secs = None if step is None else seconds_at(dict(zip(curve["steps"], curve["seconds"])), step)
        reached[name] = {"target": target, "step": step, "seconds": secs}
    base = reached[reference]
    for row in reached.values():
        row["step_ratio"] = base["step"] / row["step"] if row["step"] else None
        row["seconds_ratio"] = base["seconds"] / row["seconds"] if row["seconds"] else None
    return reached


def fixed_flags(arm_argv: list) -> list:
    """DEMO_TRAIN's flags that the arm does not set itself (sit-rae's --model replaces DiT-T/2)."""
    return [x for flag, value in DEMO_TRAIN.items() if flag not in arm_argv for x in (flag, value)]


def latents_folder(out, arm: str) -> Path:
    """OUT/latents (the digits VAE's latents and the encoder tokens), or the arm's own tokenizer's folder."""
    return Path(out) / OWN_LATENTS.get(arm, "latents")


def decoder_of(args, arm: str) -> str:
    """The tokenizer that decodes an arm's samples: --rae for the RAE arm, else the digits VAE (--vae)."""
    return str(args.rae) if arm in OWN_LATENTS else args.vae


def arm_of(run: Path) -> str:
    """The arm of a run folder OUT/runs/ARM-seedS or OUT/final/ARM-seedS-stepN."""
    return next(arm for arm in sorted(ARM_NAMES, key=len, reverse=True) if run.name.startswith(f"{arm}-seed"))


def tokenizer_comparison(curves: dict, sampling_gap: float) -> dict:
    """The RAE arm against the sit arm (the same recipe on the digits VAE): reach of sit's final FD and verdict."""
    pair = {name: curves[name] for name in ("sit", "sit-rae")}
    return {"reach": reach_table(pair, "sit"), "verdict": verdicts(pair, sampling_gap, "sit")["sit-rae"]}


def combined_flags(arms: list[str]) -> list:
    """The flags of several arms of one recipe together (each option once): the combined arm."""
    recipes = {ARMS[a][1] for a in arms}
    if len(recipes) != 1:
        raise SystemExit(f"--combine {' '.join(arms)} mixes the recipes {sorted(recipes)}; combine arms of one recipe")
    flags = ["--recipe", recipes.pop()]
    for arm in arms:
        options = ARMS[arm][2:]
        for flag, value in zip(options[::2], options[1::2]):
            if flag not in flags:
                flags += [flag, value]
    return flags


def final_spread(curve: dict) -> float:
    """max - min over training seeds of the final FD of one arm's curve (0 with one seed)."""
    finals = [fds[-1] for fds in curve["seeds"].values()]
    return max(finals) - min(finals)


def verdicts(curves: dict, sampling_gap: float, reference: str = "dit") -> dict:
    """Arm -> {gain, noise, verdict}: the reference's final mean FD minus the arm's, against the noise floor.

    noise = the largest of the sampling gap (one export drawn from two sampling seeds) and the training-seed
    spread of either arm's final FD; only a gain beyond it is called better (or a loss beyond it worse).
    """
    ref = curves[reference]
    out = {}
    for name, curve in curves.items():
        if name == reference:
            continue
        gain = ref["fd"][-1] - curve["fd"][-1]  # > 0: lower FD than the reference
        noise = max(sampling_gap, final_spread(ref), final_spread(curve))
        verdict = "better" if gain > noise else "worse" if -gain > noise else "within the noise floor"
        out[name] = {"gain": gain, "noise": noise, "verdict": verdict}
    return out


def step_timing(metrics: list[dict], skip_first: int = 2) -> dict:
    """Seconds per step from a --log-every 1 run: median, min, max, count (first steps and the last left out)."""
    steps = [1 / r["steps_per_s"] for r in sorted(metrics, key=lambda r: r["step"]) if r.get("steps_per_s")]
    kept = sorted(steps[skip_first:-1])
    if not kept:
        return {"median": None, "min": None, "max": None, "count": 0}
    middle = len(kept) // 2
    median = kept[middle] if len(kept) % 2 else (kept[middle - 1] + kept[middle]) / 2
    return {"median": median, "min": kept[0], "max": kept[-1], "count": len(kept)}


def fewest_rows(rows: list[dict], target: float) -> dict:
    """(model, sampler) -> the fewest network rows per image whose FD is at or below `target` (None: never)."""
    out = {}
    for row in sorted(rows, key=lambda r: r["rows"]):
        key = f"{row['arm']} {row['sampler']}"
        if key not in out or out[key] is None:
            out[key] = row["rows"] if row["fd"] <= target else None
    return out


def cfg_key(cfg: float) -> str:
    """JSON key of a guidance scale: '1', '1.5'."""
    return f"{cfg:g}"


# ---------------------------------------------------------------------------------------------------------
# Stages (real subprocesses of the real CLIs, each resumable)
# ---------------------------------------------------------------------------------------------------------

class Unfinished(Exception):
    """--report met work that is not done yet (a training, evaluation or sampling run it would have to start)."""


def run_cli(args, name: str, argv: list, log: str) -> float:
    """`python -m name argv` from the repository root, its output to OUT/logs/LOG; seconds it took."""
    if getattr(args, "report", False):
        raise Unfinished(f"{name} {' '.join(map(str, argv[:2]))}")
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", name, *map(str, argv)]
    start = time.perf_counter()
    with open(logs / log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (logs / log).read_text()[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {rc}; its log {logs / log} ends:\n{tail}\n"
                         f"Fix what it says and rerun the same command: finished work is kept.")
    return time.perf_counter() - start


def prepare_data(args) -> Path:
    """The digits latents with the digits encoder's tokens in OUT/latents (built once, as the demo builds them)."""
    from data.demo import extract_args
    from shared.datasets.digits import IMAGE_SIZE, build_digits
    from shared.datasets.shards import INDEX_NAME

    dirs = {"images": Path(args.out) / "images", "latents": Path(args.out) / "latents"}
    encoder = Path(args.out) / "encoder-digits"
    if not (dirs["latents"] / INDEX_NAME).is_file():
        build_digits(dirs["images"], progress=False)
        if not (encoder / "config.json").is_file():
            run_cli(args, "data.make_encoder", ["--out", encoder], "encoder.log")
        seconds = run_cli(args, "extract", [*extract_args(dirs), "--repr-encoder", encoder, "--repr-image-size",
                                            IMAGE_SIZE], "extract.log")
        print(f"extracted the digits latents and encoder tokens in {seconds:.0f}s", flush=True)
    if any(arm in OWN_LATENTS for arm in args.recipes):
        prepare_rae(args, dirs["images"])
    return dirs["latents"]


def prepare_rae(args, images: Path) -> Path:
    """The digits RAE's tokens of the same ImageFolder in OUT/latents-rae (the RAE made first if --rae is missing)."""
    from data.demo import extract_args
    from shared.datasets.shards import INDEX_NAME

    latents = latents_folder(args.out, "sit-rae")
    if not (latents / INDEX_NAME).is_file():
        if not (Path(args.rae) / "config.json").is_file():
            run_cli(args, "data.make_rae", ["--out", args.rae], "rae.log")
        argv = extract_args({"images": images, "latents": latents})
        argv[argv.index("--vae") + 1] = args.rae
        seconds = run_cli(args, "extract", argv, "extract-rae.log")
        print(f"extracted the digits RAE's tokens in {seconds:.0f}s", flush=True)
    return latents


def arm_flags(args, arm: str) -> list:
    """The train flags that make an arm what it is (its recipe and options)."""
    return combined_flags(args.combine) if arm == "combined" else ARMS[arm]


def run_dir(args, recipe: str, seed: int) -> Path:
    """OUT/runs/ARM-seedS."""
    return Path(args.out) / "runs" / f"{recipe}-seed{seed}"


def train_argv(args, recipe: str, seed: int, latents: Path, run: Path | None = None, steps: int | None = None,
               every: int | None = None) -> list:
    """Flags of one training run: the arm's flags plus the demo's explicit settings, an export every --every steps."""
    flags = arm_flags(args, recipe)
    steps, every = steps or args.steps, every or args.every
    latents = latents_folder(args.out, recipe) if recipe in OWN_LATENTS else latents
    return [*flags, *fixed_flags(flags), "--latents", latents, "--results-dir", run or run_dir(args, recipe, seed),
            "--max-steps", steps, "--ckpt-every", every, "--keep-last", 1, "--num-workers", 0,
            "--seed", seed, "--sample-every", 0, "--log-every", math.gcd(LOG_EVERY, every),
            "--report-to", "none"]  # log steps include every export step, so its seconds need no guess


def train(args, recipe: str, seed: int, latents: Path) -> Path:
    """Train (or resume) one run unless its final export exists; returns the run folder."""
    from shared.runtime import rundir

    run = run_dir(args, recipe, seed)
    if not rundir.export_path(run, args.steps).is_file():
        seconds = run_cli(args, "train", train_argv(args, recipe, seed, latents), f"train-{run.name}.log")
        print(f"trained {run.name} ({args.steps} steps) in {seconds:.0f}s", flush=True)
    return run


def measure_timing(args, latents: Path) -> dict:
    """Arm -> seconds per step (step_timing) from a short separate run of each arm, every step logged."""
    from shared.runtime import rundir

    out = {}
    for arm in args.recipes:
        run = Path(args.out) / "timing" / arm
        steps = args.timing_steps + 3  # the first two steps and the last (checkpoint write) are left out
        if not rundir.export_path(run, steps).is_file():
            if args.report:
                continue
            argv = train_argv(args, arm, args.seeds[0], latents, run, steps, steps)
            run_cli(args, "train", [*argv[:-4], "--log-every", 1, "--report-to", "none"], f"timing-{arm}.log")
        out[arm] = step_timing(read_jsonl(rundir.metrics_path(run)))
    return out


def read_jsonl(path: Path) -> list[dict]:
    """The JSON rows of a .jsonl file (none when it is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def export_seconds(run: Path) -> dict[int, float]:
    """Export step -> training seconds when it was written (from RUN/metrics.jsonl)."""
    from shared.runtime import rundir

    seconds = cumulative_seconds(read_jsonl(rundir.metrics_path(run)))
    return {rundir.step_of(e): seconds[rundir.step_of(e)] for e in rundir.list_exports(run)
            if rundir.step_of(e) in seconds}


def eval_options(args, run: Path, cfg: float, seed: int, interval=None):
    """The RunEvalOptions of one curve, resolved as `evaluate run` resolves them: the recorded sampling half of a
    recipe (lightning's shift 0.3 and interval 0..0.89) else the objective's fast sampler."""
    from evaluate.curve import RunEvalOptions, resolve_run_sampling
    from shared.runtime import rundir

    given = RunEvalOptions(run=str(run), num_samples=args.num_samples, features="digits",
                           num_sampling_steps=args.num_sampling_steps, cfg_scale=cfg,
                           cfg_interval=tuple(interval) if interval else None, guide_channels=args.guide_channels,
                           seed=seed, batch_size=args.batch_size)
    return resolve_run_sampling(given, rundir.list_exports(run)[-1])


def curve(args, run: Path, cfg: float, seed: int, interval=None) -> dict[int, float]:
    """Step -> digits FD of every export of `run` with these settings (evaluating those not yet done)."""
    from evaluate.curve import read_rows, settings_of
    from shared.sampling.evalcurve import same_series
    from shared.runtime import rundir

    o = eval_options(args, run, cfg, seed, interval)
    argv = ["run", run, "--features", "digits", "--num-samples", o.num_samples, "--num-sampling-steps",
            o.num_sampling_steps, "--cfg-scale", cfg, "--guide-channels", o.guide_channels, "--seed", seed,
            "--batch-size", o.batch_size, "--vae", decoder_of(args, arm_of(run)), "--cpu",
            *(["--cfg-interval", *interval] if interval else [])]
    before = len(same_series(read_rows(run), settings_of(o)))
    if before == len(rundir.list_exports(run)):  # all done: no process start-up
        return {r["step"]: r["fid"] for r in same_series(read_rows(run), settings_of(o))}
    seconds = run_cli(args, "evaluate", argv, f"evaluate-{run.name}.log")
    rows = same_series(read_rows(run), settings_of(o))
    if len(rows) > before:
        print(f"evaluated {len(rows) - before} export(s) of {run.name} at cfg {cfg:g}, seed {seed}"
              f"{f', interval {interval}' if interval else ''} in {seconds:.0f}s "
              f"({seconds / (len(rows) - before):.0f}s each)", flush=True)
    return {r["step"]: r["fid"] for r in rows}


def final_only(args, run: Path, step: int) -> Path:
    """OUT/final/RUN-stepN/exports/ holding only the run's export of `step`, its record's last (hard link, else a
    copy): with `--steps` below a run's length the floor, interval and sampler table use the export at --steps."""
    from shared.runtime import rundir

    export = rundir.export_path(run, step)
    folder = Path(args.out) / "final" / f"{run.name}-step{rundir.step_of(export)}"
    target = folder / rundir.EXPORTS / export.name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(export, target)
        except OSError:
            shutil.copy2(export, target)
    return folder


class _ZeroNet:
    """Stand-in network for counting rows: zeros of the export's output shape, the DiT attributes guidance reads."""

    def __init__(self, config):
        self.in_channels, self.null_label = config.in_channels, config.num_classes
        self.out_channels = config.in_channels * (2 if config.learn_sigma else 1)
        self.y_embedder = type("Labels", (), {"has_null": True})()

    def __call__(self, x, t, y):
        import torch

        return torch.zeros(x.shape[0], self.out_channels, *x.shape[2:])  # (N, out, h, w)


def model_rows(export: Path, sampler: str, steps: int, cfg: float, interval=None) -> int:
    """Network rows per image of one sampling run: the sampler's own loop on a zero network, rows counted."""
    import torch

    from shared.weights.export import read_config
    from shared.generative.guidance import GuidedModelFn
    from shared.generative.objectives import objective_of, run_sampler

    config = read_config(export)
    objective = objective_of(config)
    fn = GuidedModelFn(_ZeroNet(config), cfg, None, "fp32", tuple(interval) if interval else None,
                         objective.noise_level)
    noise = torch.zeros(1, config.in_channels, 2, 2)  # (1, C, h, w): the count does not depend on the size
    run_sampler(objective, sampler, fn, noise, steps, {}, model_kwargs={"y": torch.zeros(1, dtype=torch.long)})
    return fn.rows


# ---------------------------------------------------------------------------------------------------------
# Measure
# ---------------------------------------------------------------------------------------------------------

def run_record(recipe: str, seed: int, run: Path, seconds: dict, fds: dict, last_step: int) -> dict:
    """One run's record: the exports timed and scored at every cfg, up to `last_step` (a longer run is cut there,
    so runs trained to 4,000 steps compare with second seeds trained to 2,000 under `--steps 2000`)."""
    steps = sorted(s for s in set(seconds).intersection(*fds.values()) if s <= last_step)
    return {"recipe": recipe, "seed": seed, "run": str(run), "steps": steps, "seconds": [seconds[s] for s in steps],
            "seconds_per_step": seconds[steps[-1]] / steps[-1],
            "fd": {k: [v[s] for s in steps] for k, v in fds.items()}}


def measure_runs(args, latents: Path) -> list[dict]:
    """Train and evaluate every recipe x seed; one record per run (steps, seconds, FD per cfg)."""
    records = []
    # Seed-major: every arm's first seed finishes before any second seed starts, so a run stopped part-way
    # still compares every arm (issue 27: "report what finished").
    for seed, recipe in ((seed, arm) for seed in args.seeds for arm in args.recipes):
        try:
            run = train(args, recipe, seed, latents)
            seconds = export_seconds(run)
            fds = {cfg_key(c): curve(args, run, c, args.sample_seed) for c in args.cfg_scales}
        except Unfinished as e:
            print(f"--report: {recipe} seed {seed} left out, not finished ({e})", flush=True)
            continue
        records.append(run_record(recipe, seed, run, seconds, fds, args.steps))
    return sorted(records, key=lambda r: (args.recipes.index(r["recipe"]), r["seed"]))


def measure_floor(args, records: list[dict]) -> dict:
    """The final export of each recipe's first seed drawn again with --floor-seed, and the real-digits floor."""
    from evaluate.digits import real_floor

    rows = []
    for rec in (r for r in records if r["seed"] == args.seeds[0]):
        folder = final_only(args, Path(rec["run"]), rec["steps"][-1])
        for cfg in args.cfg_scales:
            try:
                first, again = rec["fd"][cfg_key(cfg)][-1], last(curve(args, folder, cfg, args.floor_seed))
            except Unfinished:
                continue
            rows.append({"recipe": rec["recipe"], "step": rec["steps"][-1], "cfg": cfg,
                         "seeds": [args.sample_seed, args.floor_seed], "fd": [first, again],
                         "gap": abs(first - again)})
    return {"real": real_floor(args.num_samples), "repeats": rows}


def measure_interval(args, records: list[dict]) -> list[dict]:
    """FD and network rows per image with and without the guidance interval, final export of each first seed."""
    from shared.runtime import rundir

    rows = []
    for rec in (r for r in records if r["seed"] == args.seeds[0] and r["recipe"] in args.interval_recipes):
        run = Path(rec["run"])
        folder = final_only(args, run, rec["steps"][-1])
        export = rundir.list_exports(folder)[-1]
        o = eval_options(args, run, args.interval_cfg, args.sample_seed)
        interval = args.ddpm_interval if _objective(export) == "ddpm" else args.flow_interval
        key = cfg_key(args.interval_cfg)  # the curve's last point when the curves have this cfg: not drawn twice
        try:
            without = rec["fd"][key][-1] if key in rec["fd"] else last(curve(args, folder, args.interval_cfg,
                                                                              args.sample_seed))
            within = last(curve(args, folder, args.interval_cfg, args.sample_seed, interval))
        except Unfinished:
            continue
        rows.append({"recipe": rec["recipe"], "step": rec["steps"][-1], "cfg": args.interval_cfg,
                     "interval": list(interval), "sampler": o.sampler, "steps": args.num_sampling_steps,
                     "fd_without": without, "fd_with": within,
                     "rows_without": model_rows(export, o.sampler, args.num_sampling_steps, args.interval_cfg),
                     "rows_with": model_rows(export, o.sampler, args.num_sampling_steps, args.interval_cfg,
                                             interval)})
    return rows


def parse_solvers(text: str) -> list[tuple[str, int]]:
    """'euler:5,10 sde:250' -> [("euler", 5), ("euler", 10), ("sde", 250)]."""
    return [(name, int(k)) for group in text.split() for name, _, steps in [group.partition(":")]
            for k in steps.split(",")]


def network_rows(export: Path, sampler: str, steps: int, cfg: float, count: int = 8) -> float:
    """Network rows per image of one sampling run, counted on the real model (adaptive dopri5 included)."""
    import torch

    from shared.generative.guidance import GuidedModelFn
    from shared.generative.objectives import objective_of, run_sampler
    from shared.weights.export import load_weights

    state, config, _, _ = load_weights(export)
    model = config.build().eval()
    model.load_state_dict(state)
    objective = objective_of(config)
    fn = GuidedModelFn(model, cfg, None, "fp32", None, objective.noise_level)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(count, config.in_channels, config.input_size, config.input_size, generator=g)
    with torch.no_grad():
        run_sampler(objective, sampler, fn, noise, steps, {}, generator=g,
                    model_kwargs={"y": torch.arange(count) % config.num_classes})
    return fn.rows / count


def draw_solver(args, folder: Path, arm: str, sampler: str, steps: int) -> float:
    """Digits FD of --solver-samples images of `folder`'s export with one sampler setting (resumable)."""
    import numpy as np

    from evaluate.digits import digits_fd

    out = Path(args.out) / "solvers" / f"{arm}-{sampler}-{steps}-n{args.solver_samples}"
    if not (out / "samples.npz").is_file():
        run_cli(args, "sample", ["--ckpt", folder, "--vae", decoder_of(args, arm), "--out", out, "--npz", "--sampler", sampler,
                                 "--num-sampling-steps", steps, "--cfg-scale", args.solver_cfg, "--guide-channels",
                                 args.guide_channels, "--num-samples", args.solver_samples, "--batch-size",
                                 args.batch_size, "--seed", args.sample_seed, "--cpu"], f"solvers-{arm}.log")
    with np.load(out / "samples.npz") as data:
        return float(digits_fd(data["arr_0"]))


def measure_solvers(args, records: list[dict]) -> list[dict]:
    """FD and network rows of each sampler setting on the first seed's final exports of sit (flow) and dit (ddpm)."""
    from shared.runtime import rundir

    rows = []
    for arm, settings in (("dit", args.ddpm_solvers), ("sit", args.flow_solvers)):
        rec = next((r for r in records if r["recipe"] == arm and r["seed"] == args.seeds[0]), None)
        if rec is None:
            continue
        folder = final_only(args, Path(rec["run"]), rec["steps"][-1])
        export = rundir.list_exports(folder)[-1]
        for sampler, steps in parse_solvers(settings):
            try:
                fd = draw_solver(args, folder, arm, sampler, steps)
            except Unfinished:
                continue
            rows.append({"arm": arm, "step": rec["steps"][-1], "sampler": sampler, "steps": steps, "fd": fd,
                         "rows": network_rows(export, sampler, steps, args.solver_cfg)})
            print(f"solvers: {arm} {sampler} {steps} steps: FD {fd:.2f}, {rows[-1]['rows']:g} rows/image", flush=True)
    return rows


def _objective(export: Path) -> str:
    """The objective name an export records."""
    from shared.weights.export import read_config

    return read_config(export).objective


def summarise(records: list[dict], cfg_scales, floor: dict | None = None) -> dict:
    """Per cfg: each arm's mean curve over seeds, its reach of dit's final mean FD, and the verdicts (with a floor)."""
    out = {}
    for cfg in map(cfg_key, cfg_scales):
        curves = {}
        for recipe in dict.fromkeys(r["recipe"] for r in records):
            runs = [r for r in records if r["recipe"] == recipe]
            curves[recipe] = {"steps": runs[0]["steps"], "fd": mean_curve([r["fd"][cfg] for r in runs]),
                              "seconds": mean_curve([r["seconds"] for r in runs]),
                              "seeds": {r["seed"]: r["fd"][cfg] for r in runs}}
        out[cfg] = {"curves": curves, "reach": reach_table(curves) if "dit" in curves else {}}
        gaps = [r["gap"] for r in (floor or {}).get("repeats", []) if cfg_key(r["cfg"]) == cfg]
        out[cfg]["verdicts"] = verdicts(curves, max(gaps, default=0.0)) if "dit" in curves else {}
        if {"sit", "sit-rae"} <= set(curves):
            out[cfg]["tokenizers"] = tokenizer_comparison(curves, max(gaps, default=0.0))
    return out


# ---------------------------------------------------------------------------------------------------------
# Print and plot
# ---------------------------------------------------------------------------------------------------------

def print_curves(results: dict) -> None:
    """FD per export step for each recipe: mean [each seed] @ mean training seconds, one table per cfg."""
    s = results["settings"]
    for cfg, summary in results["summary"].items():
        curves = summary["curves"]
        print(f"\ndigits FD at cfg {cfg} ({s['num_samples']} images, {s['num_sampling_steps']} sampling steps of the "
              f"objective's fast sampler, sampling seed {s['sample_seed']}): mean [per seed] @ training seconds")
        print(f"{'step':>6}" + "".join(f"{name:>30}" for name in curves))
        steps = next(iter(curves.values()))["steps"]
        for i, step in enumerate(steps):
            cells = [f"{c['fd'][i]:.2f} [{' '.join(f'{v[i]:.1f}' for v in c['seeds'].values())}] "
                     f"@{c['seconds'][i]:.0f}s" for c in curves.values()]
            print(f"{step:>6}" + "".join(f"{cell:>30}" for cell in cells))


def print_reach(results: dict) -> None:
    """Steps and seconds to reach the dit recipe's final mean FD, with the ratios dit / recipe."""
    for cfg, summary in results["summary"].items():
        reach = summary["reach"]
        if not reach:
            continue
        target = next(iter(reach.values()))["target"]
        print(f"\nreaching the dit recipe's final mean FD at cfg {cfg} ({target:.2f}), linear between exports "
              f"(ratio > 1: faster than dit)")
        print(f"{'recipe':>10}{'step':>9}{'seconds':>10}{'dit/steps':>11}{'dit/seconds':>13}")
        for name, row in reach.items():
            if row["step"] is None:
                print(f"{name:>10}{'not reached in the steps trained':>53}")
                continue
            print(f"{name:>10}{row['step']:>9.0f}{row['seconds']:>10.0f}{row['step_ratio']:>10.2f}x"
                  f"{row['seconds_ratio']:>12.2f}x")


def print_costs(results: dict) -> None:
    """Training seconds per step of each run and of each recipe (mean over seeds), with the ratio to dit."""
    per = {}
    for rec in results["runs"]:
        per.setdefault(rec["recipe"], []).append(rec["seconds_per_step"])
    base = sum(per["dit"]) / len(per["dit"]) if "dit" in per else None
    print("\ntraining wall clock per step (checkpoint writes included; a busy machine inflates it)")
    for name, values in per.items():
        mean = sum(values) / len(values)
        ratio = f", {mean / base:.2f}x dit's" if base else ""
        print(f"  {name:>10}: {1000 * mean:.0f} ms/step [{' '.join(f'{1000 * v:.0f}' for v in values)}]{ratio}")


def print_verdicts(results: dict) -> None:
    """Each arm's final mean FD against dit's, and whether the difference exceeds the noise floor."""
    for cfg, summary in results["summary"].items():
        if not summary.get("verdicts"):
            continue
        print(f"\nfinal mean FD at cfg {cfg} against dit's (gain > 0: lower FD); noise = max(sampling gap, training-"
              "seed spread of either arm)")
        for name, row in summary["verdicts"].items():
            print(f"  {name:>10}: gain {row['gain']:+.2f}, noise {row['noise']:.2f}: {row['verdict']}")


def print_tokenizers(results: dict) -> None:
    """The digits RAE arm against the digits VAE arm (both the sit recipe): reach, ratios and verdict."""
    for cfg, summary in results["summary"].items():
        if "tokenizers" not in summary:
            continue
        reach, verdict = summary["tokenizers"]["reach"], summary["tokenizers"]["verdict"]
        print(f"\nthe digits RAE (sit-rae, {RAE_MODEL} on 4x4x64 tokens) against the digits VAE (sit, DiT-T/2 on 8x8x4 "
              f"latents) at cfg {cfg}: reaching sit's final mean FD ({reach['sit']['target']:.2f}); ratio > 1: RAE "
              "faster")
        row = reach["sit-rae"]
        if row["step"] is None:
            print("  sit-rae: not reached in the steps trained")
        else:
            print(f"  sit-rae: step {row['step']:.0f} ({row['step_ratio']:.2f}x), {row['seconds']:.0f} s "
                  f"({row['seconds_ratio']:.2f}x)")
        print(f"  final mean FD gain of sit-rae over sit {verdict['gain']:+.2f}, noise {verdict['noise']:.2f}: "
              f"{verdict['verdict']}")


def print_timing(results: dict) -> None:
    """Seconds per step of each arm from the separate short runs, with their spread."""
    timing = results.get("timing") or {}
    if not timing:
        return
    base = (timing.get("dit") or {}).get("median")
    print("\nseconds per step, separate short runs (median, min..max of the logged steps; a busy machine inflates "
          "and spreads them)")
    for name, t in timing.items():
        if t["median"] is None:
            continue
        ratio = f", {t['median'] / base:.2f}x dit's" if base else ""
        print(f"  {name:>10}: {1000 * t['median']:.0f} ms ({1000 * t['min']:.0f}..{1000 * t['max']:.0f}, "
              f"{t['count']} steps){ratio}")


def print_solvers(results: dict) -> None:
    """FD and network rows of each sampler setting, and the fewest rows reaching DDPM-250's FD on dit."""
    rows = results.get("solvers") or []
    if not rows:
        return
    s = results["settings"]
    print(f"\nsamplers on the final exports (first seed), cfg {s['solver_cfg']:g}, {s['solver_samples']} images: "
          "FD and network rows per image")
    for row in rows:
        print(f"  {row['arm']:>4} {row['sampler']:>9} {row['steps']:>4} steps: FD {row['fd']:7.2f}, "
              f"{row['rows']:g} rows")
    target = next((r["fd"] for r in rows if (r["arm"], r["sampler"], r["steps"]) == ("dit", "ddpm", 250)), None)
    if target is not None:
        print(f"fewest rows per image reaching DDPM-250's FD on dit ({target:.2f}):")
        for key, needed in fewest_rows(rows, target).items():
            print(f"  {key:>14}: {needed:g}" if needed is not None else f"  {key:>14}: not reached")


def print_floor(results: dict) -> None:
    """The sampling noise of one point and the real-digits floor."""
    floor = results["floor"]
    print(f"\nnoise floor: {results['settings']['num_samples']} real digits vs all score {floor['real']:.2f}; "
          f"the same export drawn from two sampling seeds:")
    for row in floor["repeats"]:
        print(f"  {row['recipe']:>10} step {row['step']} cfg {row['cfg']:g} seeds {row['seeds']}: FD "
              f"{row['fd'][0]:.2f} vs {row['fd'][1]:.2f}, |difference| {row['gap']:.2f}")


def print_interval(results: dict) -> None:
    """FD and network rows per image with and without the guidance interval."""
    if not results["interval"]:
        return
    print("\nguidance interval (final export, first seed): FD and network rows per image")
    print(f"{'recipe':>10}{'cfg':>5}{'interval':>14}{'FD without':>12}{'FD with':>9}{'rows without':>14}"
          f"{'rows with':>11}")
    for row in results["interval"]:
        interval = f"{row['interval'][0]:g}-{row['interval'][1]:g}"
        print(f"{row['recipe']:>10}{row['cfg']:>5g}{interval:>14}{row['fd_without']:>12.2f}{row['fd_with']:>9.2f}"
              f"{row['rows_without']:>14}{row['rows_with']:>11} ({row['rows_with'] / row['rows_without']:.2f}x)")


def plot(results: dict, path: str) -> None:
    """FD against training steps and seconds, one line per recipe (mean, band over seeds), one row per cfg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = results["summary"]
    fig = Figure(figsize=(10, 3.6 * len(summary)), dpi=90)
    axes = fig.subplots(len(summary), 2, squeeze=False)
    for (cfg, s), (by_step, by_time) in zip(summary.items(), axes):
        for i, (name, c) in enumerate(s["curves"].items()):
            low = [min(v) for v in zip(*c["seeds"].values())]
            high = [max(v) for v in zip(*c["seeds"].values())]
            for ax, x in ((by_step, c["steps"]), (by_time, c["seconds"])):
                ax.plot(x, c["fd"], marker="o", color=f"C{i}", label=f"{name} ({len(c['seeds'])} seeds)")
                ax.fill_between(x, low, high, color=f"C{i}", alpha=0.2, lw=0)
        if s["reach"]:
            for ax in (by_step, by_time):
                ax.axhline(next(iter(s["reach"].values()))["target"], color="k", lw=0.8, ls="--",
                           label="dit's final FD")
        by_step.set_xlabel("training step")
        by_time.set_xlabel("training seconds")
        for ax in (by_step, by_time):
            ax.set_ylabel("digits FD")
            ax.set_title(f"cfg {cfg}, {results['settings']['num_samples']} images per point", fontsize=10)
            ax.grid(True, lw=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(path)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/bench-recipes", help="folder for the latents, runs, logs and results")
    p.add_argument("--arms", "--recipes", dest="recipes", nargs="+", default=list(ARM_NAMES), choices=ARM_NAMES,
                   help="arms to train (dit is the reference of the reach table): the recipes, sit-repa, sit-route, "
                        "combined")
    p.add_argument("--combine", nargs="+", default=["sit-repa", "sit-route"],
                   choices=tuple(a for a in ARMS if a not in OWN_LATENTS),
                   help="arms of one recipe whose flags the combined arm joins")
    p.add_argument("--timing-steps", type=int, default=0,
                   help="also time this many steps of each arm in a separate short run (0: off); run alone")
    p.add_argument("--report", action="store_true",
                   help="start nothing: print the tables from what is finished in --out (a run still going may write "
                        "there meanwhile), leaving out every unfinished run, evaluation or sampler setting")
    p.add_argument("--timing-only", action="store_true",
                   help="only the --timing-steps runs (do them first, alone on a quiet machine), then stop")
    p.add_argument("--solvers", action="store_true", help="also the sampler table on the sit and dit final exports")
    p.add_argument("--flow-solvers", default="euler:5,10,20,50 heun:5,10,20 sde:20,50,250 dopri5:1",
                   help="flow sampler settings SAMPLER:STEPS,... (dopri5 is adaptive: its count is unused)")
    p.add_argument("--ddpm-solvers", default="ddpm:250 dpmpp-2m:5,10,20", help="ddpm sampler settings")
    p.add_argument("--solver-samples", type=int, default=500, help="images per sampler setting")
    p.add_argument("--solver-cfg", type=float, default=1.5, help="guidance scale of the sampler table")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="training seeds (at least two for a spread)")
    p.add_argument("--steps", type=int, default=1500, help="training steps of every run")
    p.add_argument("--every", type=int, default=250, help="an EMA export (one point of the curves) every N steps")
    p.add_argument("--num-samples", type=int, default=1000,
                   help="images per point (FD is biased upward at small N: compare at one N only)")
    p.add_argument("--num-sampling-steps", type=int, default=20, help="steps of the objective's fast sampler")
    p.add_argument("--cfg-scales", nargs="+", type=float, default=[1.0, 1.5], help="guidance scales of the curves")
    p.add_argument("--guide-channels", default="all", help="latent channels guided (the demo's: all)")
    p.add_argument("--sample-seed", type=int, default=0, help="sampling seed of every curve")
    p.add_argument("--floor-seed", type=int, default=1, help="sampling seed of the noise-floor repeat")
    p.add_argument("--batch-size", type=int, default=500, help="images per sampling forward pass")
    p.add_argument("--interval-recipes", nargs="*", default=["dit", "sit"], choices=ARM_NAMES,
                   help="recipes whose final export is sampled with and without the guidance interval")
    p.add_argument("--interval-cfg", type=float, default=1.5, help="guidance scale of the interval comparison")
    p.add_argument("--ddpm-interval", nargs=2, type=float, default=[0.0, 700.0], metavar=("LO", "HI"),
                   help="guidance interval of ddpm models in DiT timesteps (0 = data)")
    p.add_argument("--flow-interval", nargs=2, type=float, default=[0.0, 0.7], metavar=("LO", "HI"),
                   help="guidance interval of flow models in noise level sigma = 1 - tau (0 = data)")
    p.add_argument("--vae", default=str(ROOT / "data" / "vae-digits"), help="the digits VAE (the demo's)")
    p.add_argument("--rae", default=None,
                   help="the digits RAE (an AutoencoderRAE folder) of the sit-rae arm (default: OUT/rae-digits, made by "
                        "python -m data.make_rae when missing)")
    p.add_argument("--plot", default=None, help="write FD against steps and seconds to this PNG")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    args = p.parse_args(argv)
    args.rae = args.rae or str(Path(args.out) / "rae-digits")
    if args.steps % args.every:
        p.error(f"--steps {args.steps} is not a multiple of --every {args.every}: every run must end on an export")
    return args


def main(argv=None) -> None:
    """Measure (or resume), print the tables, optionally plot and dump JSON."""
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        latents = prepare_data(args)
    except Unfinished:
        raise SystemExit(f"--report: {args.out} holds no extracted latents yet; run the command without --report "
                         f"first (it resumes), then --report prints what has finished.")
    if args.timing_only:
        print_timing({"timing": measure_timing(args, latents)})
        return
    records = measure_runs(args, latents)
    if not records:
        raise SystemExit(f"--report: no run in {args.out} has finished and been evaluated yet; rerun later.")
    settings = {k: v for k, v in vars(args).items() if k not in ("plot", "json")}
    floor = measure_floor(args, records)
    results = {"settings": settings, "train": {k.lstrip("-"): v for k, v in DEMO_TRAIN.items()},
               "arms": {arm: [str(f) for f in arm_flags(args, arm)] for arm in args.recipes}, "runs": records,
               "summary": summarise(records, args.cfg_scales, floor), "floor": floor,
               "interval": measure_interval(args, records),
               "timing": measure_timing(args, latents) if args.timing_steps else {},
               "solvers": measure_solvers(args, records) if args.solvers else []}
    print_curves(results)
    print_reach(results)
    print_costs(results)
    print_floor(results)
    print_verdicts(results)
    print_tokenizers(results)
    print_timing(results)
    print_interval(results)
    print_solvers(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
