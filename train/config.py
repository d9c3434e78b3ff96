"""TrainConfig: every training setting, the flags that set them, and the checks run before any allocation.

The config is written to RUN/config.json and into every checkpoint's state.json. A rerun of the same
command compares its config with the checkpoint's: fields that change the experiment (model, data,
global batch, seed, optimizer, ...) must match; the others (LR, precision, step budget, micro-batch,
logging) may change on resume and the change is logged.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from shared.cli import HelpFormatter
from shared.errors import UserError
from shared.guidance import GUIDE_CHANNELS
from shared.flow import TIME_SAMPLINGS
from shared.models import ATTENTION_BACKENDS, check_preset
from shared.objectives import OBJECTIVE_HELP, OBJECTIVE_NAMES
from shared.precision import PRECISION_CHOICES, canonical_precision
from train.trackers import DEFAULT_REPORT_TO, REPORT_TO

LR_SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "adamw8bit")
EMA_DEVICES = ("gpu", "cpu")
DEFAULT_MAX_STEPS = 400_000  # the paper's headline training length (DiT Table 4: FID-50K at 400K steps)
DEBUG_STEPS = 5

# Changing one of these changes the experiment: a resume that differs is refused.
IDENTITY_FIELDS = ("model", "objective", "time_sampling", "time_loc", "time_scale", "cos_weight", "global_batch_size", "seed", "optimizer", "adam_betas", "weight_decay",
                   "ema_decay", "class_dropout_prob")
# REPA (shared/repa.py): its settings change the experiment too.
REPA_FIELDS = ("repa_weight", "repa_depth", "repa_projector_dim", "repa_feature_dim")
IDENTITY_FIELDS += REPA_FIELDS
# Data identity: what a checkpoint's latent folder must share with the one given now.
DATA_FIELDS = ("num_samples", "latent_shape", "flips", "num_classes", "image_size", "scaling_factor", "vae",
               "index_sha256")


@dataclass
class TrainConfig:
    """All settings of one training run (flags plus values resolved from the data and the launcher)."""

    latents: str
    results_dir: str
    model: str = "DiT-XL/2"
    objective: str = "ddpm"
    time_sampling: str = "uniform"
    time_loc: float = 0.0
    time_scale: float = 1.0
    cos_weight: float = 0.0
    global_batch_size: int = 256
    micro_batch_size: int | None = None
    precision: str = "fp32"
    grad_checkpoint: int = 0
    lr: float = 1e-4
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    adam_betas: tuple = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    ema_decay: float = 0.9999
    ema_device: str = "gpu"
    optimizer: str = "adamw"
    class_dropout_prob: float = 0.1
    max_steps: int | None = None
    epochs: float | None = None
    ckpt_every: int = 50_000
    keep_last: int = 2
    keep_exports: int = 0
    image_size: int | None = None  # checked against the latents' image size when given
    log_every: int = 100
    sample_every: int = 10_000
    sample_steps: int = 50
    sample_cfg_scale: float | None = None  # None: 4.0 with a null class, 1.0 (no guidance) without
    sample_guide_channels: str = "all"
    report_to: str = DEFAULT_REPORT_TO
    watch_vae: str | None = None
    resume: str = "auto"
    compile: bool = False
    attention: str = "auto"
    num_workers: int = 4
    seed: int = 0
    debug: bool = False
    dry_run: bool = False
    max_nonfinite: int = 10
    # REPA (Yu et al. 2024; shared/repa.py): align block `repa_depth`'s tokens, through an MLP D -> P -> P -> E,
    # with the encoder tokens stored in the latent folder; 0 weight = off. E comes from the folder when None.
    repa_weight: float = 0.0
    repa_depth: int = 8
    repa_projector_dim: int = 2048
    repa_feature_dim: int | None = None
    # Resolved by resolve_config (not flags):
    world_size: int = 1
    grad_accum_steps: int = 1
    total_steps: int = 0
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict (tuples become lists)."""
        d = asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Rebuild from to_dict output, ignoring keys this version does not know."""
        names = {f.name for f in fields(cls)}
        d = dict(d)
        if "mixed_precision" in d:  # configs written before the flag became --precision
            d.setdefault("precision", canonical_precision(d.pop("mixed_precision")))
        kwargs = {k: v for k, v in d.items() if k in names}
        if "adam_betas" in kwargs:
            kwargs["adam_betas"] = tuple(kwargs["adam_betas"])
        return cls(**kwargs)

    def to_json(self) -> str:
        """Indented JSON text of the config."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# ---------------------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------------------

