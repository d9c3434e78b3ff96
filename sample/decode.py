"""`python -m sample decode`: turn training's --sample-every latents (RUN/samples/step-*.safetensors) into PNGs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from shared.distributed import process_state
from shared.errors import UserError

from sample.outputs import GRID_NAME, image_name, save_png, to_uint8, write_grid
from sample.vae_setup import check_vae, choose_vae, latent_rescale, load_vae


@dataclass
class DecodeOptions:
    """Everything `python -m sample decode` accepts."""

    latents: str
    vae: str | None = None
    vae_config: str | None = None
    out: str | None = None
    vae_precision: str = "fp32"
    vae_tiling: bool = False
    vae_slicing: bool = False
    batch_size: int = 16
    cpu: bool = False


def read_latents(path: Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(latents (N,C,h,w) scaled, labels (N,), latent meta) from a training samples file; UserError if unusable."""
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
    if "latents" not in tensors or tensors["latents"].dim() != 4:
        raise UserError(f"{path} has no (N, C, h, w) 'latents' tensor; pass a RUN/samples/step-*.safetensors file.")
    latents = tensors["latents"].float()
    labels = tensors.get("labels", torch.zeros(len(latents), dtype=torch.long)).long()
    return latents, labels, meta


def run_decode(o: DecodeOptions) -> Path:
    """Decode every latent to `{index:06d}-class{label}.png` plus grid.png in --out (default: beside the file)."""
    if o.batch_size < 1:
        raise UserError(f"--batch-size {o.batch_size} must be at least 1.")
    path = Path(o.latents).expanduser()
    latents, labels, meta = read_latents(path)
    spec, how = choose_vae(o.vae, meta)
    name, _ = check_vae(spec, o.vae_config, latents.shape[1])
    out = Path(o.out) if o.out else path.with_suffix("")
    device = process_state(o.cpu).device
    vae = load_vae(name, o.vae_config, device, o.vae_precision, o.vae_tiling, o.vae_slicing)
    rescale, note = latent_rescale(vae, meta)
    print(f"decoding {len(latents)} latents from {path} with VAE {name} ({how})" + (f"; note: {note}" if note else ""))
    out.mkdir(parents=True, exist_ok=True)
    images = []
    with torch.inference_mode():
        for start in tqdm(range(0, len(latents), o.batch_size), unit="batch", desc="decoding"):
            pixels = to_uint8(vae.decode(latents[start:start + o.batch_size] * rescale))  # (B, H, W, 3)
            for i, p in enumerate(pixels, start):
                save_png(out / image_name(i, int(labels[i])), p)
                images.append(p)
    write_grid(out / GRID_NAME, lambda i: images[i], labels.tolist())
    print(f"wrote {len(latents)} images and {GRID_NAME} to {out}")
    return out
