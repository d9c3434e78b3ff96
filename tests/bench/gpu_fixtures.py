"""The inputs of tests/bench/gpu_check.sh, made on the spot without network: a synthetic latent folder, a random DiT
state dict in the official layout (what `python -m sample --ckpt FILE.pt` reads) and a random VAE of SD-VAE's
architecture (speed does not depend on the weights).

Run: python tests/bench/gpu_fixtures.py OUT [--model DiT-XL/2 --image-size 256 --num-latents 512] [--what latents]
     (--tiny-vae for a CPU smoke test: a two-level VAE instead of SD-VAE's four levels)

The GPU machine has torch (CUDA), accelerate, transformers and timm, not diffusers (the VAE) nor pytest (tests/helpers
imports it; the latents are written with its make_latents). A missing one ends in one line naming it and these wheels
(pure Python; `pip install --no-deps` them there), the versions this checkout is tested with:
  vae:     diffusers-0.42.1-py3-none-any.whl importlib_metadata-10.2.0-py3-none-any.whl zipp-4.1.2-py3-none-any.whl
           lazy_importer-0.1.0-py3-none-any.whl (diffusers also needs huggingface-hub >= 1.32, Pillow, regex,
           requests, safetensors >= 0.8: transformers and timm bring them)
  latents: pytest-9.2.0-py3-none-any.whl iniconfig-2.3.1-py3-none-any.whl pluggy-1.7.0-py3-none-any.whl
           pygments-2.21.0-py3-none-any.whl
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.network.models import DiT_models, ModelConfig  # noqa: E402

FIXTURES = ("latents", "dit", "vae")
# {fixture: (package it imports, the wheels that bring it and what it needs beyond torch/accelerate/transformers)}
NEEDS = {"latents": ("pytest", "pytest-9.2.0 iniconfig-2.3.1 pluggy-1.7.0 pygments-2.21.0"),
         "vae": ("diffusers", "diffusers-0.42.1 importlib_metadata-10.2.0 zipp-4.1.2 lazy_importer-0.1.0")}

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
    p.add_argument("--what", default=",".join(FIXTURES),
                   help=f"comma-separated fixtures to write, of {','.join(FIXTURES)} (default: all)")
    args = p.parse_args(argv)
    args.what = [w for w in args.what.split(",") if w]
    if not args.what or set(args.what) - set(FIXTURES):
        p.error(f"--what takes a comma-separated subset of {','.join(FIXTURES)}")
    return args


def require(fixtures) -> None:
    """One line and exit status 1, no traceback, when a package the asked-for fixtures import is missing."""
    for fixture in fixtures:
        package, wheels = NEEDS.get(fixture, (None, ""))
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError as err:  # the package itself, or one of its own dependencies
            missing = err.name or package
            sys.exit(f"gpu_fixtures.py: the {fixture} fixture needs {package}, but {missing} is not installed: "
                     f"carry the wheels {' '.join(w + '-py3-none-any.whl' for w in wheels.split())} and "
                     "`pip install --no-deps` them (tests/bench/gpu_fixtures.py's header lists them)")


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
    require(args.what)  # before any work: nothing is half written
    side = args.image_size // VAE_FACTOR
    args.out.mkdir(parents=True, exist_ok=True)
    if "latents" in args.what:
        from tests.helpers import make_latents  # imports pytest

        latents = make_latents(args.out / "latents", n=args.num_latents, shape=(4, side, side), flips=1,
                               per_shard=256, image_size=args.image_size)
        print(f"fixtures: latents {latents} ({args.num_latents} of 4x{side}x{side})")
    if "dit" in args.what:
        print(f"fixtures: random {args.model} {write_dit(args.out / 'dit.pt', args.model, side)}")
    if "vae" in args.what:
        print(f"fixtures: random VAE {write_vae(args.out / 'vae', args.tiny_vae)}")


if __name__ == "__main__":
    main()
