"""--sample-every previews: EMA latents for fixed classes and fixed noise, saved without any VAE.

The file (RUN/samples/step-XXXXXXX.safetensors) is shared/sampling/previews.py's; `python -m sample decode`
turns it into images. Guidance is shared/generative/guidance.py's GuidedModelFn, the sampler's own.
"""
from __future__ import annotations

import numpy as np
import torch

from shared.generative.objectives import run_sampler
from shared.generative.samplers import resolve_sampling
from shared.generative.guidance import GuidedModelFn, guide_channel_count
from shared.runtime.seeding import generator_for

PREVIEW_COUNT = 8
PREVIEW_SEED = 0  # fixed noise: the same starting points at every preview, so images are comparable


def preview_labels(num_classes: int, count: int = PREVIEW_COUNT) -> torch.Tensor:
    """`count` classes spread evenly over [0, num_classes) (repeats when there are fewer classes)."""
    return torch.from_numpy(np.linspace(0, num_classes - 1, count).round().astype(np.int64))  # (N,)


@torch.no_grad()
def sample_preview(model, latent_shape, num_steps: int, cfg_scale: float, guide_channels: str,
                   device, objective, recorded: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, labels) on the CPU by the recorded sampling half (a recipe's), else the objective's fast sampler."""
    labels = preview_labels(model.num_classes).to(device)  # (N,)
    # fixed starting noise, row i from the generator of (PREVIEW_SEED, i)
    noise = torch.stack([torch.randn(tuple(latent_shape), generator=generator_for(PREVIEW_SEED, i))
                         for i in range(PREVIEW_COUNT)]).to(device)  # (N, C, h, w)
    plan = resolve_sampling(objective, None, {}, None, recorded, guided=cfg_scale != 1.0, fast=True)
    model_fn = GuidedModelFn(model, cfg_scale, guide_channel_count(guide_channels, model.in_channels),
                             interval=plan.cfg_interval, noise_level=objective.noise_level)
    x = run_sampler(objective, plan.sampler, model_fn, noise, num_steps, plan.options,
                    model_kwargs=dict(y=labels))  # (N, C, h, w)
    return x.float().cpu(), labels.cpu()
