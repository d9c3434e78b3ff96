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

from shared.runtime.cli import HelpFormatter, argument_of, add_flags, check_flag_bounds, flag_name, from_args, option
from shared.runtime.plugins import PLUGIN
from shared.runtime.errors import SettingError, UserError
from shared.runtime.rerun import differences
from shared.datasets.columns import check_plugins, columns, flag_values
from shared.generative.guidance import GUIDE_CHANNELS
from shared.generative.flow import auto_shift, check_shift
from shared.network.attention import ATTENTION_BACKENDS
from shared.network.blocks import BLOCK_FIELDS, BLOCK_HELP, BLOCKS, SELECTIVE, block_flag, block_options
from shared.network.models import (CLASS_DROPOUT_PROB, HEAD_FIELDS, PRESETS, ModelConfig, check_preset, default_block,
                                   preset_head, token_width_problem)
from shared.generative.objectives import (DEFAULT_OBJECTIVE, OBJECTIVES, learns_sigma, make_objective, objective_help,
                                          recorded_by_training, recorded_fields, training_args, training_flags)
from train.latents import byte_size
from train.recipes import RECIPE_HELP, RECIPES, apply_recipe
from shared.runtime.precision import PRECISION_CHOICES, canonical_precision
from shared.tokenizers.tokenizer import NORM_CHOICES, NORM_HELP, LatentNorm
from shared.tokenizers.space import LatentSpace
from shared.runtime.trackers import DEFAULT_REPORT_TO, REPORT_TO

DEFAULT_MAX_STEPS = 400_000  # the paper's headline training length (DiT Table 4: FID-50K at 400K steps)
DEBUG_STEPS = 5

# Changing one of these changes the experiment: a resume that differs is refused. Besides the obvious: the shard
# columns' training flags (REPA's), token routing (which tokens every step trains on), the weights a fine-tuning run
# started from (train/init_from.py), the data order (train/latents.py resolves auto before the resume check).
IDENTITY_FIELDS = ("model", "objective", "objective_options", "time_dist_shift", "global_batch_size", "seed",
                   "optimizer", "adam_betas", "weight_decay", "ema_decay", "class_dropout_prob", *BLOCK_FIELDS,
                   *HEAD_FIELDS, "column_options", "route_ratio", "route_start", "route_end", "init_from",
                   "shard_window")
# Data identity: what a checkpoint's latent folder must share with the one given now.
DATA_FIELDS = ("num_samples", "latent_shape", "flips", "num_classes", "image_size", "scaling_factor", "vae",
               "index_sha256", "latent_space")


def _or_auto(convert, expected: str):
    """An argparse type: convert(text), or 'auto' (resolved later: from the latents, or by train/autotune.py)."""
    def parse(text: str):
        if text == "auto":
            return text
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected} or auto, got {text!r}") from None
    return parse


def checkpoint_value(text: str) -> int | str:
    """A checkpointing choice: a whole number K (every K-th block; 0 = off) or selective; ValueError otherwise."""
    return text if text == SELECTIVE else int(text)


float_or_auto = _or_auto(float, "a number")
int_or_auto = _or_auto(int, "a whole number")
checkpoint_choice = _or_auto(checkpoint_value, f"a whole number, {SELECTIVE}")  # --grad-checkpoint, or auto


