"""The frozen representation encoder REPA aligns to, run once at extraction: DINOv2 through `transformers`.

REPA (Yu et al. 2024, Sec. 3.3 and its code's preprocess_raw_image) feeds DINOv2 the image in [0, 1],
normalised with ImageNet's mean and std and resized bicubically to 224 * (resolution / 256), i.e. a token grid
of resolution / 16 patches per side (256 px -> 224 px -> 16 x 16 = 256 tokens of DINOv2-B/14), and aligns
the encoder's normalised patch tokens (x_norm_patchtokens; the last hidden state after the final LayerNorm
without the class token). We do exactly that, once per image and per stored flip, in fp32, and store the
tokens (F, T, D) beside the VAE moments. `transformers`' Dinov2Model needs no torchvision.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.runtime.errors import UserError

# DINOv2's normalisation (its own transforms: ImageNet statistics); a preprocessor_config.json overrides them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
REPA_GRID_DIVISOR = 16  # REPA: the encoder sees resolution / 16 patches per side (224 px for 256 px, /14)


def import_transformers():
    """`transformers`, or a UserError saying how to install it."""
    try:
        import transformers
    except ImportError as err:
        raise UserError("--repr-encoder needs the `transformers` package (DINOv2 without torchvision): "
                        "`pip install transformers`, or extract without --repr-encoder.") from err
    return transformers


def plan_identity(source: str, image_size: int, requested_size: int | None) -> dict:
    """The stored features' identity from the encoder's config (no weights): in index.json, checked on resume."""
    transformers = import_transformers()  # config.json of a local encoder folder or a Hub id in the local cache
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise UserError(f"--repr-encoder {source} is neither a folder holding a transformers encoder "
                        f"(config.json + weights, e.g. saved with save_pretrained) nor a Hub id such as "
                        f"facebook/dinov2-base that can be loaded here ({' '.join(str(err).split())[:200]}). "
                        f"Pass a local DINOv2 folder or a reachable Hub id.") from None
    if config.model_type != "dinov2":
        raise UserError(f"--repr-encoder {source} is a {config.model_type!r} model; REPA's encoder here is "
                        f"DINOv2 (transformers' Dinov2Model, e.g. facebook/dinov2-base). Pass a DINOv2 folder or id.")
    config = config.to_dict()
    patch = int(config["patch_size"])
    size = requested_size or patch * max(1, image_size // REPA_GRID_DIVISOR)  # else REPA's image_size / 16 patches
    if size % patch:
        raise UserError(f"--repr-image-size {size} is not a multiple of the encoder's patch size {patch}; use "
                        f"{size // patch * patch or patch} or {(size // patch + 1) * patch}.")
    text = json.dumps({k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"},
                      sort_keys=True)
    normalisation = {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
    path = Path(source) / "preprocessor_config.json"  # a local folder's own mean and std, where it has them
    if path.is_file():
        with contextlib.suppress(ValueError, KeyError):
            pre = json.loads(path.read_text())
            normalisation = {"mean": list(pre["image_mean"]), "std": list(pre["image_std"])}
    return {"source": str(source), "model_type": config["model_type"],
            "config_sha256": hashlib.sha256(text.encode()).hexdigest(), "input_size": size,
            "patch_size": patch, "grid": size // patch, "tokens": (size // patch) ** 2,
            "dim": int(config["hidden_size"]), "normalisation": normalisation,
            "tokens_taken": "last_hidden_state[:, 1:] (LayerNorm-ed patch tokens, REPA's x_norm_patchtokens)"}


def load_encoder(source: str, identity: dict, device):
    """The frozen DINOv2 (fp32, eval) `identity` (from `plan_identity`) describes, as its `encode` function."""
    transformers = import_transformers()
    try:
        model = transformers.Dinov2Model.from_pretrained(source, torch_dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise UserError(f"the weights of --repr-encoder {source} could not be read "
                        f"({' '.join(str(err).split())[:200]}); pass a complete save_pretrained folder.") from None
    model = model.eval().requires_grad_(False).to(device)
    norm, size = identity["normalisation"], identity["input_size"]

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, S, S) -> patch tokens (B, T, D) fp32 (REPA's preprocessing, see the module docstring)."""
        x = pixels.to(device, torch.float32) / 255.0  # (B, 3, S, S) in [0, 1]
        x = (x - torch.tensor(norm["mean"], device=x.device).view(1, 3, 1, 1)) / torch.tensor(
            norm["std"], device=x.device).view(1, 3, 1, 1)
        if x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)  # (B, 3, s, s)
        hidden = model(pixel_values=x).last_hidden_state  # (B, 1 + T, D), after the final LayerNorm
        return hidden[:, 1:]  # (B, T, D): drop the class token

    return encode
