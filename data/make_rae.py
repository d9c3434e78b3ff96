"""A representation autoencoder (RAE) for the digits, in diffusers' AutoencoderRAE format: `python -m data.make_rae`.

RAE (Zheng et al. 2025) pairs a frozen representation encoder with a ViT decoder trained on its patch tokens,
normalised per element. Here: (1) AutoencoderRAE's own Dinov2WithRegisters encoder shaped as data/make_encoder.py's
and fitted with its recipe, then frozen; (2) the per-element mean and std (64, 4, 4) of its tokens as latents_mean /
latents_std; (3) a small ViT decoder trained with pixel MSE and RAE's noise augmentation (std U[0, noise_tau]). Every
10th digit is held out; its reconstruction PSNR is printed beside the digits VAE's.
"""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data.make_encoder import accuracy, fit, normalise, to_unit
from shared.datasets.digits import IMAGE_SIZE, NUM_CLASSES, digit_images
from shared.runtime.cli import HelpFormatter, add_flags, from_args, option
from shared.runtime.errors import UserError, cli_errors
from shared.tokenizers.repr_encoder import IMAGENET_MEAN, IMAGENET_STD

PROG = "python -m data.make_rae"
DEFAULT_OUT = Path("demo-out/rae-digits")  # built on demand, not committed: 3.6 MB in fp32 (see docs/rae.md)
HOLD_OUT_EVERY = 10  # digits 0, 10, 20, ... are never trained on
# The encoder as make_encoder's (width 64, 4 layers, patch 8 at 32 px); AutoencoderRAE sets heads = width / 64.
ENCODER = dict(encoder_type="dinov2", encoder_hidden_size=64, encoder_num_hidden_layers=4, encoder_patch_size=8,
               encoder_input_size=IMAGE_SIZE, encoder_norm_mean=list(IMAGENET_MEAN),
               encoder_norm_std=list(IMAGENET_STD))
# The decoder: RAE's ViT-MAE blocks, small; decoder patch 8 on the 4x4 token grid gives 32 px back.
DECODER = dict(decoder_hidden_size=128, decoder_num_hidden_layers=2, decoder_num_attention_heads=4,
               decoder_intermediate_size=512, patch_size=8)


