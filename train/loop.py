"""The DiT training loop over cached latents: setup, resume, the step, EMA, guards, checkpoints, logs.

Precision is handled here rather than by Accelerate's mixed_precision switch: torch.autocast (fp16 or
bf16) plus, for fp16, a torch.amp.GradScaler with fp32 master weights. Accelerate turns fp16 off on the
CPU; doing it ourselves makes the fp16 path (scaling, skipped steps, the non-finite guard) run and be
tested identically on CPU and CUDA. Accelerate provides the processes, DDP wrapping, `no_sync` for the
non-final micro-steps of gradient accumulation, and the cross-process reductions.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from shared.diffusion import create_diffusion
from shared.errors import UserError
from shared import export as layout
from shared.export import save_weights
from shared.models import ModelConfig, resolve_attention
from shared.precision import autocast_dtype
from shared.shards import LatentDataset
from train import checkpoint as ckpt_io
from train.config import DEBUG_STEPS, TrainConfig, check_resume, resolve_config
from train.data import make_loader
from train.logger import RunLogger
from train.preview import save_preview, sample_preview

TRACE_ENV = "DIT_TRAIN_TRACE"  # a folder: each rank writes rank-<r>.json (data it saw, modules, weight hash)


class NonFiniteError(UserError):
    """Training produced too many consecutive non-finite losses or gradient norms."""


@dataclass
class Run:
    """Everything the loop needs, built once by setup_run."""

    cfg: TrainConfig
    accelerator: object
    dataset: LatentDataset
    raw: torch.nn.Module  # the unwrapped DiT (fp32 master weights)
    model: torch.nn.Module  # what the step calls: maybe compiled, maybe DDP-wrapped
    ema: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    logger: RunLogger
    model_config: ModelConfig
    step: int = 0
    skipped_steps: int = 0
    nonfinite_streak: int = 0
    last_checkpoint: Path | None = None
    trace: dict | None = None
    diffusion: object = field(default_factory=create_diffusion)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


# ---------------------------------------------------------------------------------------------------------
# Inputs, resume source, config (cheap; before any model exists)
# ---------------------------------------------------------------------------------------------------------

def open_latents(path: str) -> LatentDataset:
    """The latent folder's dataset; shared.shards raises a UserError for missing or half-written folders."""
    return LatentDataset(path)


