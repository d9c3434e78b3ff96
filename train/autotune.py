"""`auto` for --micro-batch-size, --precision and --grad-checkpoint: the fastest setting that fits this device.

Precision: the accelerate config's (train/launcher.py), else bf16 on GPUs that have it, fp16 + GradScaler on older
ones, fp32 on the CPU. Micro-batch and checkpointing: train.plan's answer for this GPU's free memory, preferring the
least recomputation that still runs FAST_MICRO (or the whole per-process batch); then real steps at that micro-batch
must fit under an allocator cap of free memory minus the margin, else the next smaller micro-batch is tried (said in
one line). Accumulation keeps the global batch. On the CPU: the whole per-process batch, no checkpointing.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from shared.runtime.errors import UserError
from shared.network.blocks import SELECTIVE
from shared.network.models import ModelConfig
from train import memory
from train.launcher import resolve_precision_with_launcher
from train.units import format_size, parse_size

AUTO = "auto"
CHECKPOINT_ORDER = (0, 4, 2, 1)  # intervals tried, least recomputation first (0 = off, k = every k-th block)
# A micro-batch this large keeps a GPU's matmuls busy; a smaller one is taken only when nothing larger fits.
FAST_MICRO = 16
CONFIRM_TRIES = 4  # smaller micro-batches tried when the real step does not fit
OUT_OF_MEMORY = -1  # a confirmation try's recorded peak when its step ran out of memory
AUTO_FIELDS = ("micro_batch_size", "precision", "grad_checkpoint")  # the settings auto may stand for


@dataclass
class DeviceInfo:
    """What auto needs to know of the training device."""
    type: str                        # "cuda", "cpu", ...
    name: str = ""
    free_memory: int | None = None   # bytes free now (torch.cuda.mem_get_info), None off CUDA
    total_memory: int | None = None
    bf16: bool = False               # bf16 tensor cores (Ampere and newer)


def probe_device(device) -> DeviceInfo:
    """The training device's type, free memory and bf16 support (the seam tests replace)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceInfo(type=device.type, name=device.type)
    free, total = torch.cuda.mem_get_info(device)
    return DeviceInfo(type="cuda", name=torch.cuda.get_device_name(device), free_memory=int(free),
                      total_memory=int(total), bf16=bool(torch.cuda.is_bf16_supported()))


def auto_precision(info: DeviceInfo) -> str:
    """bf16 where the GPU has it, fp16 (with GradScaler) on older GPUs, fp32 elsewhere."""
    return "fp32" if info.type != "cuda" else ("bf16" if info.bf16 else "fp16")


def smaller_micro(micro: int, per_process: int) -> int | None:
    """The next smaller divisor of the per-process batch, or None below 1."""
    return next((m for m in range(micro - 1, 0, -1) if per_process % m == 0), None)


def measure_peak(cfg, model_config: ModelConfig, micro: int, every: int, accumulation: int, budget: int) -> int | None:
    """Peak CUDA bytes of real steps at this micro-batch capped at `budget`; None off CUDA; StepOutOfMemory."""
    if not memory.allocator().available():
        return None
    row = SimpleNamespace(micro=micro, accumulation=accumulation, profile=SimpleNamespace(every=every))
    return memory.verify_step(model_config, cfg, row, budget=budget).peak