def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """Model, data and run-folder flags."""
    p.add_argument("--model", default="DiT-XL/2", help="model preset from shared.models.DiT_models (default DiT-XL/2)")
    p.add_argument("--objective", default="ddpm", choices=OBJECTIVE_NAMES,
                   help="what the model learns: " + "; ".join(f"{k}: {v}" for k, v in OBJECTIVE_HELP.items()))
    p.add_argument("--time-sampling", default="uniform", choices=TIME_SAMPLINGS,
                   help="flow only: how training draws the time: uniform (SiT) or lognormal, sigmoid of a normal "
                        "(SD3, LightningDiT)")
    p.add_argument("--time-loc", type=float, default=0.0, help="flow only: location of the lognormal time draw")
    p.add_argument("--time-scale", type=float, default=1.0, help="flow only: scale of the lognormal time draw")
    p.add_argument("--cos-weight", type=float, default=0.0,
                   help="flow only: weight of LightningDiT's cosine velocity-direction loss (its recipe: 1)")
    p.add_argument("--latents", required=True, help="latent folder written by `python -m extract` (index.json + shards)")
    p.add_argument("--results-dir", required=True,
                   help="the run folder; rerunning the same command resumes it (checkpoints, logs, exports)")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from the newest checkpoint in --results-dir if any; none: refuse a "
                        "folder that already has checkpoints; PATH: a checkpoint folder to continue from")
    p.add_argument("--seed", "--global-seed", type=int, default=0,
                   help="seed of the data order and of every per-sample draw (--global-seed: the official name)")
    p.add_argument("--image-size", type=int, default=None,
                   help="image size in pixels the run is meant for; checked against the size the latents were "
                        "extracted at (default: take it from the latents)")


def _add_repa_flags(p: argparse.ArgumentParser) -> None:
    """REPA: representation alignment with the encoder tokens stored by `extract --repr-encoder`."""
    p.add_argument("--repa-weight", type=float, default=0.0,
                   help="REPA: weight lambda of the alignment loss (REPA: 0.5); 0 turns REPA off (default). Needs a "
                        "latent folder extracted with --repr-encoder")
    p.add_argument("--repa-depth", type=int, default=8,
                   help="REPA: align the output of this block, counted from 1 (REPA: 8 of SiT-XL's 28)")
    p.add_argument("--repa-projector-dim", type=int, default=2048,
                   help="REPA: hidden width P of the projector MLP D -> P -> P -> E (REPA: 2048)")
    p.add_argument("--repa-feature-dim", type=int, default=None,
                   help="REPA: the projector's output E, which must equal the stored features' width (REPA's "
                        "--projector-embed-dims, 768 for DINOv2-B); default: read from the latent folder")


def _add_batch_flags(p: argparse.ArgumentParser) -> None:
    """Batch, precision and memory flags."""
    p.add_argument("--global-batch-size", type=int, default=256,
                   help="images per optimizer step over all processes (DiT: 256)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="images per forward pass per process; gradient accumulation = global batch / "
                        "(micro batch x processes), which must divide exactly (default: no accumulation)")
    p.add_argument("--precision", "--mixed-precision", dest="precision", default="fp32", choices=PRECISION_CHOICES,
                   type=canonical_precision,
                   help="fp32; fp16: autocast + dynamic loss scaling (fp32 master weights); bf16: autocast. The same "
                        "names as python -m sample --precision (--mixed-precision and 'no' = fp32 still work)")
    p.add_argument("--grad-checkpoint", type=int, nargs="?", const=1, default=0, metavar="K",
                   help="recompute every K-th transformer block in backward to save memory (bare flag: K=1, "
                        "every block; 0 or absent: off)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention kernel (auto = torch SDPA; xformers needs CUDA and the xformers wheel)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow first steps, faster after)")
    p.add_argument("--num-workers", type=int, default=4, help="DataLoader worker processes per training process")


