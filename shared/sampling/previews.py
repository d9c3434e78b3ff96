"""The preview file: training's --sample-every latents, written by train and read by `sample decode` / `watch`.

RUN/samples/step-XXXXXXX.safetensors (the name is shared/runtime/rundir.py's) holds
    "latents"  (N, C, h, w) fp32, normalised as the run trained (decode inverts its space's "dit" normalisation)
    "labels"   (N,) int64 class indices
    "latent_space.*" and metadata "latent_space": the run's LatentSpace (shared/tokenizers/space.py); "step".
No VAE is involved in writing one: training never loads the VAE.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from shared.runtime.errors import UserError
from shared.weights.export import write_safetensors
from shared.runtime.fsio import atomic_write
from shared.tokenizers.space import REBUILD_RUN_FILE, LatentSpace

LATENTS_KEY, LABELS_KEY = "latents", "labels"


def write_preview(path: Path, latents: torch.Tensor, labels: torch.Tensor, space, step: int) -> Path:
    """Write a preview file atomically: latents (N, C, h, w) normalised, labels (N,), the run's LatentSpace."""
    space_metadata, space_tensors = space.file_parts() if space is not None else ({}, {})
    tensors = {LATENTS_KEY: latents.contiguous(), LABELS_KEY: labels.contiguous(), **space_tensors}
    return atomic_write(path, lambda tmp: write_safetensors(tmp, tensors, {**space_metadata, "step": str(int(step))}))


def read_preview(path: Path) -> tuple[torch.Tensor, torch.Tensor, LatentSpace | None]:
    """(latents (N,C,h,w) normalised, labels (N,), LatentSpace or None) from a preview file; UserError if unusable."""
    if not path.is_file():
        raise UserError(f"latents file {path} does not exist; training writes them to RUN/samples/step-*.safetensors "
                        f"when run with --sample-every.")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"cannot read {path} as a latents file ({err}); pass a RUN/samples/step-*.safetensors "
                        f"file written by training.") from err
    if LATENTS_KEY not in tensors or tensors[LATENTS_KEY].dim() != 4:
        raise UserError(f"{path} has no (N, C, h, w) 'latents' tensor; pass a RUN/samples/step-*.safetensors file.")
    latents = tensors[LATENTS_KEY].float()
    space = LatentSpace.from_file(metadata, tensors, path, REBUILD_RUN_FILE)
    shape = space.latent_shape if space is not None else ()
    if shape and tuple(latents.shape[1:]) != shape:  # the tokenizer checks trust the metadata
        raise UserError(f"{path} holds latents of shape {tuple(latents.shape[1:])} but its metadata describes "
                        f"{tuple(shape)}: the file was altered or not written by training. Pass an unmodified "
                        f"RUN/samples/step-*.safetensors file.")
    labels = tensors.get(LABELS_KEY, torch.zeros(len(latents), dtype=torch.long)).long()
    return latents, labels, space