def confirm(cfg, model_config, row, per_process: int, budget: int, measure: Callable) -> tuple[int, list]:
    """(micro-batch, tries): step down, saying so, while a real step does not fit the budget."""
    micro, tries = row.micro, []
    for _ in range(CONFIRM_TRIES):
        try:
            peak = measure(cfg, model_config, micro, row.profile.every, per_process // micro, budget)
        except memory.StepOutOfMemory:  # raised after the failed step's learner is gone: the next try starts clean
            peak = OUT_OF_MEMORY
        tries.append({"micro": micro, "peak": peak})
        if peak is None or 0 <= peak <= budget:
            return micro, tries
        if (smaller := smaller_micro(micro, per_process)) is None:
            break
        outcome = "ran out of memory" if peak == OUT_OF_MEMORY else f"peaked at {format_size(peak)}"
        print(f"auto: micro-batch {micro} {outcome} in a real step under the {format_size(budget)} budget; "
              f"trying micro-batch {smaller}", file=sys.stderr, flush=True)  # before the run's log exists
        micro = smaller
    raise UserError(
        f"even micro-batch {tries[-1]['micro']} of {cfg.model} with checkpointing every {row.profile.every} "
        f"block(s) did not fit the {format_size(budget)} left on this GPU after the margin (real steps measured: "
        f"{_tries_text(tries)}). Free the GPU (another process may hold memory), or pass --grad-checkpoint 1, "
        "--optimizer adamw8bit or --ema-device cpu, or an explicit --micro-batch-size.")


def _tries_text(tries: list) -> str:
    """'8: 23.1 GiB, 4: out of memory' for the refusal."""
    return ", ".join(f"{t['micro']}: " + (format_size(t["peak"]) if t["peak"] != OUT_OF_MEMORY else "out of memory")
                     for t in tries)


def resolve_auto(cfg, model_config: ModelConfig, info: DeviceInfo, world_size: int,
                 measure: Callable = measure_peak) -> dict:
    """Replace every 'auto' in cfg by a value for this device; returns (and stores in cfg.autotune) the record."""
    requested = {k: getattr(cfg, k) for k in AUTO_FIELDS}
    cfg.precision = resolve_precision_with_launcher(cfg.precision)
    if cfg.precision == AUTO:
        cfg.precision = auto_precision(info)
    record = {"requested": requested, "device": asdict(info)}
    if AUTO in (cfg.micro_batch_size, cfg.grad_checkpoint):
        if info.type == "cuda" and info.free_memory is not None:
            record.update(_plan_on_gpu(cfg, model_config, info, world_size, measure))
        else:  # nothing to plan against: the per-process batch at once, no recomputation (as on any CPU run)
            cfg.micro_batch_size = None if cfg.micro_batch_size == AUTO else cfg.micro_batch_size
            cfg.grad_checkpoint = 0 if cfg.grad_checkpoint == AUTO else cfg.grad_checkpoint
    record["resolved"] = {k: getattr(cfg, k) for k in AUTO_FIELDS}
    cfg.autotune = record if requested != record["resolved"] else {}
    return cfg.autotune


def _plan_on_gpu(cfg, model_config, info: DeviceInfo, world_size: int, measure: Callable) -> dict:
    """Plan (and confirm) micro-batch and checkpointing on a GPU; sets them on cfg; returns what to record."""
    per_process = cfg.global_batch_size // world_size  # divisibility is checked by resolve_config
    margin = parse_size(memory.DEFAULT_MARGIN)
    budget = info.free_memory - margin
    depth = len(model_config.build(device="meta").blocks)
    every = cfg.grad_checkpoint  # the interval asked for, or auto: those of CHECKPOINT_ORDER within the depth
    choices = ([k for k in CHECKPOINT_ORDER if k <= depth] if every == AUTO
               else [every if every == SELECTIVE else int(every)])
    route = (cfg.route_ratio, cfg.route_start, cfg.route_end) if cfg.route_ratio > 0 else None
    profiles, n_params, n_trainable = memory.measure_profiles(model_config, cfg.precision, choices,
                                                              memory.measure_device("auto"), route)  # as plan does
    fixed = memory.fixed_state(n_params, n_trainable, cfg.optimizer, cfg.ema_device).total
    rows = [memory.plan_row(p, fixed, budget, per_process) for p in profiles]
    explicit = cfg.micro_batch_size != AUTO
    if explicit:  # the least recomputation that fits the given micro-batch
        rows = [r for r in rows if r.micro is not None and r.micro >= int(cfg.micro_batch_size)]
        row = rows[0] if rows else None
    else:  # the least recomputation (rows come so ordered) whose micro-batch is fast enough; else the largest
        fitting = [r for r in rows if r.micro is not None]
        fast = [r for r in fitting if r.micro >= min(per_process, FAST_MICRO)]
        row = fast[0] if fast else max(fitting, key=lambda r: (r.micro, -r.profile.every), default=None)
    if row is None:  # not even micro-batch 1 fits the plan
        raise UserError(
            f"{cfg.model} does not fit on {info.name or 'this GPU'} with {format_size(info.free_memory)} free "
            f"({format_size(budget)} after the margin) at any micro-batch, even with checkpointing every block: the "
            "weights, gradients, AdamW moments and EMA alone are too large. Pass --optimizer adamw8bit and/or "
            "--ema-device cpu, free the GPU, or use a smaller preset (`python -m train.plan` shows the budget).")
    record = {"margin": margin, "budget": budget,
              "plan": [{"grad_checkpoint": r.profile.every, "micro": r.micro, "predicted_peak": r.peak} for r in rows]}
    if not explicit:
        cfg.micro_batch_size, tries = confirm(cfg, model_config, row, per_process, budget, measure)
        record.update(predicted_peak=row.peak, confirmed=tries)
    cfg.grad_checkpoint = row.profile.every
    return record


def describe(record: dict) -> str:
    """One log line: what auto chose and why."""
    if not record:
        return ""
    r, device = record["resolved"], record["device"]
    where = device["name"] or device["type"]
    if device.get("free_memory") is not None:
        where += f", {format_size(device['free_memory'])} free"
    text = (f"auto ({where}): precision {r['precision']}, micro-batch {r['micro_batch_size'] or 'whole batch'}, "
            f"grad checkpoint {r['grad_checkpoint']}")
    if record.get("predicted_peak") is not None:
        measured = record["confirmed"][-1]["peak"]
        text += (f" (planned peak {format_size(record['predicted_peak'])}, budget {format_size(record['budget'])}"
                 + (f", measured {format_size(measured)}" if measured and measured > 0 else "")
                 + (f"; stepped down from micro-batch {record['confirmed'][0]['micro']}: "
                    f"{_tries_text(record['confirmed'][:-1])})" if len(record["confirmed"]) > 1 else ")"))
    return text


def no_measurement(*_args) -> None:
    """measure for --dry-run: the plan alone, no real step."""


def resolve_auto_for(cfg, model_config: ModelConfig, accelerator) -> dict:
    """resolve_auto on every process: rank 0 decides for the smallest free memory, all follow (DDP needs one plan)."""
    info = probe_device(accelerator.device)
    measure = no_measurement if cfg.dry_run else measure_peak
    if accelerator.num_processes == 1:
        return resolve_auto(cfg, model_config, info, 1, measure)
    from accelerate.utils import broadcast_object_list, gather_object

    frees = [f for f in gather_object([info.free_memory]) if f is not None]
    if info.free_memory is not None and frees:
        info.free_memory = min(frees)  # the tightest card decides
    outcome = None
    if accelerator.is_main_process:
        try:
            resolve_auto(cfg, model_config, info, accelerator.num_processes, measure)
            outcome = (cfg.micro_batch_size, cfg.precision, cfg.grad_checkpoint, cfg.autotune)
        except UserError as err:
            outcome = err
    outcome = broadcast_object_list([outcome], from_process=0)[0]
    if isinstance(outcome, UserError):
        if accelerator.is_main_process:
            raise outcome
        raise SystemExit(2)  # rank 0 prints the paragraph
    cfg.micro_batch_size, cfg.precision, cfg.grad_checkpoint, cfg.autotune = outcome
    return cfg.autotune