def _add_optim_flags(p: argparse.ArgumentParser) -> None:
    """Optimizer, schedule, EMA and regularisation flags."""
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (DiT: 1e-4)")
    p.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES,
                   help="constant (DiT) or cosine decay to 0 at the last step, after the warmup")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup from 0 over this many steps")
    p.add_argument("--adam-betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"),
                   help="AdamW betas (default 0.9 0.999)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (DiT: 0)")
    p.add_argument("--max-grad-norm", type=float, default=0.0, help="clip the global gradient norm to this (0 = off)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="adamw (fused on CUDA) or adamw8bit (bitsandbytes, optional; saves ~4 GB on XL/2)")
    p.add_argument("--ema-decay", type=float, default=0.9999, help="EMA decay per optimizer step (DiT: 0.9999)")
    p.add_argument("--ema-device", default="gpu", choices=EMA_DEVICES,
                   help="where the fp32 EMA copy lives: gpu (the training device) or cpu (saves 2.7 GB for XL/2)")
    p.add_argument("--class-dropout-prob", type=float, default=0.1,
                   help="probability of replacing a label by the null class, for classifier-free guidance (DiT: 0.1)")


def _add_watch_flags(p: argparse.ArgumentParser) -> None:
    """Tracker and preview-watcher flags (train/trackers.py)."""
    p.add_argument("--report-to", default=DEFAULT_REPORT_TO, choices=REPORT_TO,
                   help="experiment tracker for loss, LR, grad norm, speed, memory, skipped steps and the fp16 loss "
                        "scale, through Accelerate: tensorboard (RUN/tensorboard/), wandb (pip install wandb), or "
                        "none; log.txt and metrics.jsonl are always written")
    p.add_argument("--watch-vae", default=None, metavar="VAE",
                   help="start `python -m sample watch RUN --vae VAE` as a separate CPU process that decodes every "
                        "--sample-every preview into RUN/samples/step-XXXXXXX.png; the VAE never enters training "
                        "(default: off; decode later with python -m sample watch or decode)")


def _add_schedule_flags(p: argparse.ArgumentParser) -> None:
    """Length, checkpoint, logging and sampling flags."""
    length = p.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=int, default=None,
                        help=f"optimizer steps to train in total (default {DEFAULT_MAX_STEPS} unless --epochs)")
    length.add_argument("--epochs", type=float, default=None, help="train this many passes over the latents instead")
    p.add_argument("--ckpt-every", type=int, default=50_000, help="full checkpoint + EMA export every N steps (and at the end)")
    p.add_argument("--keep-last", type=int, default=2, help="keep only the newest N full checkpoints (0 = keep all)")
    p.add_argument("--keep-exports", type=int, default=0,
                   help="keep only the newest N slim EMA exports (0 = keep all, the training history sample and "
                        "FID read; each DiT-XL/2 export is 2.7 GB)")
    p.add_argument("--log-every", type=int, default=100, help="log loss, LR, grad norm, speed every N steps")
    p.add_argument("--sample-every", type=int, default=10_000,
                   help="save EMA latent samples of fixed classes and noise every N steps (0 = off)")
    p.add_argument("--sample-steps", type=int, default=50, help="DDIM steps for the --sample-every previews")
    p.add_argument("--sample-cfg-scale", type=float, default=None,
                   help="guidance scale of the previews (default 4.0, or 1 = none when --class-dropout-prob is 0)")
    p.add_argument("--sample-guide-channels", default="all", choices=GUIDE_CHANNELS,
                   help="latent channels the previews guide: all (default), or 3 as the official DiT sampler")
    p.add_argument("--max-nonfinite", type=int, default=10,
                   help="stop after this many consecutive non-finite losses or gradient norms (0 = never)")
    p.add_argument("--debug", action="store_true",
                   help=f"{DEBUG_STEPS} steps with per-step logs and autograd anomaly detection; prints the "
                        "config; writes no checkpoint")
    p.add_argument("--dry-run", action="store_true", help="check the inputs, print the resolved config and exit")


