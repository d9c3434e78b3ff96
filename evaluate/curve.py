"""`python -m evaluate run RUN --num-samples N`: quality over training, one point per EMA export, and its PNG.

Each export not yet evaluated with these settings is sampled through `python -m sample`'s own code path, evaluated,
and appended to RUN/eval.jsonl; a rerun skips those done; RUN/eval.png is redrawn after every export.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from evaluate.evaluation import (FEATURES, INCEPTION_WEIGHTS, IS_SPLIT, REF, EvalOptions, append_jsonl, check_image_size,
                                 check_options, evaluate_samples)
from evaluate.images import open_npz_images
from evaluate.metrics import check_reference, check_split_size, open_reference
from shared.runtime import rundir
from shared.runtime.cli import HelpFormatter, add_flags, check_flag_bounds, from_args, option
from shared.runtime.errors import UserError, cli_errors
from shared.generative.samplers import SAMPLER_OPTIONS, resolve_sampling
from shared.runtime.plugins import PLUGIN, load_plugins
from shared.sampling.evalcurve import draw_metric, finite_values, metric_lines, metric_title, same_series
from shared.sampling.flags import (BATCH_SIZE, CFG_SCALE, CPU, NUM_SAMPLING_STEPS, SAMPLER, SAMPLING_SETTING_FLAGS, SEED,
                                   STEPS_HELP, VAE, SamplingFlags, given_sampler_options)
from shared.runtime.fsio import atomic_write

PROG = "python -m evaluate run"
# The flag that sets each setting shared/ and sample/ name in their errors.
FLAGS = {"feature network": "--features", "vae": "--vae", **SAMPLING_SETTING_FLAGS}
CURVE_METRICS = (("fid", "FID"), ("sfid", "sFID"), ("inception_score", "Inception Score"),
                 ("precision", "precision"), ("recall", "recall"))


@dataclass(kw_only=True)
class RunEvalOptions(SamplingFlags):
    """Everything `python -m evaluate run` accepts: sample's sampling flags, with cheaper defaults for a curve."""
    run: str = option(help="training run folder (its exports/ema-step-*.safetensors are evaluated)", positional=True,
                      metavar="RUN")
    num_samples: int = option(help="images drawn per export (published FID: 50000; fewer give a higher, noisier FID)",
                              min=2, hint="a covariance")
    ref: str | None = REF.field(help="reference as for `python -m evaluate` (ADM batch, stats file, images npz/folder); "
                                     "with --features digits: the real digits when not given")
    features: str = FEATURES.field()
    sampler: str | None = SAMPLER.field(  # None: the recorded sampler, else the objective's fast deterministic one
        help="sampler of python -m sample (default: the one the model's recipe records, else the objective's fast "
             "deterministic one: ddim for ddpm models, euler for flow models)")
    num_sampling_steps: int = NUM_SAMPLING_STEPS.field(default=50, help=STEPS_HELP)
    cfg_scale: float = CFG_SCALE.field(default=1.5)
    seed: int = SEED.field(help="sampling seed (the same images' noise for every export)")
    batch_size: int = BATCH_SIZE.field()
    eval_batch_size: int = option(64, "images per feature-network pass per process", min=1)
    is_split_size: int = IS_SPLIT.field()
    vae: str | None = VAE.field()
    inception_weights: str | None = INCEPTION_WEIGHTS.field()
    plugin: list | None = PLUGIN.field()
    keep_samples: bool = option(False, "keep RUN/eval-samples/<step>-<settings>/ after evaluating (default: removed "
                                       "once recorded)")
    cpu: bool = CPU.field()


def settings_of(o: RunEvalOptions) -> dict:
    """The settings that make eval.jsonl lines comparable (one curve; an export with a line of these is skipped)."""
    return {"feature_network": o.features, "ref": o.ref or "real digits", "num_samples": o.num_samples,
            "sampler": o.sampler, "num_sampling_steps": o.num_sampling_steps, "cfg_scale": o.cfg_scale,
            "guide_channels": o.guide_channels, "seed": o.seed,
            # Only when set (an option only away from its default): points measured before a flag existed match.
            **({"cfg_interval": list(o.cfg_interval)} if o.cfg_interval else {}),
            **{name: getattr(o, name) for name, spec in SAMPLER_OPTIONS.items()
               if getattr(o, name) is not None and getattr(o, name) != spec.default},
            # "precision" is a metric of the record (precision/recall): the DiT's precision goes under its own name.
            **({"dit_precision": o.precision} if o.precision != SamplingFlags.precision else {})}


