"""The inputs of tests/bench/gpu_check.sh, made on the spot without network: a synthetic latent folder, a random DiT
state dict in the official layout (what `python -m sample --ckpt FILE.pt` reads) and a random VAE of SD-VAE's
architecture (speed does not depend on the weights).

Run: python tests/bench/gpu_fixtures.py OUT [--model DiT-XL/2 --image-size 256 --num-latents 512]
     (--tiny-vae for a CPU smoke test: a two-level VAE instead of SD-VAE's four levels)
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.network.models import DiT_models, ModelConfig  # noqa: E402
from tests.helpers import make_latents  # noqa: E402

VAE_FACTOR = 8  # SD-VAE: 256 px -> 32x32x4 latents
SD_VAE_WIDTHS = (128, 256, 512, 512)  # SD-VAE's block_out_channels (stabilityai/sd-vae-ft-ema config.json)


def parse_args(argv=None):
    """Fixture options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write latents/, dit.pt and vae/ into")
    p.add_argument("--model", choices=list(DiT_models), default="DiT-XL/2", help="DiT preset of the random weights")
    p.add_argument("--image-size", type=int, default=256, help="image size the latents stand for (pixels)")
    p.add_argument("--num-latents", type=int, default=512, help="synthetic latents in the folder")
    p.add_argument("--tiny-vae", action="store_true", help="a two-level VAE (CPU smoke tests) instead of SD-VAE's")
    return p.parse_args(argv)


def write_vae(out: Path, tiny: bool) -> Path:
    """A random AutoencoderKL with SD-VAE's architecture (downsample 8, 4 latent channels), save_pretrained."""
    from diffusers import AutoencoderKL

    widths = (8, 16, 16, 16) if tiny else SD_VAE_WIDTHS
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(widths),
                        up_block_types=("UpDecoderBlock2D",) * len(widths), block_out_channels=widths,
                        layers_per_block=1 if tiny else 2, latent_channels=4, norm_num_groups=8 if tiny else 32,
                        sample_size=256)
    vae.save_pretrained(out)
    return out


def write_dit(out: Path, model: str, side: int) -> Path:
    """A randomly initialised DiT's state dict in the official layout (built on the GPU when there is one)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    dit = ModelConfig(model, side).build(device=device)
    with torch.no_grad():  # adaLN-Zero would make every block the identity: random weights everywhere instead
        for p in dit.parameters():
            if p.requires_grad and not p.any():
                p.normal_(std=0.02)
    torch.save({k: v.cpu() for k, v in dit.state_dict().items()}, out)
    return out


def main(argv=None):
    """Write the three fixtures and print where they are."""
    args = parse_args(argv)
    side = args.image_size // VAE_FACTOR
    args.out.mkdir(parents=True, exist_ok=True)
    latents = make_latents(args.out / "latents", n=args.num_latents, shape=(4, side, side), flips=1, per_shard=256,
                           image_size=args.image_size)
    dit = write_dit(args.out / "dit.pt", args.model, side)
    vae = write_vae(args.out / "vae", args.tiny_vae)
    print(f"fixtures: latents {latents} ({args.num_latents} of 4x{side}x{side}), random {args.model} {dit}, "
          f"random VAE {vae}")


if __name__ == "__main__":
    main()
