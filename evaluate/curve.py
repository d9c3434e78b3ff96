"""`python -m evaluate run RUN --num-samples N`: quality over training, one point per EMA export, and its PNG.

Each export not yet evaluated with these settings is sampled through `python -m sample`'s own code path
(sample.generate.run_sample: same seeds, same decoding, same rank split under `accelerate launch`), evaluated
against the reference, and appended to RUN/eval.jsonl ("step" + the metrics + the settings). A rerun continues:
exports already in eval.jsonl with the same settings are skipped. RUN/eval.png is redrawn after every export.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from evaluate.evaluation import EvalOptions, append_jsonl, check_options, evaluate_samples, process_info
from evaluate.features import FEATURE_NETWORKS, check_image_size
from evaluate.metrics import IS_SPLIT_SIZE, check_split_size
from shared import rundir
from shared.diffusion import SAMPLER_NAMES
from shared.errors import UserError, cli_errors
from shared.fsio import atomic_write
from shared.guidance import GUIDE_CHANNELS

PROG = "python -m evaluate run"
# The flag that sets each setting shared/ and sample/ name in their errors.
FLAGS = {"feature network": "--features", "sampler": "--sampler", "vae": "--vae", "cfg scale": "--cfg-scale",
         "guide-channel choice": "--guide-channels"}
CURVE_METRICS = (("fid", "FID"), ("sfid", "sFID"), ("inception_score", "Inception Score"),
                 ("precision", "precision"), ("recall", "recall"))


@dataclass
class RunEvalOptions:
    """Everything `python -m evaluate run` accepts (one field per flag)."""

    run: str
    num_samples: int
    ref: str | None = None
    features: str = "inception"
    sampler: str = "ddim"
    num_sampling_steps: int = 50
    cfg_scale: float = 1.5
    guide_channels: str = "auto"
    seed: int = 0
    batch_size: int = 32
    eval_batch_size: int = 64
    is_split_size: int = IS_SPLIT_SIZE
    vae: str | None = None
    inception_weights: str | None = None
    keep_samples: bool = False
    cpu: bool = False


def settings_of(o: RunEvalOptions) -> dict:
    """The settings that make eval.jsonl lines comparable (one curve; an export with a line of these is skipped)."""
    return {"feature_network": o.features, "ref": o.ref or "real digits", "num_samples": o.num_samples,
            "sampler": o.sampler, "num_sampling_steps": o.num_sampling_steps, "cfg_scale": o.cfg_scale,
            "guide_channels": o.guide_channels, "seed": o.seed}


def settings_tag(settings: dict) -> str:
    """Short readable folder tag of the settings: sampler, steps, cfg, count and a hash of all of them."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return (f"{settings['sampler']}{settings['num_sampling_steps']}-cfg{settings['cfg_scale']:g}-"
            f"n{settings['num_samples']}-{digest}")


def read_rows(run: Path) -> list[dict]:
    """The JSON objects of RUN/eval.jsonl (a line cut short by a kill is skipped)."""
    path = rundir.eval_path(run)
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def matching(rows: list[dict], settings: dict) -> list[dict]:
    """The rows measured with exactly these settings, by step."""
    return sorted((r for r in rows if all(r.get(k) == v for k, v in settings.items())), key=lambda r: r["step"])


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
    if o.num_samples < 2:
        raise UserError(f"--num-samples must be at least 2 (a covariance); got {o.num_samples}.")
    if o.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1; got {o.batch_size}.")
    if o.features == "inception":
        check_split_size(o.is_split_size)
    size = export_image_size(exports[-1])
    if size is not None:
        check_image_size(o.features, (size, size))  # e.g. digits features on a 256x256 run: before any sampling
    return exports


def export_image_size(path: Path) -> int | None:
    """The image size recorded in an export's latent metadata (header only), or None when it does not say."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return int(json.loads((f.metadata() or {})["latents"])["image_size"])
    except Exception:  # noqa: BLE001 - an unreadable header is reported by the sampling step, in its own words
        return None


def sample_export(export: Path, out: Path, o: RunEvalOptions) -> Path:
    """Draw o.num_samples images of `export` into `out` with python -m sample's code path; return samples.npz."""
    from sample.generate import SampleOptions, run_sample
    from sample.outputs import NPZ_NAME

    options = SampleOptions(ckpt=str(export), vae=o.vae, num_samples=o.num_samples, cfg_scale=o.cfg_scale,
                            guide_channels=o.guide_channels, sampler=o.sampler,
                            num_sampling_steps=o.num_sampling_steps, seed=o.seed, batch_size=o.batch_size,
                            out=str(out), npz=True, cpu=o.cpu)
    return run_sample(options) / NPZ_NAME


def evaluate_export(export: Path, o: RunEvalOptions, settings: dict, net, state) -> dict | None:
    """Sample and evaluate one export; rank 0 appends the record to RUN/eval.jsonl and returns it."""
    run, step = Path(o.run), rundir.step_of(export)
    out = rundir.eval_samples_dir(run, step, settings_tag(settings))
    npz = sample_export(export, out, o)
    state.wait_for_everyone()  # rank 0 writes samples.npz after the others finished drawing
    check_image_size(o.features, _image_size(npz))
    record = evaluate_samples(EvalOptions(samples=str(npz), ref=o.ref, features=o.features,
                                          batch_size=o.eval_batch_size, is_split_size=o.is_split_size,
                                          inception_weights=o.inception_weights, cpu=o.cpu, no_save=True), net=net)
    record = {"step": step, "export": export.name, **record, **settings}  # settings win: "ref" as the flag said
    if state.is_main_process:
        append_jsonl(rundir.eval_path(run), record)
        if not o.keep_samples:
            shutil.rmtree(out, ignore_errors=True)
    state.wait_for_everyone()
    return record