def resume_source(cfg: TrainConfig) -> tuple[Path | None, list[str]]:
    """(checkpoint to continue from or None, allowed config changes), after checking it is this experiment."""
    run_dir = Path(cfg.results_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--results-dir {run_dir} is a file; pass a folder (it is created if missing).")
    if cfg.resume == "none":
        if layout.list_checkpoints(run_dir):
            raise UserError(f"--resume none, but {run_dir} already holds checkpoints; pass --resume auto to "
                            "continue that run, or a new --results-dir to start another.")
        return None, []
    source = layout.latest_checkpoint(run_dir) if cfg.resume == "auto" else Path(cfg.resume)
    if source is None:
        return None, []
    saved = TrainConfig.from_dict(ckpt_io.read_state(source)["config"])
    return source, check_resume(saved, cfg, source)


def prepare_config(cfg: TrainConfig) -> tuple[TrainConfig, LatentDataset, Path | None, list[str]]:
    """Open the latents, resolve and check the config, find the resume source: all before allocation."""
    dataset = open_latents(cfg.latents)
    resolve_config(cfg, dataset)
    resolve_attention(cfg.attention)
    if cfg.attention == "xformers" and not torch.cuda.is_available():
        raise UserError("--attention xformers needs a CUDA GPU; this machine has none. Use --attention sdpa.")
    if cfg.optimizer == "adamw8bit":
        _import_bitsandbytes()
    if cfg.debug:
        cfg.log_every = 1
    return cfg, dataset, *resume_source(cfg)


# ---------------------------------------------------------------------------------------------------------
# Building the pieces
# ---------------------------------------------------------------------------------------------------------

def make_accelerator():
    """One Accelerator per process (DDP, devices, reductions); precision is handled by this module."""
    from accelerate import Accelerator

    return Accelerator(mixed_precision="no")


def setup_backends(cfg: TrainConfig, device: torch.device) -> None:
    """TF32 matmuls on CUDA (DiT issue #22: 0.51 -> 0.81 steps/s on A100); anomaly detection in --debug."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.autograd.set_detect_anomaly(cfg.debug)


def seed_globals(seed: int, rank: int) -> None:
    """Seed python, numpy and torch per rank (the training draws themselves are keyed by stream position)."""
    random.seed(seed * 1009 + rank)
    np.random.seed((seed * 1009 + rank) % 2**32)
    torch.manual_seed(seed * 1009 + rank)


def build_model(cfg: TrainConfig, dataset: LatentDataset) -> tuple[torch.nn.Module, ModelConfig]:
    """The DiT for these latents, initialised identically on every rank (seeded by --seed)."""
    channels, size, _ = dataset.latent_shape
    model_config = ModelConfig(model=cfg.model, input_size=size, in_channels=channels,
                               num_classes=dataset.num_classes, class_dropout_prob=cfg.class_dropout_prob)
    torch.manual_seed(cfg.seed)
    model = model_config.build(attention=cfg.attention, grad_checkpoint_every=cfg.grad_checkpoint)
    # Class dropout is drawn per sample in train.data (reproducible for any batch split), and the labels
    # arrive already replaced by the null class; eval mode turns off the model's own global-RNG dropout,
    # the only thing train/eval mode changes in a DiT.
    return model.eval(), model_config


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused kernel on CUDA, foreach on CPU) or bitsandbytes' 8-bit AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        return _adamw8bit(params, kwargs, device)
    if device.type == "cuda":
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, foreach=True, **kwargs)


def _import_bitsandbytes():
    """bitsandbytes (for --optimizer adamw8bit) on a CUDA machine, or a UserError saying what to do."""
    if not torch.cuda.is_available():
        raise UserError("--optimizer adamw8bit needs a CUDA GPU (bitsandbytes kernels); use --optimizer adamw here.")
    try:
        import bitsandbytes
    except ImportError as err:
        raise UserError("--optimizer adamw8bit needs the optional bitsandbytes package: `pip install "
                        "bitsandbytes`, or use --optimizer adamw.") from err
    return bitsandbytes


def _adamw8bit(params, kwargs, device):
    """bitsandbytes' AdamW8bit: 8-bit moments (Dettmers et al., 2022), ~2 bytes/param instead of 8."""
    return _import_bitsandbytes().optim.AdamW8bit(params, **kwargs)


def build_ema(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """An fp32 copy of the model for the EMA, on the training device or the CPU (--ema-device)."""
    ema = copy.deepcopy(model).float().requires_grad_(False).eval()
    return ema.to(device if cfg.ema_device == "gpu" else "cpu")


def restore(run: Run, source: Path) -> None:
    """Load weights, EMA, optimizer, scaler, this rank's RNG and the step from a checkpoint."""
    saved = ckpt_io.load_checkpoint(source, run.accelerator.process_index)
    run.raw.load_state_dict(saved["model"], strict=True)
    run.ema.load_state_dict(saved["ema"], strict=True)
    run.optimizer.load_state_dict(saved["optimizer"])
    if run.scaler.is_enabled() and saved["scaler"]:
        run.scaler.load_state_dict(saved["scaler"])
    if saved["rng"] is not None:
        ckpt_io.restore_rng(saved["rng"])
    state = saved["state"]
    run.step, run.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
    run.last_checkpoint = source


def setup_run(cfg: TrainConfig, dataset: LatentDataset, source: Path | None) -> Run:
    """Build model, EMA, optimizer and scaler on this process's device; restore from `source` if given."""
    accelerator = make_accelerator()
    device = accelerator.device
    setup_backends(cfg, device)
    raw, model_config = build_model(cfg, dataset)
    ema = build_ema(raw, cfg, device)
    seed_globals(cfg.seed, accelerator.process_index)
    raw.to(device)
    optimizer = build_optimizer(cfg, raw, device)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.mixed_precision == "fp16")
    logger = RunLogger(Path(cfg.results_dir), enabled=accelerator.is_main_process, write_files=not cfg.debug)
    run = Run(cfg=cfg, accelerator=accelerator, dataset=dataset, raw=raw, model=raw, ema=ema, optimizer=optimizer,
              scaler=scaler, logger=logger, model_config=model_config)
    if source is not None:
        restore(run, source)
    compiled = torch.compile(raw) if cfg.compile else raw
    run.model = accelerator.prepare(compiled)
    if os.environ.get(TRACE_ENV):
        run.trace = {"positions": [], "indices": [], "allreduce_calls": []}
        _count_allreduces(run)
    return run


def _count_allreduces(run: Run) -> None:
    """Trace mode: count DDP gradient all-reduces per micro-step (the test checks no_sync skips them)."""
    if not isinstance(run.model, torch.nn.parallel.DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_hook(state, bucket):
        run.trace["allreduce_pending"] = run.trace.get("allreduce_pending", 0) + 1
        return allreduce_hook(state, bucket)

    run.model.register_comm_hook(None, counting_hook)


# ---------------------------------------------------------------------------------------------------------
# One optimizer step
# ---------------------------------------------------------------------------------------------------------

def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for the optimizer step after `step` steps: linear warmup, then constant or cosine to 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def forward_loss(run: Run, batch: dict) -> torch.Tensor:
    """Mean L_hybrid (IDDPM Eq. 16) of one micro-batch, under autocast when mixed precision is on."""
    device = run.device
    x0 = batch["x0"].to(device, non_blocking=True)  # (B, C, h, w) fp32
    noise = batch["noise"].to(device, non_blocking=True)
    t = batch["t"].to(device, non_blocking=True)  # (B,)
    y = torch.where(batch["drop"], run.raw.null_label, batch["label"]).to(device, non_blocking=True)  # (B,)
    dtype = autocast_dtype(run.cfg.mixed_precision)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        losses = run.diffusion.training_losses(run.model, x0, t, model_kwargs=dict(y=y), noise=noise)
    return losses["loss"].mean()


def accumulate_gradients(run: Run, loader) -> torch.Tensor:
    """Forward/backward over the accumulation micro-batches; returns this rank's mean loss (detached)."""
    steps = run.cfg.grad_accum_steps
    total = torch.zeros((), device=run.device)
    for micro in range(steps):
        batch = next(loader)
        if run.trace is not None:
            run.trace["positions"] += batch["position"].tolist()
            run.trace["indices"] += batch["index"].tolist()
        # Only the last micro-step all-reduces gradients; the others accumulate locally (DDP no_sync).
        sync = micro == steps - 1
        with contextlib.nullcontext() if sync else run.accelerator.no_sync(run.model):
            loss = forward_loss(run, batch)
            run.scaler.scale(loss / steps).backward()
        total += loss.detach().float()
        if run.trace is not None:
            run.trace["allreduce_calls"].append(run.trace.pop("allreduce_pending", 0))
    return total / steps


def clip_or_measure(run: Run) -> torch.Tensor:
    """Global gradient norm (after unscaling), clipped to --max-grad-norm when that is > 0."""
    run.scaler.unscale_(run.optimizer)
    if run.cfg.max_grad_norm > 0:
        return torch.nn.utils.clip_grad_norm_(run.raw.parameters(), run.cfg.max_grad_norm)
    norms = [p.grad.detach().float().norm() for p in run.raw.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms))  # the same global 2-norm, without touching the grads


def apply_gradients(run: Run) -> tuple[float, bool]:
    """Optimizer step (or a counted skip on non-finite gradients) -> (grad norm, skipped)."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(run.step, run.cfg)
    grad_norm = float(clip_or_measure(run))
    if run.scaler.is_enabled():
        scale = run.scaler.get_scale()
        run.scaler.step(run.optimizer)  # skipped inside when the gradients hold inf/NaN
        run.scaler.update()
        skipped = run.scaler.get_scale() < scale
    else:
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if not skipped:
        update_ema(run.ema, run.raw, run.cfg.ema_decay)
    return grad_norm, skipped


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * weights, in fp32 on the EMA's device (as DiT's update_ema)."""
    ema_params = list(ema.parameters())
    device = ema_params[0].device
    src = [p.detach().to(device, torch.float32) for p in model.parameters()]
    torch._foreach_mul_(ema_params, decay)
    torch._foreach_add_(ema_params, src, alpha=1 - decay)


def train_step(run: Run, loader) -> dict:
    """One optimizer step over a global batch -> {loss (mean over processes), grad_norm, skipped}."""
    local = accumulate_gradients(run, loader)
    grad_norm, skipped = apply_gradients(run)
    loss = run.accelerator.reduce(local, reduction="mean")  # the same value on every rank
    run.step += 1
    run.skipped_steps += int(skipped)
    return {"loss": float(loss), "grad_norm": grad_norm, "skipped": skipped}


# ---------------------------------------------------------------------------------------------------------
# Guards, checkpoints, previews, logs
# ---------------------------------------------------------------------------------------------------------

def guard_nonfinite(run: Run, result: dict) -> None:
    """Count consecutive non-finite steps; stop with advice after --max-nonfinite of them."""
    if math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"]):
        run.nonfinite_streak = 0
        return
    run.nonfinite_streak += 1
    limit = run.cfg.max_nonfinite
    if limit and run.nonfinite_streak >= limit:
        raise NonFiniteError(_nonfinite_message(run))


def _nonfinite_message(run: Run) -> str:
    """Why the run stopped, likely causes, and where the last good state is."""
    last = run.last_checkpoint or "none yet (the run never reached a checkpoint)"
    precision = ("fp16 overflow: switch to --mixed-precision bf16, or lower --lr" if run.cfg.mixed_precision == "fp16"
                 else "a learning rate too high for this model/batch: lower --lr or add --warmup-steps / --max-grad-norm")
    return (f"training stopped at step {run.step}: {run.nonfinite_streak} consecutive steps had a non-finite loss or "
            f"gradient norm (weights were not updated on those steps). Likely causes: {precision}; or bad latents "
            f"(NaN/inf moments: re-extract, or check the folder with a verifying reader). The last good checkpoint "
            f"is {last}; rerun the same command with the changed flags (--mixed-precision, --lr, --warmup-steps, "
            "--max-grad-norm may change on resume) and it continues from there.")


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (a non-finite checkpoint is never written)."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def save_checkpoint(run: Run) -> Path | None:
    """Write the full state (all ranks take part), the EMA export, and prune old checkpoints."""
    if run.cfg.debug:
        return None
    if not (weights_finite(run.raw) and weights_finite(run.ema)):
        raise NonFiniteError(f"the weights became non-finite at step {run.step}; no checkpoint was written. "
                             + _nonfinite_message(run))
    acc, run_dir = run.accelerator, Path(run.cfg.results_dir)
    tmp = ckpt_io.staging_path(run_dir, run.step)
    if run.is_main:
        ckpt_io.make_staging(tmp)
    acc.wait_for_everyone()
    ckpt_io.save_rank_state(tmp, acc.process_index)
    acc.wait_for_everyone()
    if run.is_main:
        _write_main(run, tmp, run_dir)
    acc.wait_for_everyone()
    run.last_checkpoint = run_dir / layout.CHECKPOINTS / layout.checkpoint_name(run.step)
    return run.last_checkpoint


def _write_main(run: Run, tmp: Path, run_dir: Path) -> None:
    """Main process part of a checkpoint: weights, optimizer, scaler, state.json, publish, export, prune."""
    latent_meta = run.dataset.latent_meta()
    state = {"step": run.step, "data_position": run.step * run.cfg.global_batch_size,
             "world_size": run.cfg.world_size, "skipped_steps": run.skipped_steps,
             "lr": lr_at(max(run.step - 1, 0), run.cfg), "config": run.cfg.to_dict()}
    ema_state = run.ema.state_dict()
    ckpt_io.save_main_state(tmp, model_state=run.raw.state_dict(), ema_state=ema_state,
                            model_config=run.model_config, latent_meta=latent_meta,
                            optimizer_state=run.optimizer.state_dict(), scaler_state=run.scaler.state_dict(),
                            state=state)
    final = ckpt_io.publish(tmp, run_dir, run.step)
    save_weights(layout.export_path(run_dir, run.step), ema_state, run.model_config, latent_meta, run.step)
    pruned = ckpt_io.prune_checkpoints(run_dir, run.cfg.keep_last)
    run.logger.info(f"saved checkpoint {final}" + (f" (removed {', '.join(p.name for p in pruned)})" if pruned else ""))


def save_samples(run: Run) -> None:
    """Main process: EMA preview latents -> RUN/samples/step-X.safetensors (others wait)."""
    if run.is_main and not run.cfg.debug:
        ema, home = run.ema, next(run.ema.parameters()).device
        ema.to(run.device)  # an EMA kept on the CPU visits the GPU for sampling (exact fp32 round trip)
        try:
            latents, labels = sample_preview(ema, run.dataset.latent_shape, run.cfg.sample_steps,
                                             run.cfg.sample_cfg_scale, run.device)
        finally:
            ema.to(home)
        path = Path(run.cfg.results_dir) / "samples" / f"{layout.checkpoint_name(run.step)}.safetensors"
        save_preview(path, latents, labels, run.dataset.latent_meta(), run.step)
        run.logger.info(f"saved samples {path}")
    run.accelerator.wait_for_everyone()


class Meter:
    """Averages step results over a logging window and measures speed."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.losses, self.norms, self.skipped, self.start = [], [], 0, time.perf_counter()

    def add(self, result: dict) -> None:
        """Record one step's result."""
        self.losses.append(result["loss"])
        self.norms.append(result["grad_norm"])
        self.skipped += int(result["skipped"])

    def summary(self, run: Run) -> dict:
        """Metrics of the window; resets it."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        steps = len(self.losses)
        values = {
            "loss": float(np.mean(self.losses)), "lr": lr_at(run.step - 1, run.cfg),
            "grad_norm": float(np.mean(self.norms)), "steps_per_s": steps / seconds,
            "images_per_s": steps * run.cfg.global_batch_size / seconds, "skipped": self.skipped,
            "skipped_total": run.skipped_steps, "epoch": run.step * run.cfg.global_batch_size / len(run.dataset),
        }
        if run.scaler.is_enabled():
            values["loss_scale"] = run.scaler.get_scale()
        if run.device.type == "cuda":
            values["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
        self.reset()
        return values


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------

def start_logs(run: Run, source: Path | None, changes: list[str]) -> None:
    """config.json, the resume note, and metrics truncated to the resumed step (main process)."""
    run_dir = Path(run.cfg.results_dir)
    if run.is_main and not run.cfg.debug:
        run_dir.mkdir(parents=True, exist_ok=True)
        removed = ckpt_io.remove_partial(run_dir)
        (run_dir / "config.json").write_text(run.cfg.to_json() + "\n")
        run.logger.truncate_after(run.step)
        for path in removed:
            run.logger.info(f"removed a half-written checkpoint {path.name} left by an interrupted run")
        if source is not None and not layout.export_path(run_dir, run.step).is_file():
            # A kill between publishing a checkpoint and writing its export: write the export now.
            save_weights(layout.export_path(run_dir, run.step), run.ema.state_dict(), run.model_config,
                         run.dataset.latent_meta(), run.step)
    run.accelerator.wait_for_everyone()
    n = run.accelerator.num_processes
    where = f"resumed from {source} at step {run.step}" if source else "starting a new run"
    run.logger.info(f"{where}: {run.cfg.model}, {sum(p.numel() for p in run.raw.parameters()):,} parameters, "
                    f"{n} process(es) on {run.device}, global batch {run.cfg.global_batch_size} = "
                    f"{run.cfg.micro_batch_size} x {run.cfg.grad_accum_steps} accumulation x {n}, "
                    f"precision {run.cfg.mixed_precision}, {run.cfg.total_steps} steps")
    for change in changes:
        run.logger.info(f"changed on resume: {change}")


def _due(step: int, every: int) -> bool:
    """Whether a periodic action is due after `step` steps."""
    return every > 0 and step % every == 0


def run_loop(run: Run, source: Path | None) -> dict:
    """Train until total_steps; checkpoint, preview and log along the way; return the last metrics."""
    cfg = run.cfg
    total = min(cfg.total_steps, run.step + DEBUG_STEPS) if cfg.debug else cfg.total_steps
    loader = make_loader(run.dataset, micro_batch=cfg.micro_batch_size, rank=run.accelerator.process_index,
                         world_size=run.accelerator.num_processes, seed=cfg.seed,
                         start=run.step * cfg.global_batch_size, class_dropout_prob=cfg.class_dropout_prob,
                         num_workers=cfg.num_workers, pin_memory=run.device.type == "cuda")
    meter, last = Meter(), {}
    bar = tqdm(total=total, initial=run.step, desc="train", unit="step", disable=not run.is_main, dynamic_ncols=True)
    with bar:
        while run.step < total:
            result = train_step(run, loader)
            meter.add(result)
            bar.update(1)
            bar.set_postfix(loss=f"{result['loss']:.4f}", skipped=run.skipped_steps)
            guard_nonfinite(run, result)
            if _due(run.step, cfg.log_every) or run.step == total:
                last = meter.summary(run)
                run.logger.metrics(run.step, last)
            if _due(run.step, cfg.sample_every):
                save_samples(run)
            if _due(run.step, cfg.ckpt_every) or run.step == total:
                save_checkpoint(run)
    return last


def write_trace(run: Run) -> None:
    """Test hook ($DIT_TRAIN_TRACE): what this rank saw, whether diffusers got imported, a weight hash."""
    folder = os.environ.get(TRACE_ENV)
    if not folder or run.trace is None:
        return
    digest = hashlib.sha256()
    for name, tensor in sorted(run.raw.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    record = {**run.trace, "rank": run.accelerator.process_index, "world_size": run.accelerator.num_processes,
              "step": run.step, "weights_sha256": digest.hexdigest(),
              "diffusers_imported": "diffusers" in sys.modules}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"rank-{run.accelerator.process_index}.json").write_text(json.dumps(record))


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) a training run described by cfg; returns the last logged metrics."""
    cfg, dataset, source, changes = prepare_config(cfg)
    if cfg.dry_run or cfg.debug:
        if int(os.environ.get("RANK", 0)) == 0:
            print(cfg.to_json())
        if cfg.dry_run:
            return {}
    run = setup_run(cfg, dataset, source)
    try:
        start_logs(run, source, changes)
        last = run_loop(run, source)
        write_trace(run)
        run.logger.info(f"done: step {run.step}, last checkpoint {run.last_checkpoint}")
        return last
    finally:
        run.logger.close()