def build_parser(prog: str = "python -m train") -> argparse.ArgumentParser:
    """The `python -m train` argument parser (official DiT flag names where they exist)."""
    p = argparse.ArgumentParser(prog=prog, description="Train a DiT on cached VAE latents (one GPU, CPU, or "
                                "`accelerate launch` for several processes).",
                                formatter_class=HelpFormatter)
    _add_run_flags(p)
    _add_batch_flags(p)
    _add_optim_flags(p)
    _add_schedule_flags(p)
    _add_watch_flags(p)
    _add_repa_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A TrainConfig holding the parsed flags (not yet resolved against the data)."""
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["adam_betas"] = tuple(values["adam_betas"])
    return TrainConfig(**values)


# ---------------------------------------------------------------------------------------------------------
# Checks and resolution (cheap: no model, no tensors)
# ---------------------------------------------------------------------------------------------------------

_POSITIVE = ("time_scale", "global_batch_size", "micro_batch_size", "max_steps", "epochs", "ckpt_every", "log_every",
             "sample_steps", "image_size")
_NON_NEGATIVE = ("repa_weight", "cos_weight", "grad_checkpoint", "keep_last", "keep_exports", "sample_every", "warmup_steps", "num_workers",
                 "max_nonfinite", "weight_decay", "max_grad_norm", "seed")


def _flag(name: str) -> str:
    """The flag that sets a TrainConfig field ('keep_last' -> '--keep-last')."""
    return "--" + name.replace("_", "-")


def _check_ranges(cfg: TrainConfig) -> None:
    """UserError naming the one flag whose value lies outside its meaningful range."""
    rules = [(getattr(cfg, n) is None or getattr(cfg, n) > 0, f"{_flag(n)} must be positive") for n in _POSITIVE]
    rules += [(getattr(cfg, n) >= 0, f"{_flag(n)} must be >= 0") for n in _NON_NEGATIVE]
    rules += [
        (cfg.lr > 0 and math.isfinite(cfg.lr), "--lr must be a positive number"),
        (0 <= cfg.ema_decay <= 1, "--ema-decay must lie in [0, 1]"),
        (0 <= cfg.class_dropout_prob < 1, "--class-dropout-prob must lie in [0, 1)"),
        (all(0 <= b < 1 for b in cfg.adam_betas), "--adam-betas must lie in [0, 1)"),
    ]
    for ok, message in rules:
        if not ok:
            raise UserError(f"{message}; fix the flag and rerun.")


def grad_accum_steps(global_batch: int, micro_batch: int | None, world_size: int) -> tuple[int, int]:
    """(micro batch, accumulation steps) so micro x steps x processes == global batch exactly, or UserError."""
    if global_batch % world_size:
        raise UserError(f"--global-batch-size {global_batch} is not divisible by the {world_size} processes; "
                        f"pick a multiple of {world_size}.")
    per_process = global_batch // world_size
    micro = per_process if micro_batch is None else micro_batch
    if per_process % micro:
        options = [m for m in range(1, per_process + 1) if per_process % m == 0]
        raise UserError(
            f"--global-batch-size {global_batch} over {world_size} process(es) is {per_process} images per process, "
            f"which --micro-batch-size {micro} does not divide (gradient accumulation needs a whole number of "
            f"micro-batches; no rounding). Use a micro batch among {options[-8:]}, or change the global batch.")
    return micro, per_process // micro


def data_identity(dataset) -> dict:
    """What identifies a latent folder for resume checks (shared.shards.LatentDataset -> JSON dict)."""
    index_bytes = (Path(dataset.root) / "index.json").read_bytes()
    return {
        "num_samples": len(dataset), "latent_shape": list(dataset.latent_shape), "flips": dataset.flips,
        "num_classes": dataset.num_classes, "image_size": dataset.image_size,
        "scaling_factor": dataset.scaling_factor, "vae": dataset.vae,
        "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        **({"repr_encoder": dataset.meta["repr_encoder"]} if "repr_encoder" in dataset.meta else {}),
    }


def _check_model_fits(cfg: TrainConfig, latent_shape) -> None:
    """UserError when the preset cannot take latents of this size."""
    from shared.models import PRESETS

    channels, height, width = latent_shape
    patch = PRESETS[cfg.model]["patch_size"]
    if height != width or height % patch:
        raise UserError(f"the latents are {channels}x{height}x{width} but {cfg.model} needs square latents whose "
                        f"side is a multiple of its patch size {patch}; extract square images of a size whose "
                        "latent side the patch divides, or pick a preset with a smaller patch.")


def _check_image_size(cfg: TrainConfig, dataset) -> None:
    """--image-size, when given, must be the size the latents were extracted at (no silent other resolution)."""
    if cfg.image_size is not None and cfg.image_size != dataset.image_size:
        raise UserError(f"--image-size {cfg.image_size}, but the latents in {dataset.root} were extracted at "
                        f"{dataset.image_size}x{dataset.image_size}. Pass --image-size {dataset.image_size} (or omit "
                        f"it), or extract the images at {cfg.image_size} into a new folder: `python -m extract "
                        f"--image-size {cfg.image_size} --out NEW ...`.")
    cfg.image_size = dataset.image_size


def resolve_config(cfg: TrainConfig, dataset, world_size: int) -> TrainConfig:
    """Fill the resolved fields from the latent index and the process count; UserError on any mismatch."""
    _check_ranges(cfg)
    check_preset(cfg.model)
    _check_image_size(cfg, dataset)
    _check_model_fits(cfg, dataset.latent_shape)
    cfg.world_size = world_size
    cfg.micro_batch_size, cfg.grad_accum_steps = grad_accum_steps(
        cfg.global_batch_size, cfg.micro_batch_size, cfg.world_size)
    cfg.data = data_identity(dataset)
    if cfg.epochs is not None:
        cfg.total_steps = math.ceil(cfg.epochs * len(dataset) / cfg.global_batch_size)
    else:
        cfg.total_steps = cfg.max_steps or DEFAULT_MAX_STEPS
    _resolve_preview_guidance(cfg)
    _check_objective(cfg)
    _resolve_repa(cfg, dataset)
    return cfg


def _resolve_repa(cfg: TrainConfig, dataset) -> None:
    """With REPA on: the folder's features exist, the depth fits the model, E matches them (one paragraph each)."""
    from shared.models import PRESETS
    from shared.repa import REPR_TENSOR, check_depth, check_grid, features_of

    if cfg.repa_weight <= 0:
        return
    encoder = features_of(dataset.meta, dataset.root, dataset.tensor_names)
    check_depth(cfg.repa_depth, PRESETS[cfg.model]["depth"], cfg.model)
    if cfg.repa_projector_dim <= 0:
        raise UserError(f"--repa-projector-dim must be positive (REPA: 2048), got {cfg.repa_projector_dim}.")
    flips, tokens, dim = dataset.tensor_spec(REPR_TENSOR)["shape"]  # (F, T, E)
    if cfg.repa_feature_dim is not None and cfg.repa_feature_dim != dim:
        raise UserError(f"--repa-feature-dim {cfg.repa_feature_dim} does not match the features stored in "
                        f"{dataset.root}: {tokens} tokens of width {dim} from {encoder.get('source')}. The projector's "
                        f"output must have the features' width: pass --repa-feature-dim {dim} (or omit it), or "
                        f"extract features of width {cfg.repa_feature_dim} with another --repr-encoder into a new "
                        f"folder.")
    check_grid(tokens, f"the encoder features in {dataset.root}")
    cfg.repa_feature_dim = dim