@dataclass
class TrainConfig:
    """All settings of one training run: each flag's default and help (shared.runtime.cli.option), then resolved."""
    latents: str = option(help="latent folder written by `python -m extract` (index.json + shards)")
    results_dir: str = option(help="the run folder; rerunning the same command resumes it (checkpoints, logs, exports)")
    cache_limit: int | None = option(
        None, "--latents URL: stream its shards through a local cache of at most SIZE (e.g. 20GiB, 500MB), fetched "
              "ahead of the step, sha256-checked as they arrive, evicted once consumed; the data order becomes "
              "shard-aware (--shard-window). Default: no limit, the whole folder is copied once and kept",
        type=byte_size, metavar="SIZE")
    shard_window: int | str = option(
        "auto", "data order: 0 = one shuffle of all samples per epoch; K = shards shuffled, then samples shuffled "
                "within each window of K shards, so a bounded cache needs only the current and the next window. "
                "auto (default): 0, or with --cache-limit the largest K whose two windows fit it. Part of the "
                "experiment: a local folder trained with the same K gives bitwise the same run", type=int_or_auto,
        metavar="K|auto")
    model: str = option("DiT-XL/2", "model preset from shared.network.models.DiT_models")
    recipe: str = option("dit", "one word for a published recipe's objective, time sampling, block and optimizer "
                                "settings (train/recipes.py); any flag given explicitly wins: "
                         + "; ".join(f"{k}: {v}" for k, v in RECIPE_HELP.items()).replace("%", "%%"),
                         choices=tuple(RECIPES))
    objective: str = option(DEFAULT_OBJECTIVE, "what the model learns, a registered objective "
                            "(shared/generative/objectives.py; --plugin MODULE adds one): " + objective_help())
    plugin: list | None = PLUGIN.field()
    # The objective's training fields (--time-sampling, ... derived from the registry): those given, then resolved.
    objective_options: dict = field(default_factory=dict)
    # The registered shard columns' training flags (--repa-weight, ...; shared/datasets/columns.py), then resolved.
    column_options: dict = field(default_factory=lambda: column_defaults())
    # The recipe's sampling half, recorded with the model (ModelConfig.sampling) for sample, evaluate run, previews.
    sampling: dict = field(default_factory=dict)
    time_dist_shift: float | str = option(
        1.0, "flow only: RAE's shift s of the training times towards noise, t' = s t / (1 + (s-1) t) in RAE's time "
             "(1 = noise), recorded with the model so sampling shifts its grid the same way; auto: sqrt(C*H*W / "
             "4096) of the latent shape (RAE: 6.93 for 768x16x16 tokens; 1 for SD-VAE's 4x32x32) (default 1 = "
             "none)", type=float_or_auto, metavar="S|auto")
    # Block options (shared/network/blocks.py's table): None until resolve_block fills them from --block's preset.
    block: str | None = option(
        None, f"the transformer block preset: {BLOCK_HELP}; {'/'.join(map(flag_name, BLOCK_FIELDS))} override single "
              "options of it (default: the --model's: dit, lightning for DiTDH-*)", choices=tuple(BLOCKS))
    norm: str | None = block_flag("norm").field()
    mlp: str | None = block_flag("mlp").field()
    rope: bool | None = block_flag("rope").field()
    qk_norm: bool | None = block_flag("qk_norm").field()
    latent_norm: str = option(
        "auto", "how latents are normalised before the DiT sees them (recorded in every checkpoint and export, "
                "inverted by every decode): " + "; ".join(f"{k}: {v}" for k, v in NORM_HELP.items()),
        choices=NORM_CHOICES)
    head_depth: int | None = option(
        None, "blocks of the wide shallow DiT^DH head after the body (RAE: 2), conditioned per token on the body's "
              "output; 0 = none (default: the --model preset's: 2 for DiTDH-*, 0 for DiT-*)")
    head_width: int | None = option(None, "width of the DiT^DH head (RAE: 2048; default: the preset's)")
    head_heads: int | None = option(None, "attention heads of the DiT^DH head (RAE: 16; default: the preset's)")
    global_batch_size: int = option(256, "images per optimizer step over all processes (DiT: 256)", min=1)
    micro_batch_size: int | str | None = option(  # "auto": train/autotune.py (None: the whole per-process batch)
        "auto", "images per forward pass per process; gradient accumulation = global batch / (micro batch x "
                "processes), which must divide exactly. auto (default): on a GPU the largest that fits its free "
                "memory (python -m train.plan's answer, confirmed by a real step); on the CPU the whole per-process "
                "batch", type=int_or_auto, min=1)
    precision: str = option(
        "auto", "auto (default): the accelerate config's mixed_precision if set, else bf16 on GPUs that have it, fp16 "
                "on older GPUs, fp32 on the CPU; fp32; fp16: autocast + dynamic loss scaling (fp32 master weights); "
                "bf16: autocast. The same names as python -m sample --precision (REPA's --mixed-precision "
                "no = fp32 works too)", aliases=("--mixed-precision",), choices=("auto", *PRECISION_CHOICES),
        type=canonical_precision)
    grad_checkpoint: int | str = option(
        "auto", "recompute every K-th transformer block in backward to save memory (bare flag: K=1, every block; 0: "
                f"off); {SELECTIVE}: every block keeps its matmul and attention outputs and recomputes only the "
                "pointwise ops between them (less memory than off, far less recomputation than every block). auto "
                "(default): on a GPU only as much as memory needs; off on the CPU", nargs="?", const=1,
        metavar="K", type=checkpoint_choice, min=0)
    lr: float = option(1e-4, "peak learning rate (DiT: 1e-4)", above=0, below=math.inf)
    lr_schedule: str = option("constant", "constant (DiT), or cosine or linear decay to --final-lr at the last step, "
                                          "after the warmup (RAE: linear)", choices=("constant", "cosine", "linear"))
    final_lr: float = option(0.0, "cosine/linear schedules: the LR reached at the last step (RAE: 2e-5)", min=0)
    warmup_steps: int = option(0, "linear LR warmup from 0 over this many steps", min=0)
    adam_betas: tuple = option((0.9, 0.999), "AdamW betas", type=float, nargs=2, metavar=("B1", "B2"), min=0, below=1)
    weight_decay: float = option(0.0, "AdamW weight decay (DiT: 0)", min=0)
    max_grad_norm: float = option(0.0, "clip the global gradient norm to this (0 = off)", min=0)
    ema_decay: float = option(0.9999, "EMA decay per optimizer step (DiT: 0.9999)", min=0, max=1)
    ema_device: str = option("gpu", "where the fp32 EMA copy lives: gpu (the training device) or cpu (saves 2.7 GB "
                                    "for XL/2)", choices=("gpu", "cpu"))
    optimizer: str = option("adamw", "adamw (fused on CUDA) or adamw8bit (bitsandbytes, optional; saves ~4 GB on "
                                     "XL/2)", choices=("adamw", "adamw8bit"))
    class_dropout_prob: float = option(
        CLASS_DROPOUT_PROB, "probability of replacing a label by the null class, for classifier-free guidance (DiT: 0.1)",
        min=0, below=1)
    max_steps: int | None = option(
        None, f"optimizer steps to train in total (default {DEFAULT_MAX_STEPS} unless --epochs)", exclusive="length",
        min=1)
    epochs: float | None = option(None, "train this many passes over the latents instead", exclusive="length", above=0)
    ckpt_every: int = option(50_000, "full checkpoint + EMA export every N steps (and at the end)", min=1)
    keep_last: int = option(2, "keep only the newest N full checkpoints (0 = keep all)", min=0)
    keep_exports: int = option(
        0, "keep only the newest N slim EMA exports (0 = keep all, the training history sample and FID read; each "
           "DiT-XL/2 export is 2.7 GB)", min=0)
    image_size: int | None = option(
        None, "image size in pixels the run is meant for; checked against the size the latents were extracted at "
              "(default: take it from the latents)", min=1)
    log_every: int = option(100, "log loss, LR, grad norm, speed every N steps", min=1)
    sample_every: int = option(10_000, "save EMA latent samples of fixed classes and noise every N steps (0 = off)",
                               min=0)
    sample_steps: int = option(50, "DDIM steps for the --sample-every previews", min=1)
    sample_cfg_scale: float | None = option(
        None, "guidance scale of the previews (default 4.0, or 1 = none when --class-dropout-prob is 0)")
    sample_guide_channels: str = option(
        "all", "latent channels the previews guide: all (default; what sample and evaluate run guide for this run "
               "with --guide-channels auto), or 3 as the official DiT sampler", choices=GUIDE_CHANNELS)
    report_to: str = option(
        DEFAULT_REPORT_TO, "experiment tracker for loss, LR, grad norm, speed, memory, skipped steps and the fp16 "
                           "loss scale, through Accelerate: tensorboard (RUN/tensorboard/), wandb (pip install "
                           "wandb), or none; log.txt and metrics.jsonl are always written", choices=REPORT_TO)
    watch_vae: str | None = option(
        None, "start `python -m sample watch RUN --vae VAE` as a separate CPU process that decodes every "
              "--sample-every preview into RUN/samples/step-XXXXXXX.png; the VAE never enters training (default: "
              "off; decode later with python -m sample watch or decode)", metavar="VAE")
    resume: str = option(
        "auto", "auto: continue from the newest checkpoint in --results-dir if any; none: refuse a folder that "
                "already has checkpoints; PATH: a checkpoint folder to continue from")
    compile: bool = option(False, "torch.compile each transformer block (regional: one block is traced and its graph "
                                  "reused by every block, so compile time does not grow with depth); off by default "
                                  "until measured faster on a GPU (docs/performance.md)")
    attention: str = option("auto", "attention kernel (auto = torch SDPA; xformers needs CUDA and the xformers "
                                    "wheel)", choices=ATTENTION_BACKENDS)
    num_workers: int | None = option(None, "DataLoader worker processes per training process (default: up to 4, "
                                           "one core per process left for training: 1 on a 2-core machine)", min=0)
    seed: int = option(0, "seed of the data order and of every per-sample draw (--global-seed: the official name)",
                       aliases=("--global-seed",), min=0)
    debug: bool = option(False, f"{DEBUG_STEPS} steps with per-step logs and autograd anomaly detection; prints the "
                                "config; writes no checkpoint")
    dry_run: bool = option(False, "check the inputs, print the resolved config and exit")
    max_nonfinite: int = option(
        10, "stop after this many consecutive non-finite losses or gradient norms (0 = never); counted on the GPU "
            "and checked at the --log-every, preview and checkpoint steps, never before a checkpoint is written", min=0)
    # Token routing (TREAD, Krause et al. 2025; shared/network/routing.py): in training only, a random share of each
    # sample's tokens skips blocks route_start..route_end; 0 ratio = off. start/end resolve to TREAD's 2 and depth-4.
    route_ratio: float = option(0.0, "token routing (TREAD): the share of each sample's tokens that skip the routed "
                                     "blocks in training, drawn per sample; sampling still runs every token through "
                                     "every block. 0 turns routing off (default); TREAD: 0.5")
    route_start: int | None = option(None, "token routing: the first routed block, counted from 0 as blocks.N "
                                           "(default with --route-ratio: 2, TREAD's)")
    route_end: int | None = option(None, "token routing: the last routed block, counted from 0 and included (default "
                                         "with --route-ratio: depth - 4, TREAD's: 8 of DiT-B's 12, 24 of XL's 28)")
    init_from: str | None = option(
        None, "start from a trained model's weights instead of the initialisation: a run folder (its newest EMA "
              "export), an export, or a SiT/REPA release .pt; for --objective meanflow from a flow model (the paper's "
              "fine-tuning): the new t - r embedding starts at zero, so the network begins as that flow model exactly. "
              "Recorded in config.json (init); a resume continues from the run's own checkpoint", metavar="RUN_OR_EXPORT")
    # Resolved by resolve_config (not flags):
    init: dict = field(default_factory=dict)  # what --init-from loaded (train/init_from.py): path, step, objective
    world_size: int = 1
    grad_accum_steps: int = 1
    total_steps: int = 0
    data: dict = field(default_factory=dict)
    autotune: dict = field(default_factory=dict)  # what each "auto" resolved to, and why (train/autotune.py)

    @property
    def block_options(self) -> dict:
        """{norm, mlp, rope, qk_norm}: what the block slots hold (None until resolved)."""
        return {k: getattr(self, k) for k in BLOCK_FIELDS}

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict (tuples become lists)."""
        return {**asdict(self), "adam_betas": list(self.adam_betas)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "the checkpoint") -> "TrainConfig":
        """Rebuild from to_dict output; UserError on a setting this version does not know (it would be dropped)."""
        if unknown := sorted(set(d) - {f.name for f in fields(cls)}):
            raise UserError(f"the config of {where} holds settings this version does not know ({', '.join(unknown)}): "
                            "it was written by another version, and resuming would silently drop them. Resume it "
                            "with that version, or start a fresh run with a new --results-dir.")
        kwargs = {**d, "column_options": {**column_defaults(), **d.get("column_options", {})}}  # a plugin's: defaults
        if "adam_betas" in kwargs:
            kwargs["adam_betas"] = tuple(kwargs["adam_betas"])
        return resolve_block(cls(**kwargs))  # the block preset's options, as from the flags

    def to_json(self) -> str:
        """Indented JSON text of the config."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


