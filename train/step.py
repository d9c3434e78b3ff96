"""The one training step: model, optimizer, EMA and the update over a list of micro-batches.

`python -m train`, `train.bench` and `train.plan --verify` all use `make_learner` and `train_step`. Precision is
handled here, not by Accelerate (which turns fp16 off on the CPU): autocast plus, for fp16, a GradScaler with fp32
master weights. The step never waits for the device: a non-finite step is skipped inside the fused AdamW
(`found_inf`) and the EMA masked by the same flag. `--compile` compiles each block on its own (one trace).
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Iterable

import torch

from shared.generative.objectives import Objective, objective_of
from shared.runtime.errors import UserError
from shared.network.attention import prepare_attention
from shared.network.models import ModelConfig, compile_blocks
from shared.network.routing import kept_tokens
from shared.runtime.precision import autocast_dtype
from train.config import TrainConfig, column_consumers


@dataclass
class Learner:
    """What one optimizer step reads and updates."""
    cfg: TrainConfig
    # what the step calls: the DiT (fp32, train mode) or a HeadedDiT with the columns' heads, maybe compiled/DDP-wrapped
    model: torch.nn.Module
    ema: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    model_config: ModelConfig
    objective: Objective  # shared/generative/objectives.py: time draws and the loss
    accelerator: object = None  # None: a single process without Accelerate (nothing to synchronise)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    route: tuple[int, int] | None = None  # token routing: (tokens T, kept K) per sample, drawn by the data side
    consumers: tuple = ()  # (ShardColumn, loss weight) of each column a head trains on (shared/datasets/columns.py)
    step: int = 0
    skipped_before: int = 0  # skipped steps counted on the host (restored from a checkpoint)
    skipped_since: torch.Tensor | None = None  # () int64 on the device: skipped steps since, never read per step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on non-finite gradients in the whole run (reads the device counter: a host sync)."""
        return self.skipped_before + (0 if self.skipped_since is None else int(self.skipped_since))

    @property
    def dit(self) -> torch.nn.Module:
        """The DiT in `model`, unwrapped: what checkpoints save, resume loads and the EMA follows."""
        inner = unwrap(self.model)
        return inner.dit if isinstance(inner, HeadedDiT) else inner

    @property
    def heads(self) -> torch.nn.ModuleDict:
        """{column: its head} trained with the model (no EMA; REPA's projector); empty without any."""
        inner = unwrap(self.model)
        return inner.heads if isinstance(inner, HeadedDiT) else torch.nn.ModuleDict()

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates and the gradient norm covers: the DiT, then the columns' heads."""
        return list(self.dit.parameters()) + list(self.heads.parameters())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under the DDP (`.module`) and torch.compile (`._orig_mod`) wrappers, in either order."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif "_orig_mod" in model._modules:  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


class HeadedDiT(torch.nn.Module):
    """The DiT and the shard columns' heads as one module, so compile and DDP see (and all-reduce) them all:
    forward(x, t, y, force_drop_ids) -> (DiT output (N, C', H, W), {column: its head on block `depth`'s tokens})."""

    def __init__(self, dit: torch.nn.Module, heads: dict, depth: int):
        super().__init__()
        self.dit, self.heads, self.depth = dit, torch.nn.ModuleDict(heads), depth

    def forward(self, x, t, y, force_drop_ids=None, route_keep=None):
        out, hidden = self.dit(x, t, y, force_drop_ids=force_drop_ids, return_hidden_at=self.depth,
                               route_keep=route_keep)  # (N, C', H, W), (N, T, D)
        return out, {name: head(hidden) for name, head in self.heads.items()}


def import_bitsandbytes():
    """bitsandbytes (for --optimizer adamw8bit) on a CUDA machine, or a UserError saying what to do."""
    if not torch.cuda.is_available():
        raise UserError("--optimizer adamw8bit needs a CUDA GPU (bitsandbytes kernels); use --optimizer adamw here.")
    try:
        import bitsandbytes
    except ImportError as err:
        raise UserError("--optimizer adamw8bit needs the optional bitsandbytes package: `pip install "
                        "bitsandbytes`, or use --optimizer adamw.") from err
    return bitsandbytes