def _check_objective(cfg: TrainConfig) -> None:
    """The objective and its training settings build (e.g. no flow-only setting on a ddpm run); cheap."""
    from shared.objectives import make_objective

    make_objective(cfg.objective, time_sampling=cfg.time_sampling,
                   time_loc=cfg.time_loc, time_scale=cfg.time_scale, cos_weight=cfg.cos_weight)


def _resolve_preview_guidance(cfg: TrainConfig) -> None:
    """Default preview guidance 4.0 (DiT's picture setting); none without a null class to guide against."""
    if cfg.sample_cfg_scale is None:
        cfg.sample_cfg_scale = 4.0 if cfg.class_dropout_prob > 0 else 1.0
    elif cfg.sample_cfg_scale != 1 and cfg.class_dropout_prob == 0:
        raise UserError(f"--sample-cfg-scale {cfg.sample_cfg_scale} needs a null class, but --class-dropout-prob "
                        "is 0 (no null class is trained); pass --sample-cfg-scale 1, or train with dropout.")


# ---------------------------------------------------------------------------------------------------------
# Resume compatibility
# ---------------------------------------------------------------------------------------------------------

def _data_mismatch(saved: dict, current: dict) -> str | None:
    """A sentence on how two latent folders differ, or None when they are the same data."""
    if saved.get("repr_encoder") != current.get("repr_encoder") and saved.get("repr_encoder"):
        from shared.repa import same_features

        diffs = same_features(saved["repr_encoder"], current.get("repr_encoder") or {})
        return (f"the checkpoint was trained with features of the encoder {saved['repr_encoder'].get('source')}, but "
                f"--latents holds {'none' if not current.get('repr_encoder') else 'another encoder or size'} "
                f"({'; '.join(diffs[:4]) or 'another source'}); REPA cannot change its target mid-run. Pass the "
                f"original latent folder")
    for key in ("vae", "image_size", "latent_shape", "scaling_factor"):
        if saved.get(key) != current.get(key):
            return (f"the checkpoint was trained on latents with {key} {saved.get(key)!r}, but --latents has "
                    f"{current.get(key)!r} (another VAE or image size)")
    diffs = [k for k in DATA_FIELDS if saved.get(k) != current.get(k)]
    return f"the latent folder differs from the checkpoint's ({', '.join(diffs)})" if diffs else None