def read_rows(run: Path) -> list[dict]:
    """The JSON objects of RUN/eval.jsonl with a whole step (a line cut short by a kill is skipped)."""
    return [r for r in rundir.read_step_rows(rundir.eval_path(run)) if isinstance(r["step"], int)]


def check_run(o: RunEvalOptions) -> list[Path]:
    """UserError for what needs no model: the run, its exports, the numbers; returns the exports, oldest first."""
    check_options(EvalOptions(samples="", ref=o.ref, features=o.features, batch_size=o.eval_batch_size))
    run = Path(o.run)
    if not run.is_dir():
        raise UserError(f"{run} is not a folder; pass a training run folder (the --results-dir of python -m train).")
    exports = rundir.list_exports(run)
    if not exports:
        raise UserError(f"{run} holds no EMA exports ({rundir.EXPORTS}/ema-step-*.safetensors): train with "
                        f"checkpoints (python -m train --ckpt-every N) first, or pass the run folder itself.")
    check_flag_bounds(o)  # the bounds declared on the options; again here for options built in Python
    if o.features == "inception":
        check_split_size(o.is_split_size)
    size = export_image_size(exports[-1])
    check_image_size(o.features, (size, size))  # e.g. digits features on a 256x256 run: before any sampling
    reference = open_reference(o.ref, o.features)  # a missing or mixed-size reference: before any sampling
    check_reference(reference, o.features, (size, size))
    return exports


def export_image_size(path: Path) -> int:
    """The image size the export's latent space records (header and space tensors only)."""
    from shared.tokenizers.space import REBUILD_RUN_FILE, LatentSpace, refuse
    space = LatentSpace.read_file(path)  # a damaged record: refused in its own paragraph
    if space is None or not space.image_size:
        raise refuse(path, "is absent or names no image size, so the samples cannot be checked against the "
                           "reference before drawing them", REBUILD_RUN_FILE)
    return space.image_size


def resolve_run_sampling(o: RunEvalOptions, export: Path) -> RunEvalOptions:
    """o with what the exports sample with: the flags given, else the model's recorded sampling, else the fast one."""
    from shared.generative.objectives import objective_of
    from shared.weights.export import read_config
    config = read_config(export)
    plan = resolve_sampling(objective_of(config), o.sampler, given_sampler_options(o), o.cfg_interval, config.sampling,
                            guided=o.cfg_scale != 1.0, fast=True)
    return dataclasses.replace(o, sampler=plan.sampler, cfg_interval=plan.cfg_interval, **plan.options)


def evaluate_export(export: Path, o: RunEvalOptions, settings: dict, net, state) -> None:
    """Sample one export with python -m sample's code path, evaluate it; rank 0 appends the record to RUN/eval.jsonl."""
    from shared.sampling.plan import NPZ_NAME, SampleOptions
    from shared.sampling.generate import run_sample
    run, step = Path(o.run), rundir.step_of(export)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    tag = (f"{settings['sampler']}{settings['num_sampling_steps']}-cfg{settings['cfg_scale']:g}-"
           f"n{settings['num_samples']}-{digest}")  # a short readable folder tag: settings and a hash of all of them
    out = rundir.eval_samples_dir(run, step, tag)
    drawing = {f.name: getattr(o, f.name) for f in dataclasses.fields(SamplingFlags)}  # the one flag family
    npz = run_sample(SampleOptions(ckpt=str(export), vae=o.vae, num_samples=o.num_samples, seed=o.seed,
                                   batch_size=o.batch_size, out=str(out), npz=True, cpu=o.cpu, **drawing)) / NPZ_NAME
    state.wait_for_everyone()  # rank 0 writes samples.npz after the others finished drawing
    check_image_size(o.features, open_npz_images(npz).size)
    record = evaluate_samples(EvalOptions(samples=str(npz), ref=o.ref, features=o.features,
                                          batch_size=o.eval_batch_size, is_split_size=o.is_split_size,
                                          inception_weights=o.inception_weights, cpu=o.cpu, no_save=True), net=net)
    record = {"step": step, "export": export.name, **record, **settings}  # settings win: "ref" as the flag said
    if state.is_main_process:
        append_jsonl(rundir.eval_path(run), record)
        if not o.keep_samples:
            shutil.rmtree(out, ignore_errors=True)
    state.wait_for_everyone()


