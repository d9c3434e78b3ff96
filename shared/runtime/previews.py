"""The preview file: training's --sample-every latents, written by train and read by `sample decode` / `watch`.

RUN/samples/step-XXXXXXX.safetensors (the name is shared/runtime/rundir.py's) holds
    "latents"  (N, C, h, w) fp32, normalised as the run trained (decode inverts metadata["latents"]["latent_norm"])
    "labels"   (N,) int64 class indices
and metadata "latents" (the latent description, shared/runtime/export.py's latent_meta, as JSON) and "step".
No VAE is involved in writing one: training never loads the VAE.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from shared.runtime.errors import UserError
from shared.runtime.export import write_safetensors
from shared.runtime.fsio import atomic_write

LATENTS_KEY, LABELS_KEY = "latents", "labels"


def write_preview(path: Path, latents: torch.Tensor, labels: torch.Tensor, latent_meta: dict, step: int) -> Path:
    """Write a preview file atomically: latents (N, C, h, w) normalised, labels (N,)."""
    metadata = {"latents": json.dumps(latent_meta, sort_keys=True), "step": str(int(step))}
    tensors = {LATENTS_KEY: latents.contiguous(), LABELS_KEY: labels.contiguous()}
    return atomic_write(path, lambda tmp: write_safetensors(tmp, tensors, metadata))


def read_preview(path: Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(latents (N,C,h,w) normalised, labels (N,), latent meta) from a preview file; UserError if unusable."""
    if not path.is_file():
        raise UserError(f"latents file {path} does not exist; training writes them to RUN/samples/step-*.safetensors "
                        f"when run with --sample-every.")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
        meta = json.loads(metadata.get("latents", "{}"))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"cannot read {path} as a latents file ({err}); pass a RUN/samples/step-*.safetensors "
                        f"file written by training.") from err
    if LATENTS_KEY not in tensors or tensors[LATENTS_KEY].dim() != 4:
        raise UserError(f"{path} has no (N, C, h, w) 'latents' tensor; pass a RUN/samples/step-*.safetensors file.")
    latents = tensors[LATENTS_KEY].float()
    shape = meta.get("latent_shape")
    if shape and list(latents.shape[1:]) != [int(n) for n in shape]:  # the VAE checks trust the metadata
        raise UserError(f"{path} holds latents of shape {tuple(latents.shape[1:])} but its metadata describes "
                        f"{tuple(shape)}: the file was altered or not written by training. Pass an unmodified "
                        f"RUN/samples/step-*.safetensors file.")
    labels = tensors.get(LABELS_KEY, torch.zeros(len(latents), dtype=torch.long)).long()
    return latents, labels, meta
