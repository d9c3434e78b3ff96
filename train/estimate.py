"""Before a run builds anything on a CPU: what one step will cost, from the model's FLOPs and this machine's rate.

DiT-XL/2 at global batch 256 is 256 x 6 x 118.6 GMAC = 182 TFLOP a step: minutes on a CPU. The estimate counts
the model's products on the meta device (train.memory.forward_macs, no weights) and divides by a fp32 matrix
product timed here; it ignores data loading and the optimizer, so it is a floor, within a small factor.
"""
from __future__ import annotations

import timeit

import torch


def duration(seconds: float) -> str:
    """'under 0.01 s', '0.4 s', '12 min', '3.5 h', '41 days', '140 years', '1,240 years'."""
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            value = seconds / size
            return f"{value:,.0f} {unit}" if value >= 1000 else f"{value:.3g} {unit}"
    return f"{seconds:.2g} s" if seconds >= 0.01 else "under 0.01 s"


def step_seconds(model_config, global_batch: int, rate: float) -> tuple[float, float]:
    """(seconds per step, per-image forward GMAC) of a model config at a global batch on a `rate` FLOP/s device."""
    from train.memory import forward_macs

    macs = forward_macs(model_config.build(device="meta"))["total"]
    return 6 * macs * global_batch / rate, macs / 1e9  # training ~ 3 x forward, 2 FLOPs per multiply-accumulate


def describe_cpu_step(model_config, global_batch: int, total_steps: int) -> str:
    """The paragraph a CPU run prints before building its model: cost of one step and of the whole run."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)  # this CPU's fp32 FLOP/s: best of 4, after one warm-up
    a @ b
    rate = 2 * 512**3 / max(min(timeit.repeat(lambda: a @ b, number=1, repeat=4)), 1e-9)
    seconds, gmac = step_seconds(model_config, global_batch, rate)
    return (f"on this CPU ({rate / 1e9:.0f} GFLOP/s in fp32 matrix products), one step of {model_config.model} at "
            f"global batch {global_batch} ({6 * gmac * global_batch / 1e3:.3g} TFLOP: 6 x {gmac:.3g} GMAC per image) "
            f"will take about {duration(seconds)} at best, {total_steps:,} steps about "
            f"{duration(seconds * total_steps)}. "
            f"For a trial on a CPU pass a small --model (DiT-S/2, DiT-T/2) and a small --global-batch-size.")