def run_evaluation(o: RunEvalOptions) -> list[dict]:
    """Evaluate every export not yet in RUN/eval.jsonl with these settings; draw RUN/eval.png; return the curve."""
    from shared.runtime.distributed import process_state
    from shared.sampling.compiled import check_compile
    exports = check_run(o)
    o = resolve_run_sampling(o, exports[-1])
    settings = settings_of(o)
    done = {r["step"] for r in same_series(read_rows(Path(o.run)), settings)}
    todo = [e for e in exports if rundir.step_of(e) not in done]
    state = process_state(o.cpu)
    check_compile(o.compile, state.device)  # before the feature network is built
    if state.is_main_process:
        print(f"{len(exports)} exports, {len(exports) - len(todo)} already evaluated with these settings, "
              f"{len(todo)} to go", flush=True)
    from evaluate import evaluation  # build_features looked up at the call: tests replace it
    net = evaluation.build_features(o.features, "cpu" if o.cpu else state.device, o.inception_weights) if todo else None
    for export in todo:
        evaluate_export(export, o, settings, net, state)
        if state.is_main_process:
            draw_curve(Path(o.run), settings)
    rows = same_series(read_rows(Path(o.run)), settings)
    if state.is_main_process and rows and not todo:
        draw_curve(Path(o.run), settings)
    return rows


def draw_curve(run: Path, settings: dict) -> Path | None:
    """RUN/eval.png: one panel per metric present, value against training step (matplotlib Agg, no pyplot)."""
    from matplotlib.figure import Figure
    rows = same_series(read_rows(run), settings)
    panels = [(key, title, metric_lines(rows, key)) for key, title in CURVE_METRICS]
    panels = [(key, title, lines) for key, title, lines in panels if finite_values(lines)]
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 3.4), layout="constrained")
    for i, (key, title, lines) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        draw_metric(ax, lines)  # one series: these settings' points (shared/sampling/evalcurve.py, as curves.png)
        ax.set_title("digits FD" if metric_title(rows, key) == "digits FD" else title, fontsize="medium")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{settings['feature_network']} features vs {Path(str(settings['ref'])).name}; "
                 f"{settings['num_samples']} samples, {settings['sampler']} {settings['num_sampling_steps']} steps, "
                 f"cfg {settings['cfg_scale']:g}, seed {settings['seed']}", fontsize="small")  # what the points measure
    return atomic_write(rundir.eval_plot_path(run), lambda tmp: fig.savefig(tmp, format="png", dpi=100))


def run_parser() -> argparse.ArgumentParser:
    """Parser of `python -m evaluate run`."""
    return add_flags(argparse.ArgumentParser(prog=PROG, description="Quality over training: one point per EMA export "
                                             "of RUN, appended to RUN/eval.jsonl, and the curve RUN/eval.png.",
                                             formatter_class=HelpFormatter), RunEvalOptions)


def main_run(argv) -> None:
    """Entry point of `python -m evaluate run`: UserErrors become one paragraph (exit status 2)."""
    with cli_errors(PROG, FLAGS):
        load_plugins(argv)  # first: a plugin's sampler is a --sampler choice, its objective rebuilds the exports'
        options = from_args(RunEvalOptions, run_parser().parse_args(argv))
        rows = run_evaluation(options)
        if rows:
            print(f"{len(rows)} points in {rundir.eval_path(options.run)}; curve: {rundir.eval_plot_path(options.run)}")