BLOCK_FLAGS = {f"block {slot}": flag_name(slot) for slot in BLOCK_FIELDS}  # the flag of each slot's ChoiceError


def add_block_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The block-option flags alone (python -m train.plan and train.bench share them)."""
    return add_flags(p, TrainConfig, only=("block", *BLOCK_FIELDS))


def block_from_args(args: argparse.Namespace, model: str = "DiT-XL/2") -> dict:
    """{norm, mlp, rope, qk_norm} the block flags ask for (preset, then overrides; default: the model's block)."""
    return block_options(args.block or default_block(model), **{k: getattr(args, k) for k in BLOCK_FIELDS})


def resolve_block(cfg: TrainConfig) -> TrainConfig:
    """Fill the unset block options from cfg.block's preset (default: the model's) and the head from the model."""
    check_preset(cfg.model)
    cfg.block = cfg.block or default_block(cfg.model)
    for key, value in block_options(cfg.block, **cfg.block_options).items():
        setattr(cfg, key, value)
    for key, value in preset_head(cfg.model).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    return cfg


def build_parser(prog: str = "python -m train") -> argparse.ArgumentParser:
    """The `python -m train` argument parser (official DiT flag names where they exist)."""
    p = argparse.ArgumentParser(prog=prog, description="Train a DiT on cached VAE latents (one GPU, CPU, or "
                                "`accelerate launch` for several processes).", formatter_class=HelpFormatter)
    add_flags(p, TrainConfig)
    for column in columns().values():
        add_flags(p, column.train_flags)
    # One flag per training field of the registered objectives (shared/generative/objectives.py). Not given, a flag
    # is absent from the namespace (its default applies), so another objective's setting is refused only when asked.
    for name, (spec, takers) in training_flags().items():
        names, kwargs = argument_of(name, spec, type(spec.default))
        kwargs.update(default=argparse.SUPPRESS, help=f"{'/'.join(takers)} only: {spec.help} (default: {spec.default})")
        p.add_argument(*names, **kwargs)
    return p


def column_defaults() -> dict:
    """{field: default} of the registered shard columns' training flags."""
    return {f.name: f.default for c in columns().values() for f in fields(c.train_flags)}


def column_consumers(cfg: TrainConfig) -> list[tuple]:
    """(column, its training flags) of every column whose weight flag is > 0: a head trained beside the DiT."""
    chosen = [(c, c.train_options(cfg.column_options)) for c in columns().values()]
    return [(c, f) for c, f in chosen if getattr(f, c.weight) > 0]


def model_config_for(cfg: TrainConfig, latent_shape: tuple, num_classes: int,
                     resumed: ModelConfig | None = None) -> ModelConfig:
    """The DiT config a run of `cfg` trains on latents of latent_shape (C, h, w) with `num_classes` classes: the one
    factory of train, train.plan and train.bench. `resumed`: a checkpoint's config, whose output layout is kept."""
    # DDPM's hybrid loss trains a variance in C more output channels; a flow model predicts the velocity alone
    # (as REPA, LightningDiT, RAE; SiT's release carries 2C). Runs started with the 2C flow layout resume with it.
    learn_sigma = resumed.learn_sigma if resumed is not None else learns_sigma(cfg.objective)
    channels, size, _ = latent_shape
    objective_args = {"time_dist_shift": cfg.time_dist_shift} if cfg.time_dist_shift != 1.0 else {}
    objective_args.update(recorded_by_training(cfg.objective, cfg.objective_options))
    if "convention" in cfg.init:  # fine-tuned from a flow model: its time direction and output sign
        objective_args["convention"] = cfg.init["convention"]
    return ModelConfig(model=cfg.model, input_size=size, in_channels=channels, num_classes=num_classes,
                       learn_sigma=learn_sigma, **cfg.block_options, head_depth=cfg.head_depth,
                       head_width=cfg.head_width, head_heads=cfg.head_heads, class_dropout_prob=cfg.class_dropout_prob,
                       objective=cfg.objective, objective_args=objective_args, sampling=dict(cfg.sampling),
                       interval_time=bool(getattr(OBJECTIVES[cfg.objective], "interval_time", False)),
                       guidance_inputs=bool(getattr(OBJECTIVES[cfg.objective], "guidance_inputs", False)))


def config_from_args(args: argparse.Namespace, explicit=frozenset()) -> TrainConfig:
    """A TrainConfig holding the parsed flags, the --recipe applied to those not in `explicit` (not yet resolved)."""
    cfg = from_args(TrainConfig, args)
    cfg.objective_options = {k: getattr(args, k) for k in training_flags() if hasattr(args, k)}
    cfg.column_options = flag_values(lambda c: c.train_flags, args)
    return apply_recipe(cfg, set(explicit))


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


def data_identity(dataset, space: LatentSpace) -> dict:
    """What identifies a latent folder and the run's LatentSpace for resume checks (LatentDataset -> JSON dict)."""
    # index_sha256: of index.json less "latent_space" (shards, sha256s, classes, VAE, layout), the data trained on;
    # `extract --stats` rewrites "latent_space" on a finished folder; a run's LatentSpace is compared by its hash
    index = json.loads((Path(dataset.root) / "index.json").read_bytes())
    kept = {k: v for k, v in index.items() if k != "latent_space"}
    return {
        "num_samples": len(dataset), "latent_shape": list(dataset.latent_shape), "flips": dataset.flips,
        "num_classes": dataset.num_classes, "image_size": dataset.image_size,
        "scaling_factor": space.tokenizer.get("scaling_factor"), "vae": space.tokenizer,
        "index_sha256": hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest(),
        "latent_space": space.sha256,
        "latent_norm": f"{space.norm.describe()} from {space.norm.source or 'the recorded numbers'}",  # for messages
        **{c.meta_key: dataset.meta[c.meta_key] for c in columns().values() if c.meta_key in dataset.meta},
    }


def _check_model_fits(cfg: TrainConfig, latent_shape) -> None:
    """UserError when the preset cannot take latents of this size, or is too narrow for their tokens (RAE)."""
    from shared.network.ddt import check_head

    channels, height, width = latent_shape
    patch = PRESETS[cfg.model]["patch_size"]
    if height != width or height % patch:
        fits = [name for name, arch in PRESETS.items() if height == width and height % arch["patch_size"] == 0
                and arch["hidden_size"] >= channels * arch["patch_size"] ** 2]
        raise UserError(f"the latents are {channels}x{height}x{width} but {cfg.model} needs square latents whose "
                        f"side is a multiple of its patch size {patch}; extract square images of a size whose "
                        f"latent side the patch divides, or pick a preset with a smaller patch"
                        f"{' (' + ', '.join(fits) + ')' if fits else ''}.")
    head = {k: getattr(cfg, k) for k in HEAD_FIELDS}
    check_head(**head)
    if problem := token_width_problem(cfg.model, channels, head):
        raise SettingError(f"the latents are {channels}x{height}x{width}, and {problem}")


def resolve_latent_norm(choice: str, dataset) -> LatentNorm:
    """The normalisation `--latent-norm` asks for on this folder, or a UserError naming the fix."""
    native, root = dataset.space.native, dataset.root
    element, channel = dataset.space.norms.get("element"), dataset.space.norms.get("channel")
    if choice == "auto":
        if native is None and element is None:
            raise UserError(f"{root}/index.json records no normalisation for its tokenizer; pass --latent-norm "
                            f"channel (after `python -m extract --stats --out {root}`) or none.")
        return native if native is not None else element  # element: a tokenizer whose numbers are the folder's (RAE)
    if choice == "none":
        return LatentNorm.none()
    if choice == "element":
        if not element:
            raise UserError(f"--latent-norm element needs the per-element statistics of {root}, which extraction "
                            f"computes for RAE tokens only ({dataset.vae.get('class')} made these latents). Pick "
                            f"--latent-norm auto or channel.")
        return element
    if choice == "channel":
        if channel is None:
            raise UserError(f"--latent-norm channel needs the per-channel statistics of {root}, which was extracted "
                            f"without them. Add them from the stored moments, without encoding again: `python -m "
                            f"extract --stats --out {root}` (then rerun this command), or pick --latent-norm auto.")
        return channel
    scale = dataset.vae.get("scaling_factor")
    if choice == "scale":
        if scale is None:
            raise UserError(f"--latent-norm scale needs the tokenizer's scaling_factor, but {dataset.vae.get('source')} "
                            f"({dataset.vae.get('class')}) has none; pass --latent-norm auto (its own convention: "
                            f"{native.describe() if native else 'none recorded'}) or channel.")
        return LatentNorm.scale_only(scale, source="the VAE config's scaling_factor")
    if native is None or native.kind != "shift-scale":
        raise UserError(f"--latent-norm shift-scale needs a tokenizer with a shift_factor (SD3, FLUX.1), but the one "
                        f"of {root} ({dataset.vae.get('source')}) has none: its own convention is "
                        f"{native.describe() if native else 'unrecorded'}. Pass --latent-norm auto, scale or channel.")
    return native


def check_config(cfg: TrainConfig, dataset) -> None:
    """The checks that need only the flags and the latents, and the latent space (cfg.space) they resolve to."""
    check_flag_bounds(cfg)  # the bounds declared on the options; again here for a TrainConfig built in Python
    check_plugins(dataset.meta, dataset.root, "python -m train")
    resolve_block(cfg)  # checks the --model preset first
    if cfg.time_dist_shift == "auto":  # RAE's sqrt(C H W / 4096) of these latents; a number is checked as it is
        cfg.time_dist_shift = auto_shift(dataset.latent_shape)
    check_shift(cfg.time_dist_shift)
    _check_objective(cfg)
    if cfg.image_size is not None and cfg.image_size != dataset.image_size:  # no silent other resolution
        raise UserError(f"--image-size {cfg.image_size}, but the latents in {dataset.root} were extracted at "
                        f"{dataset.image_size}x{dataset.image_size}. Pass --image-size {dataset.image_size} (or omit "
                        f"it), or extract the images at {cfg.image_size} into a new folder: `python -m extract "
                        f"--image-size {cfg.image_size} --out NEW ...`.")
    cfg.image_size = dataset.image_size
    _check_model_fits(cfg, dataset.latent_shape)
    cfg.space = dataset.space.for_run(resolve_latent_norm(cfg.latent_norm, dataset))  # not a field: config.json
    _resolve_columns(cfg, dataset)
    _resolve_route(cfg, dataset.latent_shape)


def resolve_config(cfg: TrainConfig, dataset, world_size: int) -> TrainConfig:
    """Fill the resolved fields from the latent index and the process count (after check_config and autotune)."""
    cfg.world_size = world_size
    cfg.micro_batch_size, cfg.grad_accum_steps = grad_accum_steps(
        cfg.global_batch_size, cfg.micro_batch_size, cfg.world_size)
    cfg.data = data_identity(dataset, cfg.space)  # holds its sha256; checkpoints, exports and previews the record
    cfg.total_steps = (math.ceil(cfg.epochs * len(dataset) / cfg.global_batch_size) if cfg.epochs is not None
                       else cfg.max_steps or DEFAULT_MAX_STEPS)
    # Preview guidance: 4.0 by default (DiT's picture setting); none without a null class to guide against, and none
    # for a field that folds guidance in (MeanFlow with --cfg-omega/--cfg-kappa), which must not be guided twice.
    recorded = recorded_by_training(cfg.objective, cfg.objective_options)
    folds = bool(recorded.get("folded_guidance"))
    if folds and cfg.sample_cfg_scale not in (None, 1.0):
        raise UserError(f"--sample-cfg-scale {cfg.sample_cfg_scale} would guide a field that already folds guidance "
                        "in (--cfg-omega/--cfg-kappa), doubling it; pass --sample-cfg-scale 1 or leave it unset.")
    lo, hi = recorded.get("cfg_range", (1.0, math.inf))
    if cfg.sample_cfg_scale is None:
        cfg.sample_cfg_scale = min(4.0, hi) if cfg.class_dropout_prob > 0 and not folds else 1.0
    elif cfg.sample_cfg_scale != 1 and cfg.class_dropout_prob == 0:
        raise UserError(f"--sample-cfg-scale {cfg.sample_cfg_scale} needs a null class, but --class-dropout-prob "
                        "is 0 (no null class is trained); pass --sample-cfg-scale 1, or train with dropout.")
    elif not lo <= cfg.sample_cfg_scale <= hi:  # improved MeanFlow: the network only knows the scales it drew
        raise UserError(f"--sample-cfg-scale {cfg.sample_cfg_scale:g} is outside [{lo:g}, {hi:g}], the guidance "
                        f"scales this {cfg.objective} run trains its network on (--cfg-max {hi:g}); pass a preview "
                        "scale in that range, or raise --cfg-max.")
    return cfg


def _resolve_columns(cfg: TrainConfig, dataset) -> None:
    """Each column asked for (weight > 0) is stored in the folder and its flags fit it and the model; one block."""
    for column in columns().values():
        flags = column.train_options(cfg.column_options)
        check_flag_bounds(flags)  # the bounds its options declare, for a config built in Python
        weight = getattr(flags, column.weight)
        if weight == 0:
            continue
        if column.name not in dataset.tensor_names or column.meta_key not in dataset.meta:
            raise UserError(f"{flag_name(column.weight)} {weight} trains on the shard column {column.name!r}, but the "
                            f"latent folder {dataset.root} holds no {column.what} (no {column.name!r} tensor in its "
                            f"index.json): they are read from the folder, never computed in training. Extract a folder "
                            f"with them (`python -m extract ... {column.how}`, into a new --out) and train on it, or "
                            f"drop {flag_name(column.weight)}.")
        flags = column.resolve(flags, dataset.meta[column.meta_key], dataset.tensor_spec(column.name)["shape"],
                               cfg.model, dataset.root)
        cfg.column_options.update(asdict(flags))
    depths = {flag_name(c.depth): getattr(f, c.depth) for c, f in column_consumers(cfg)}
    if len(set(depths.values())) > 1:
        raise UserError(f"the heads of the shard columns trained here see one block's tokens, but "
                        f"{', '.join(f'{k} {v}' for k, v in depths.items())} name several; pass one block to all.")


def route_span(model: str, latent_side: int, ratio: float, start: int | None, end: int | None,
               head: bool | None = None) -> tuple[int, int]:
    """The route's (start, end) blocks, TREAD's (2, depth - 4) where not given, checked to lie in the preset's body."""
    from shared.network.routing import PAPER_START, check_route, paper_end

    arch = PRESETS[model]
    depth, tokens = arch["depth"], (latent_side // arch["patch_size"]) ** 2
    start = PAPER_START if start is None else start
    end = paper_end(depth) if end is None else end
    head = bool(arch.get("head_depth")) if head is None else head
    check_route(ratio, start, end, depth, tokens, model, body=head)
    return start, end


def _resolve_route(cfg: TrainConfig, latent_shape) -> None:
    """With routing on: TREAD's span filled in, the route checked against the model and REPA; off: no route flags."""
    if cfg.route_ratio == 0:
        if given := [flag_name(n) for n in ("route_start", "route_end") if getattr(cfg, n) is not None]:
            raise UserError(f"{' and '.join(given)} place a token route, but routing is off (--route-ratio 0); pass "
                            "--route-ratio (TREAD: 0.5) to route tokens, or drop the flag.")
        return
    cfg.route_start, cfg.route_end = route_span(cfg.model, latent_shape[-1], cfg.route_ratio, cfg.route_start,
                                                cfg.route_end, head=bool(cfg.head_depth))
    for column, flags in column_consumers(cfg):
        depth, flag = getattr(flags, column.depth), flag_name(column.depth)
        if depth > cfg.route_start:
            raise UserError(f"{flag} {depth} aligns the output of block {depth - 1} (counted from 0), which lies "
                            f"inside or after the token route {cfg.route_start}..{cfg.route_end}: there some tokens "
                            "are missing or carry an early block's values, so their alignment would be meaningless. "
                            f"The {column.name!r} column's block must come before the route: pass {flag} "
                            f"{cfg.route_start} or less, or start the route later (--route-start {depth}).")


def _check_objective(cfg: TrainConfig) -> None:
    """The objective and its training settings build (e.g. no flow-only setting on a ddpm run); fills them in."""
    from shared.generative.samplers import check_recorded

    objective = make_objective(cfg.objective, **cfg.objective_options)
    cfg.objective_options = training_args(objective)
    check_recorded(cfg.sampling, objective.family, f"--recipe {cfg.recipe}")
    recorded = {f.name for f in recorded_fields(OBJECTIVES[cfg.objective])}
    forward_mode = getattr(objective, "interval_time", False)  # its loss takes a forward-mode JVP (MeanFlow)
    if forward_mode and cfg.compile:
        raise SettingError(f"--compile cannot train the {objective.name} objective: its target is a forward-mode "
                           "Jacobian-vector product (torch.func.jvp) through the model, which torch.compile does not "
                           "trace reliably (reimplementations report a large slowdown or failure). Drop --compile.")
    if forward_mode and cfg.attention == "xformers":
        raise SettingError(f"--attention xformers cannot train the {objective.name} objective: xformers' kernels have "
                           "no forward-mode derivative, which its JVP target needs. Use --attention sdpa (the JVP runs "
                           "SDPA's math kernel, the loss's own forward the fused ones).")
    if cfg.time_dist_shift != 1.0 and "time_dist_shift" not in recorded:
        raise SettingError(f"{{time dist shift}} {cfg.time_dist_shift:g} applies to the flow objective only (it shifts "
                           f"its training times and sampling grid); the {cfg.objective} objective has no such shift. "
                           "Drop it, or train with {objective} flow.")


def _data_mismatch(saved: dict, current: dict, space: LatentSpace | None = None) -> str | None:
    """A sentence on how two latent folders differ, or None when they are the same data."""
    if "latent_space" not in saved:
        return ("the checkpoint records no latent space (it was written by an earlier version, before runs recorded "
                "one), so it cannot be checked against --latents; start a fresh run with a new --results-dir")
    for column in columns().values():
        was, now = saved.get(column.meta_key), current.get(column.meta_key)
        if was and was != now:
            diffs = column.describe_change(was, now or {})
            return (f"the checkpoint was trained with the {column.name!r} column ({column.what}) of "
                    f"{was.get('source')}, but --latents holds {'none' if not now else 'another'} "
                    f"({'; '.join(diffs[:4]) or 'another source'}); a run cannot change its target mid-run. Pass the "
                    f"original latent folder")
    for key in ("vae", "image_size", "latent_shape", "scaling_factor"):
        if saved.get(key) != current.get(key):
            return (f"the checkpoint was trained on latents with {key} {saved.get(key)!r}, but --latents has "
                    f"{current.get(key)!r} (another VAE or image size)")
    if saved.get("latent_space") != current.get("latent_space"):
        return (f"the checkpoint was trained on latents normalised as {saved.get('latent_norm')} (latent space "
                f"{str(saved.get('latent_space'))[:12]}), but this command gives {current.get('latent_norm')} (latent "
                f"space {str(current.get('latent_space'))[:12]}); the network learned the first, so the run cannot "
                f"continue on another. Pass the --latent-norm it was started with, and the latent folder whose "
                f"statistics it used")
    diffs = differences(saved, current, DATA_FIELDS, nested=False)
    return f"the latent folder differs from the checkpoint's ({', '.join(diffs)})" if diffs else None


def check_resume(saved: TrainConfig, current: TrainConfig, where: Path) -> list[str]:
    """UserError if the checkpoint at `where` belongs to a different experiment; returns allowed changes."""
    recorded, now = vars(saved), vars(current)
    refused = differences(recorded, now, IDENTITY_FIELDS, nested=False)
    if data := _data_mismatch(saved.data, current.data):
        refused.append(data)
    if refused:
        raise UserError(
            f"--results-dir {current.results_dir} holds a run that differs from this command ({'; '.join(refused)}; "
            f"checkpoint {where}). Rerun with the original settings to resume it, or pass a new --results-dir "
            "to start a separate run.")
    # "block" only names a preset; the options it resolves to are identity fields.
    skip = set(IDENTITY_FIELDS) | {"data", "results_dir", "resume", "dry_run", "debug", "latents", "image_size",
                                   "block", "init"}  # init: --init-from's record, restored from the checkpoint
    return differences(recorded, now, [f.name for f in fields(TrainConfig) if f.name not in skip], nested=False)