def split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, held-out) indices of `count` digits: every HOLD_OUT_EVERY-th is held out."""
    held = torch.arange(count) % HOLD_OUT_EVERY == 0
    return torch.nonzero(~held).squeeze(1), torch.nonzero(held).squeeze(1)


def fit_decoder(rae, x: torch.Tensor, steps: int, batch_size: int, lr: float, seed: int) -> None:
    """Train rae.decoder through the real forward (encode with RAE's noise in training mode, decode): MSE to x."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(rae.decoder.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr * 0.05)
    rae.train()  # AutoencoderRAE adds noise of std U[0, noise_tau] to the raw tokens only in training mode
    for _ in range(steps):
        batch = x[torch.randint(0, len(x), (batch_size,), generator=gen)]  # (B, 3, S, S) in [0, 1]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(rae(batch, generator=gen).sample, batch).backward()
        opt.step()
        sched.step()
    rae.eval()


def psnr(recon: torch.Tensor, x: torch.Tensor) -> float:
    """Mean per-image PSNR (dB) of reconstructions against images, both (N, 3, S, S) in [0, 1]."""
    mse = ((recon.clamp(0, 1) - x) ** 2).flatten(1).mean(1)  # (N,)
    return float((10 * torch.log10(1 / mse.clamp_min(1e-10))).mean())


@torch.no_grad()
def rae_psnr(rae, x: torch.Tensor) -> float:
    """PSNR of decode(encode(x)) for x (N, 3, S, S) in [0, 1]."""
    rae.eval()
    return psnr(rae.decode(rae.encode(x).latent).sample, x)


def vae_psnr(x: torch.Tensor) -> float:
    """PSNR of the digits VAE (data/vae-digits, posterior mean) on x (N, 3, S, S) in [0, 1]."""
    from diffusers import AutoencoderKL

    from data.make_vae import DEFAULT_OUT as VAE_DIR, reconstruct
    vae = AutoencoderKL.from_pretrained(VAE_DIR).eval()
    return psnr((reconstruct(vae, x * 2 - 1) + 1) / 2, x)  # the VAE works in [-1, 1]


def make_rae(o: RAEOptions) -> dict:
    """Build, fit and save the digits RAE to o.out; return the measured numbers."""
    from diffusers import AutoencoderRAE
    images, labels = digit_images()
    pixels, labels = torch.from_numpy(images), torch.from_numpy(labels)
    train_idx, held_idx = split(len(pixels))
    torch.manual_seed(o.seed)
    rae = AutoencoderRAE(**ENCODER, **DECODER, noise_tau=o.noise_tau)  # encoder and decoder from config, no download
    head = torch.nn.Linear(ENCODER["encoder_hidden_size"], NUM_CLASSES)  # rae.encoder fitted with make_encoder's recipe
    rae.encoder.requires_grad_(True)
    train_acc = fit(rae.encoder, head, normalise(pixels[train_idx]), labels[train_idx], o.encoder_steps, seed=o.seed)
    rae.encoder.requires_grad_(False)  # frozen from here on, as AutoencoderRAE builds it
    x = to_unit(pixels)
    rae.eval()
    with torch.no_grad():  # the raw tokens (N, C, H, W) of the training digits: per-element mean and std (C, H, W)
        # With no statistics set, encode normalises by mean 0 and std 1 (+1e-5): undo that to get the raw tokens.
        tokens = torch.cat([rae.encode(chunk).latent for chunk in x[train_idx].split(256)]) * (1 + 1e-5)
        mean, std = tokens.mean(0), tokens.std(0)
    # In the config (saved in config.json) and in the buffers encode/decode read (AutoencoderRAE's persistent ones).
    rae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    rae._latents_mean, rae._latents_std = mean.clone(), std.clone()
    untrained = rae_psnr(rae, x[held_idx])  # the decoder before training: the baseline a trained one must beat
    fit_decoder(rae, x[train_idx], o.decoder_steps, o.batch_size, o.lr, o.seed)
    rae.save_pretrained(o.out)
    return {"encoder accuracy, training digits": train_acc,
            "encoder accuracy, held-out digits": accuracy(rae.encoder, head, normalise(pixels[held_idx]),
                                                          labels[held_idx]),
            "PSNR held-out, untrained decoder (dB)": untrained,
            "PSNR held-out, RAE (dB)": rae_psnr(rae, x[held_idx]),
            "PSNR held-out, digits VAE (dB, it trained on them)": vae_psnr(x[held_idx]),
            "parameters": sum(p.numel() for p in rae.parameters())}


@dataclass
class RAEOptions:
    """The flags of `python -m data.make_rae`."""
    out: Path = option(DEFAULT_OUT, "folder to save_pretrained the AutoencoderRAE into")
    encoder_steps: int = option(400, "steps of batch 64 fitting the encoder (make_encoder's recipe; one head of 64 "
                                     "learns slower than its four of 16, hence more steps)", min=1)
    decoder_steps: int = option(1500, "steps fitting the decoder on the frozen tokens", min=1)
    batch_size: int = option(64, "images per decoder step", min=1)
    lr: float = option(2e-3, "peak AdamW learning rate of the decoder (cosine decay to 5%% of it)", above=0)
    noise_tau: float = option(0.8, "largest std of the noise added to the raw tokens in decoder training (RAE's "
                                   "noise augmentation; 0: none)", min=0)
    seed: int = option(0, "seed of the initialisation, batches and noise")


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags, from RAEOptions (the docs' commands are checked against it)."""
    return add_flags(argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[0],
                                             formatter_class=HelpFormatter), RAEOptions)


@interruptible(PROG)
def main(argv=None) -> None:
    """Entry point: train, save and print the numbers."""
    args = build_parser().parse_args(argv)
    with cli_errors(PROG):
        o = from_args(RAEOptions, args)  # the numbers' bounds are on their options
        if o.out.exists() and not o.out.is_dir():
            raise UserError(f"--out {o.out} is a file; pass a folder (it is created, an RAE in it is replaced).")
        # One thread: the same float reductions, hence the same saved weights, on every machine; and a tiny model.
        torch.set_num_threads(1)
        np.random.seed(o.seed)
        start = time.time()
        stats = make_rae(o)
    print(f"saved {o.out} in {time.time() - start:.0f}s")
    for key, value in stats.items():
        print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value:,}")


if __name__ == "__main__":
    main(sys.argv[1:])