def build_optimizer(cfg: TrainConfig, params, device: torch.device) -> torch.optim.Optimizer:
    """Fused AdamW where torch has it (else foreach), or bitsandbytes' 8-bit AdamW (Dettmers et al., 2022)."""
    params = [p for p in params if p.requires_grad]
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        return import_bitsandbytes().optim.AdamW8bit(params, **kwargs)  # ~2 bytes/param of moments, not 8
    if torch.device(device).type in ("cuda", "cpu"):  # where torch has the fused AdamW kernel (CPU since torch 2.4)
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, foreach=True, **kwargs)


COMPILE_BACKEND = "inductor"  # torch.compile's default; tests swap in a counting backend


def check_compile(cfg: TrainConfig, device) -> None:
    """UserError for --compile with xformers attention (opaque to dynamo) or, on the CPU, no C++ compiler."""
    if cfg.compile and cfg.attention == "xformers":
        raise UserError("--compile traces each transformer block into one graph, but --attention xformers calls a "
                        "kernel torch.compile cannot trace (a graph break in every block, so nothing is gained). "
                        "Use --attention sdpa (its flash/cuDNN kernels compile), or drop --compile.")
    if cfg.compile and torch.device(device).type == "cpu" and COMPILE_BACKEND == "inductor" and not cpp_compiler():
        raise UserError("--compile on the CPU needs a C++ compiler for torch.compile's inductor backend (it writes and "
                        "builds C++ kernels), and none was found (set CXX, or install g++ or clang++), or drop "
                        "--compile (the trainer runs the same step eagerly).")


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU ($CXX, else c++/g++/clang++ on PATH), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((found for name in names if (found := shutil.which(name))), None)


def make_learner(cfg: TrainConfig, model_config: ModelConfig, accelerator=None, device=None,
                 objective: Objective | None = None) -> Learner:
    """Model, EMA, optimizer and scaler on `device` (the accelerator's when given), compiled/wrapped as asked;
    objective: the run's (train.loop's plan holds it), None builds the one `model_config` records."""
    device = torch.device(accelerator.device if accelerator is not None else (device or "cpu"))
    check_compile(cfg, device)
    torch.manual_seed(cfg.seed)  # initialised identically on every rank
    # train mode: class dropout's coin comes from the data (force_drop_ids), never the model's global RNG
    raw = model_config.build(attention=cfg.attention, grad_checkpoint_every=cfg.grad_checkpoint).train()
    route = None  # (tokens T, kept K) per sample, drawn by the data side
    if cfg.route_ratio > 0:  # TREAD: blocks route_start..route_end see only the kept tokens in training
        raw.set_routing(cfg.route_start, cfg.route_end)
        route = raw.x_embedder.num_patches, kept_tokens(raw.x_embedder.num_patches, cfg.route_ratio)
    chosen = column_consumers(cfg)  # the columns trained on: their heads (after the DiT's init, same seeded stream)
    heads = {c.name: c.build_head(f, raw.pos_embed.shape[-1]).train() for c, f in chosen}
    depth = getattr(chosen[0][1], chosen[0][0].depth) if chosen else 0  # the block the heads see
    # The EMA: an uncompiled fp32 copy (previews run it eagerly in eval mode), on the GPU or the CPU (--ema-device)
    ema = copy.deepcopy(raw).float().requires_grad_(False).eval().to(device if cfg.ema_device == "gpu" else "cpu")
    raw.to(device)
    for head in heads.values():
        head.to(device)
    if device.type == "cuda":  # the SDPA kernel probed and pinned before the first forward (and before tracing)
        prepare_attention(raw, device, autocast_dtype(cfg.precision) or torch.float32)
    if cfg.compile:  # the checkpoint (full or selective) runs inside each block's forward: traced with it
        compile_blocks(raw, COMPILE_BACKEND)
    trained = HeadedDiT(raw, heads, depth) if heads else raw
    learner = Learner(cfg=cfg, model=accelerator.prepare(trained) if accelerator is not None else trained,
                      ema=ema, optimizer=None,
                      scaler=torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16"),
                      model_config=model_config, accelerator=accelerator, device=device,
                      objective=objective or objective_of(model_config, **cfg.objective_options), route=route,
                      consumers=tuple((c, getattr(f, c.weight)) for c, f in chosen))
    learner.optimizer = build_optimizer(cfg, learner.trained_parameters(), device)
    return learner


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for the optimizer step after `step` steps: linear warmup, then constant, or cosine/linear to final_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":  # RAE's scheduler type linear: base_lr -> final_lr
        return cfg.lr + (cfg.final_lr - cfg.lr) * progress
    return cfg.final_lr + (cfg.lr - cfg.final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast_context(device, precision: str):
    """torch.autocast for a device and precision name (shared/runtime/precision.py); a no-op context for fp32."""
    dtype = autocast_dtype(precision)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)


