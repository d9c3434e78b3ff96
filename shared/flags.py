"""Flag families several commands share, each stated once (default and help): the VAE that decodes, sampling.

A command's options dataclass takes a family member as a field, `vae: str | None = VAE.field()`, and may
change what differs for it (`SAMPLER.field(default="ddim")` where evaluate draws with DDIM).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.cli import Flag
from shared.diffusion import SAMPLER_HELP, SAMPLER_NAMES
from shared.guidance import GUIDE_CHANNELS
from shared.precision import PRECISIONS

# ---- the VAE that turns latents into pixels (sample, decode, watch, export, evaluate run) -----------------
VAE = Flag("VAE that decodes the latents: ema | mse (stabilityai/sd-vae-ft-*), a hub id, or a local diffusers "
           "folder / weight file. Default: the VAE recorded in the weights' latent metadata, else ema", None)
VAE_CONFIG = Flag("config.json for a single-file --vae (default: the config.json beside it)", None)
VAE_PRECISION = Flag("VAE decoder precision (fp32 default; bf16/fp16 halve its memory)", "fp32",
                     choices=tuple(PRECISIONS))
VAE_TILING = Flag("decode in overlapping tiles (less memory, faint seams)", False)
VAE_SLICING = Flag("decode one image of a batch at a time (less memory)", False)
ALLOW_OTHER_VAE = Flag("decode with a VAE whose scaling factor or config differs from the one recorded with the "
                       "latents (a deliberate swap); a VAE with other latent channels or downsample factor is always "
                       "refused", False)
CPU = Flag("run on the CPU even when a GPU is present", False)


@dataclass(kw_only=True)
class DecodeFlags:
    """The flags of every command that decodes latents with a VAE: its options dataclass derives from this."""

    vae: str | None = VAE.field()
    vae_config: str | None = VAE_CONFIG.field()
    vae_precision: str = VAE_PRECISION.field()
    vae_tiling: bool = VAE_TILING.field()
    vae_slicing: bool = VAE_SLICING.field()
    allow_other_vae: bool = ALLOW_OTHER_VAE.field()
    cpu: bool = CPU.field()

# ---- drawing images from a DiT (sample, evaluate run) ------------------------------------------------------
CFG_SCALE = Flag("classifier-free guidance scale; 1 = none (4.0 for pictures, 1.5 for FID)", 4.0)
GUIDE = Flag("latent channels guided: 3 (the DiT release's quirk for 4-channel latents), all, or auto (3 for "
             "4-channel latents, as the release; all otherwise); the rule used is printed", "auto",
             choices=GUIDE_CHANNELS)
SAMPLER = Flag("; ".join(f"{name}: {SAMPLER_HELP[name]}" for name in SAMPLER_NAMES)
               + ". DiT's respacing calls the model at t = 0 too; the solvers' linspace spacing (diffusers' default) "
                 "steps from about t = 999/K straight to clean data", "ddpm", choices=SAMPLER_NAMES)
NUM_SAMPLING_STEPS = Flag("model calls per image (twice the batch with guidance): 250 as the paper for ddpm, ~50 "
                          "for ddim, 10-25 for dpmpp-2m and unipc", 250)
SEED = Flag("image i's label and noise come from (seed, i)", 0, aliases=("--global-seed",))
BATCH_SIZE = Flag("images per forward pass (per process)", 32)