def resume_differences(saved: TrainConfig, current: TrainConfig) -> tuple[list[str], list[str]]:
    """(refused differences, allowed differences) between a checkpoint's config and the current one."""
    refused = [f"{k}: {getattr(saved, k)!r} -> {getattr(current, k)!r}" for k in IDENTITY_FIELDS
               if _norm(getattr(saved, k)) != _norm(getattr(current, k))]
    data = _data_mismatch(saved.data, current.data)
    if data:
        refused.append(data)
    skip = set(IDENTITY_FIELDS) | {"data", "results_dir", "resume", "dry_run", "debug", "latents", "image_size"}
    allowed = [f"{f.name}: {getattr(saved, f.name)!r} -> {getattr(current, f.name)!r}" for f in fields(TrainConfig)
               if f.name not in skip and _norm(getattr(saved, f.name)) != _norm(getattr(current, f.name))]
    return refused, allowed


def _norm(value):
    """Compare tuples and lists alike (JSON round trips turn one into the other)."""
    return list(value) if isinstance(value, (tuple, list)) else value


def check_resume(saved: TrainConfig, current: TrainConfig, where: Path) -> list[str]:
    """UserError if the checkpoint at `where` belongs to a different experiment; returns allowed changes."""
    refused, allowed = resume_differences(saved, current)
    if refused:
        raise UserError(
            f"--results-dir {current.results_dir} holds a run that differs from this command ({'; '.join(refused)}; "
            f"checkpoint {where}). Rerun with the original settings to resume it, or pass a new --results-dir "
            "to start a separate run.")
    return allowed