def forward_losses(model, objective, batch: dict, precision: str, device, consumers=()) -> dict:
    """{"loss"} (the micro-batch mean); with `consumers` ((ShardColumn, weight), ...) `model` is a HeadedDiT, whose one
    forward gives the output and each head's view of the block tokens, scored against the batch's stored column (REPA:
    Eq. 8 against batch["repr"]): then also {"diffusion", each head's}, and loss = diffusion + sum of weight x head."""
    device = torch.device(device)
    # x0 (B, C, h, w) fp32, already scaled; noise (B, C, h, w); t (B,) the objective's times
    x0, noise, t = (batch[key].to(device, non_blocking=True) for key in ("x0", "noise", "t"))
    kwargs = dict(y=batch["label"].to(device, non_blocking=True),  # (B,)
                  force_drop_ids=batch["drop"].to(device, non_blocking=True))  # (B,) class-dropout coin
    if "route_keep" in batch:  # token routing: every row routes, label-dropped ones too (as TREAD)
        kwargs["route_keep"] = batch["route_keep"].to(device, non_blocking=True)  # (B, K)
    captured = {}

    def model_fn(x, t, **kw):
        """The objective's view of a HeadedDiT: the output; the heads' outputs are kept aside."""
        out, captured["heads"] = model(x, t, **kw)  # (N, C', H, W), {column: head output}
        return out

    with autocast_context(device, precision):
        diffusion = objective.training_losses(model_fn if consumers else model, x0, t, noise,
                                              model_kwargs=kwargs)["loss"].mean()
    if not consumers:
        return {"loss": diffusion}
    heads = {c.loss_name or c.name: (w, c.loss(captured["heads"][c.name], batch[c.name].to(device, non_blocking=True))
                                     .mean()) for c, w in consumers}  # outside autocast: the losses in fp32
    total = diffusion + sum(w * value for w, value in heads.values())
    return {"loss": total, "diffusion": diffusion.detach(), **{k: v.detach() for k, (_, v) in heads.items()}}


