"""Train the demo's tiny AutoencoderKL on the digits (CPU, a few minutes) and save it with its scaling factor.

`python -m data.make_vae [--out data/vae-digits]`: 32x32 RGB -> 4x8x8 latents; pixel MSE + a small KL (LDM without
the perceptual and GAN terms); scaling_factor = 1 / std of the latents, as Stable Diffusion's was chosen.
"""
from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from shared.datasets.digits import digit_images
from shared.runtime.cli import add_flags, from_args, option
from shared.runtime.errors import cli_errors
from shared.tokenizers.tokenizer import channels_first, to_uint8

PROG = "python -m data.make_vae"
DEFAULT_OUT = Path(__file__).resolve().parent / "vae-digits"
WIDTHS = (16, 32, 32)  # three levels -> downsample factor 4 (32x32 -> 8x8)
LATENT_CHANNELS = 4


def build_vae(seed: int = 0):
    """A small randomly initialised AutoencoderKL: 32x32 RGB <-> 4x8x8 latents."""
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(WIDTHS),
                         up_block_types=("UpDecoderBlock2D",) * len(WIDTHS), block_out_channels=WIDTHS,
                         layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=32)


def train_vae(vae, x: torch.Tensor, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int):
    """Adam on random minibatches of x (N, 3, H, W) in [-1, 1], pixel MSE + kl_weight * KL; the VAE in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # posterior.sample() draws from the global RNG
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr * 0.05)
    vae.train()
    bar = tqdm(range(steps), desc="vae", unit="step")
    for _ in bar:
        batch = x[torch.randint(0, len(x), (batch_size,), generator=gen)]
        posterior = vae.encode(batch).latent_dist
        mse = torch.mean((vae.decode(posterior.sample()).sample - batch) ** 2)  # (N, 3, H, W) reconstructions
        kl = posterior.kl().mean() / posterior.mean[0].numel()  # per latent element, so kl_weight is size-free
        opt.zero_grad(set_to_none=True)
        (mse + kl_weight * kl).backward()
        opt.step()
        sched.step()
        bar.set_postfix(mse=f"{mse.item():.4f}")
    return vae.eval()


@torch.no_grad()
def reconstruct(vae, x: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Decode the posterior mean of each image: the reconstruction the demo pipeline sees."""
    return torch.cat([vae.decode(vae.encode(c).latent_dist.mean).sample for c in x.split(batch_size)])


def make_vae(out: Path, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int) -> dict:
    """Train, calibrate the scaling factor, save_pretrained to `out`, and return the measured numbers."""
    from data.judge import class_match
    images, labels = digit_images()
    x = channels_first(images)  # (N, 3, 32, 32) in [-1, 1]
    vae = train_vae(build_vae(seed), x, steps, batch_size, lr, kl_weight, seed)
    with torch.no_grad():  # the posterior mean and std (N, C, h, w) of every image, unscaled
        dists = [vae.encode(chunk).latent_dist for chunk in x.split(256)]
    mean, std = torch.cat([d.mean for d in dists]), torch.cat([d.std for d in dists])
    # scaling_factor = 1 / std of posterior samples over the data (how the SD VAE's factor was chosen)
    gen = torch.Generator().manual_seed(seed)
    factor = float(1.0 / (mean + std * torch.randn(mean.shape, generator=gen)).std())
    vae.register_to_config(scaling_factor=factor)
    vae.save_pretrained(out)
    recon = reconstruct(vae, x)  # reconstruction MSE, judge accuracy on reconstructions vs on the real digits
    return {"recon_mse": float(torch.mean((recon.clamp(-1, 1) - x) ** 2)), "judge_real": class_match(images, labels),
            "judge_recon": class_match(to_uint8(recon), labels), "scaling_factor": factor,
            "posterior_std": float(std.mean()), "latent_std": float(1.0 / factor)}


@dataclass
class VAEOptions:
    """The flags of `python -m data.make_vae`."""
    out: Path = option(DEFAULT_OUT, "folder to save_pretrained the VAE into")
    steps: int = option(400, "optimizer steps", min=1)
    batch_size: int = option(32, "images per step", min=1)
    lr: float = option(2e-3, "peak Adam learning rate (cosine decay)")
    kl_weight: float = option(1e-4, "weight of the per-element KL term")
    seed: int = option(0, "seed for init, batches and posterior draws")


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags, from VAEOptions (the docs' commands are checked against it)."""
    return add_flags(argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0]), VAEOptions)


@interruptible(PROG)
def main(argv=None) -> None:
    """Entry point: train, save and print the numbers."""
    flags = build_parser().parse_args(argv)
    with cli_errors(PROG):
        args = from_args(VAEOptions, flags)  # refuses --steps or --batch-size below 1
        # A fixed thread count keeps the float reductions, hence the saved weights, the same on every run.
        torch.set_num_threads(min(2, torch.get_num_threads()))
        start = time.time()
        stats = make_vae(args.out, args.steps, args.batch_size, args.lr, args.kl_weight, args.seed)
    print(f"saved {args.out} in {time.time() - start:.0f}s")
    for key, value in stats.items():
        print(f"  {key}: {value:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
