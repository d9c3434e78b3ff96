"""--sample-every previews: EMA latents for fixed classes and fixed noise, saved without any VAE.

RUN/samples/step-XXXXXXX.safetensors holds "latents" (N,C,h,w), already scaled by the VAE factor, and
"labels" (N,), with metadata "latents" (the latent description) and "step"; `python -m sample decode`
turns it into images.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from shared.diffusion import create_diffusion, ddim_sample

PREVIEW_COUNT = 8
PREVIEW_SEED = 0  # fixed noise: the same starting points at every preview, so images are comparable


def preview_labels(num_classes: int, count: int = PREVIEW_COUNT) -> torch.Tensor:
    """`count` classes spread evenly over [0, num_classes) (repeats when there are fewer classes)."""
    return torch.from_numpy(np.linspace(0, num_classes - 1, count).round().astype(np.int64))  # (N,)


def preview_noise(latent_shape, count: int = PREVIEW_COUNT) -> torch.Tensor:
    """Fixed starting noise (N,C,h,w): row i drawn from a generator seeded with i."""
    gens = [torch.Generator().manual_seed(PREVIEW_SEED + i) for i in range(count)]
    return torch.stack([torch.randn(tuple(latent_shape), generator=g) for g in gens])  # (N, C, h, w)


@torch.no_grad()
def sample_preview(model, latent_shape, num_steps: int, cfg_scale: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic DDIM latents of the EMA model for the preview classes -> (latents, labels) on the CPU."""
    labels = preview_labels(model.num_classes).to(device)
    noise = preview_noise(latent_shape).to(device)
    diffusion = create_diffusion(num_steps)
    if cfg_scale == 1:
        x = ddim_sample(diffusion, model.forward, noise, dict(y=labels))
    else:
        # Classifier-free guidance batched as [cond; null] halves, as DiT.forward_with_cfg expects.
        null = torch.full_like(labels, model.null_label)
        z = torch.cat([noise, noise])  # (2N, C, h, w)
        x = ddim_sample(diffusion, model.forward_with_cfg, z, dict(y=torch.cat([labels, null]), cfg_scale=cfg_scale))
        x = x[: len(labels)]  # (N, C, h, w)
    return x.float().cpu(), labels.cpu()


def save_preview(path: Path, latents: torch.Tensor, labels: torch.Tensor, latent_meta: dict, step: int) -> Path:
    """Write a preview file atomically (temp name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    metadata = {"latents": json.dumps(latent_meta), "step": str(int(step))}
    save_file({"latents": latents.contiguous(), "labels": labels.contiguous()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