def accumulate_gradients(learner: Learner, batches: Iterable[dict]) -> dict:
    """Forward/backward over the step's micro-batches; this rank's mean losses (detached): "loss"[, each head's]."""
    steps = learner.cfg.grad_accum_steps
    totals: dict[str, torch.Tensor] = {}
    micro = -1
    for micro, batch in enumerate(batches):
        local = micro < steps - 1 and learner.accelerator is not None  # DDP all-reduces on the last micro-step only
        with learner.accelerator.no_sync(learner.model) if local else contextlib.nullcontext():
            losses = forward_losses(learner.model, learner.objective, batch, learner.cfg.precision, learner.device,
                                    learner.consumers)
            learner.scaler.scale(losses["loss"] / steps).backward()
        for name, value in losses.items():
            totals[name] = totals.get(name, 0) + value.detach().float()
    assert micro + 1 == steps, f"a step needs {steps} micro-batches, got {micro + 1}"
    return {name: value / steps for name, value in totals.items()}


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float, skipped: torch.Tensor | None = None) -> None:
    """ema <- decay * ema + (1 - decay) * weights in fp32 (DiT's update_ema), left as it is where `skipped` is true."""
    ema_params = list(ema.parameters())
    device = ema_params[0].device
    src = [p.detach().to(device, torch.float32) for p in model.parameters()]
    if skipped is None:
        torch._foreach_mul_(ema_params, decay)
        torch._foreach_add_(ema_params, src, alpha=1 - decay)
        return
    skipped = skipped.to(device)
    keep = torch.where(skipped, 1.0, decay).to(torch.float32)  # () fp32: the decay, or 1 on a skipped step
    weight = torch.where(skipped, 0.0, 1 - decay).to(torch.float32)  # () fp32: 1 - decay, or 0
    torch._foreach_mul_(ema_params, keep)
    # ema + src * weight: on the CPU bitwise the add with alpha=1-decay above; the expanded weight costs no memory
    torch._foreach_addcmul_(ema_params, src, [weight.expand_as(p) for p in src])


def step_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """optimizer.step() unless `nonfinite` (a () bool device tensor), without a host sync where the kernel allows."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):  # not fused (bitsandbytes): a host sync
        if not bool(nonfinite):
            optimizer.step()
        return
    optimizer.grad_scale, optimizer.found_inf = None, nonfinite.to(torch.float32)  # GradScaler's protocol
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def apply_gradients(learner: Learner) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimizer step (or a skip on non-finite gradients), then the EMA -> (grad norm, skipped): () device tensors."""
    for group in learner.optimizer.param_groups:
        group["lr"] = lr_at(learner.step, learner.cfg)
    scaler, params = learner.scaler, learner.trained_parameters()
    scaler.unscale_(learner.optimizer)  # the global gradient norm, clipped to --max-grad-norm when that is > 0
    if learner.cfg.max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, learner.cfg.max_grad_norm)
    else:  # the same global 2-norm, without touching the grads
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in params
                                                          if p.grad is not None]))
    grad_norm = grad_norm.detach().float()
    if scaler.is_enabled():  # fp16: GradScaler's step and update; a skip is a scale that backed off
        before = scaler._get_scale_async().clone()  # the scale as a device tensor: get_scale() would sync
        scaler.step(learner.optimizer)  # skipped inside when the gradients hold inf/NaN (found_inf for fused kernels)
        scaler.update()
        skipped = scaler._get_scale_async() < before
    else:
        skipped = ~torch.isfinite(grad_norm)
        step_unless(learner.optimizer, skipped)
    learner.optimizer.zero_grad(set_to_none=True)
    update_ema(learner.ema, learner.dit, learner.cfg.ema_decay, skipped)
    return grad_norm, skipped


def train_step(learner: Learner, batches: Iterable[dict]) -> dict:
    """One optimizer step over a global batch -> {loss (mean over processes), grad_norm, skipped[, diffusion_loss,
    each head's as NAME_loss (repa_loss)]}, each a () device tensor: the loop reads them at its log points."""
    local = accumulate_gradients(learner, batches)
    grad_norm, skipped = apply_gradients(learner)
    acc = learner.accelerator
    losses = {k: acc.reduce(v, reduction="mean") if acc is not None else v for k, v in local.items()}  # all ranks
    learner.step += 1
    flag = skipped.to(torch.int64)  # the device counter Learner.skipped_steps reads
    learner.skipped_since = flag if learner.skipped_since is None else learner.skipped_since + flag
    return {"loss": losses.pop("loss"), "grad_norm": grad_norm, "skipped": skipped,
            **{f"{name}_loss": value for name, value in losses.items()}}  # logged beside the loss