def _image_size(npz: Path):
    """(H, W) of a samples npz."""
    from evaluate.images import open_npz_images

    return open_npz_images(npz).size


def run_evaluation(o: RunEvalOptions) -> list[dict]:
    """Evaluate every export not yet in RUN/eval.jsonl with these settings; draw RUN/eval.png; return the curve."""
    from shared.distributed import process_state

    exports = check_run(o)
    settings = settings_of(o)
    done = {r["step"] for r in matching(read_rows(Path(o.run)), settings)}
    todo = [e for e in exports if rundir.step_of(e) not in done]
    state = process_state(o.cpu)
    if state.is_main_process:
        print(f"{len(exports)} exports, {len(exports) - len(todo)} already evaluated with these settings, "
              f"{len(todo)} to go", flush=True)
    net = None
    if todo:
        from evaluate.features import build_features

        _, _, device = process_info(o.cpu)
        net = build_features(o.features, "cpu" if o.cpu else device, o.inception_weights)
    for export in todo:
        evaluate_export(export, o, settings, net, state)
        if state.is_main_process:
            draw_curve(Path(o.run), settings)
    rows = matching(read_rows(Path(o.run)), settings)
    if state.is_main_process and rows and not todo:
        draw_curve(Path(o.run), settings)
    return rows


# ----------------------------------------------------------------------------------------------------------
# The PNG
# ----------------------------------------------------------------------------------------------------------

def curve_title(settings: dict) -> str:
    """One line naming what the points measure."""
    return (f"{settings['feature_network']} features vs {Path(str(settings['ref'])).name}; {settings['num_samples']} samples, "
            f"{settings['sampler']} {settings['num_sampling_steps']} steps, cfg {settings['cfg_scale']:g}, "
            f"seed {settings['seed']}")


def draw_curve(run: Path, settings: dict) -> Path | None:
    """RUN/eval.png: one panel per metric present, value against training step (matplotlib Agg, no pyplot)."""
    from matplotlib.figure import Figure

    rows = matching(read_rows(run), settings)
    panels = [(key, title) for key, title in CURVE_METRICS
              if any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for r in rows)]
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 3.4), layout="constrained")
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="tab:green")
        digits_fd = key == "fid" and settings["feature_network"] == "digits"
        ax.set_title("digits FD" if digits_fd else title, fontsize="medium")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    fig.suptitle(curve_title(settings), fontsize="small")
    path = rundir.eval_plot_path(run)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return path


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------

def run_parser() -> argparse.ArgumentParser:
    """Parser of `python -m evaluate run`."""
    p = argparse.ArgumentParser(prog=PROG, description="Quality over training: one point per EMA export of RUN, "
                                "appended to RUN/eval.jsonl, and the curve RUN/eval.png.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run", metavar="RUN", help="training run folder (its exports/ema-step-*.safetensors are evaluated)")
    p.add_argument("--num-samples", type=int, required=True,
                   help="images drawn per export (published FID: 50000; fewer give a higher, noisier FID)")
    p.add_argument("--ref", default=None,
                   help="reference as for `python -m evaluate` (ADM batch, stats file, images npz/folder); "
                        "with --features digits: the real digits when not given")
    p.add_argument("--features", choices=FEATURE_NETWORKS, default="inception", help="feature network")
    p.add_argument("--sampler", choices=SAMPLER_NAMES, default="ddim", help="respaced sampler of python -m sample")
    p.add_argument("--num-sampling-steps", type=int, default=50, help="sampling steps")
    p.add_argument("--cfg-scale", type=float, default=1.5, help="classifier-free guidance (1.5: DiT's FID setting)")
    p.add_argument("--guide-channels", choices=GUIDE_CHANNELS, default="auto",
                   help="latent channels guided, as python -m sample")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same images' noise for every export)")
    p.add_argument("--batch-size", type=int, default=32, help="images per sampling forward pass per process")
    p.add_argument("--eval-batch-size", type=int, default=64, help="images per feature-network pass per process")
    p.add_argument("--is-split-size", type=int, default=IS_SPLIT_SIZE, help="samples per Inception Score split")
    p.add_argument("--vae", default=None, help="VAE that decodes the samples (default: the one recorded in the export)")
    p.add_argument("--inception-weights", default=None, metavar="FILE", help="pytorch-fid's FID Inception state dict "
                   "(default: the torch hub checkpoints folder)")
    p.add_argument("--keep-samples", action="store_true",
                   help="keep RUN/eval-samples/<step>-<settings>/ after evaluating (default: removed once recorded)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    return p


def main_run(argv) -> None:
    """Entry point of `python -m evaluate run`: UserErrors become one paragraph (exit status 2)."""
    with cli_errors(PROG, FLAGS):
        options = RunEvalOptions(**vars(run_parser().parse_args(argv)))
        rows = run_evaluation(options)
        if rows:
            print(f"{len(rows)} points in {rundir.eval_path(options.run)}; curve: {rundir.eval_plot_path(options.run)}")
