"""CLI: `python -m sample --ckpt ...` draws images; `python -m sample decode LATENTS` decodes training samples."""
from __future__ import annotations

import argparse
import sys

from shared.diffusion import SAMPLER_NAMES
from shared.errors import UserError, exit_with
from shared.guidance import GUIDE_CHANNELS
from shared.models import DiT_models
from shared.precision import PRECISIONS

from sample.checkpoint import WEIGHTS
from sample.decode import DecodeOptions, run_decode
from sample.generate import SampleOptions, run_sample

PROG = "python -m sample"
EPILOG = """Resume: rerun the same command; images already in --out are kept and only the missing ones are
drawn. Image i's label and noise depend only on --seed and i, not on --batch-size or the number of
processes (pixels then match exactly wherever the floating-point kernels do: same device and threads).
Several GPUs: `accelerate launch -m sample ...` (rank r draws images i with i % world == r).
Decode training's latent samples: `python -m sample decode RUN/samples/step-0000100.safetensors`."""
# The flag that sets each setting shared/ names in its errors (shared.errors.ChoiceError / SettingError kinds).
FLAGS = {"model preset": "--model", "weights": "--weights", "cfg scale": "--cfg-scale",
         "guide-channel choice": "--guide-channels", "sampler": "--sampler", "precision": "--precision",
         "vae": "--vae", "vae config": "--vae-config"}


def add_vae_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by sampling and decoding: which VAE and how it decodes."""
    p.add_argument("--vae", default=None,
                   help="VAE that decodes the latents: ema | mse (stabilityai/sd-vae-ft-*), a hub id, or a local "
                        "diffusers folder / weight file. Default: the VAE recorded in the weights' latent metadata, "
                        "else ema")
    p.add_argument("--vae-config", default=None, help="config.json for a single-file --vae (default: beside it)")
    p.add_argument("--vae-precision", choices=list(PRECISIONS), default="fp32",
                   help="VAE decoder precision (fp32 default; bf16/fp16 halve its memory)")
    p.add_argument("--vae-tiling", action="store_true", help="decode in overlapping tiles (less memory, faint seams)")
    p.add_argument("--vae-slicing", action="store_true", help="decode one image of a batch at a time (less memory)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Which weights, and the checks for official bare state dicts."""
    p.add_argument("--ckpt", required=True,
                   help="training run folder (newest EMA export), a checkpoints/step-* folder, a .safetensors "
                        "export (config read from it), or an official DiT .pt/.pth state dict")
    p.add_argument("--weights", choices=WEIGHTS, default="ema",
                   help="with a run or checkpoint folder: EMA weights (default) or the raw training weights")
    p.add_argument("--model", choices=list(DiT_models), default=None,
                   help="official .pt only: the preset (default: inferred from tensor shapes, and said)")
    p.add_argument("--image-size", type=int, default=None,
                   help="official .pt only: image size in pixels, checked against latent size x VAE factor")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """What to draw and how."""
    p.add_argument("--class-labels", type=int, nargs="+", default=None,
                   help="class indices, cycled over --num-samples (default: label i = i %% num_classes)")
    p.add_argument("--random-labels", action="store_true",
                   help="draw each image's class uniformly from its own (seed, i) generator instead")
    p.add_argument("--num-samples", type=int, default=None,
                   help="images to draw (default: one per --class-labels entry, else one per class)")
    p.add_argument("--cfg-scale", type=float, default=4.0,
                   help="classifier-free guidance scale; 1 = none (4.0 for pictures, 1.5 for FID)")
    p.add_argument("--guide-channels", choices=GUIDE_CHANNELS, default="3",
                   help="latent channels guided: 3 as the DiT release (a quirk), or all")
    p.add_argument("--sampler", choices=SAMPLER_NAMES, default="ddpm", help="respaced sampler")
    p.add_argument("--num-sampling-steps", type=int, default=250, help="respaced steps (250 as the paper)")
    p.add_argument("--seed", type=int, default=0, help="image i's label and noise come from (seed, i)")
    p.add_argument("--batch-size", type=int, default=32, help="images per forward pass (per process)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="DiT precision: fp32, or fp16/bf16 autocast")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="disable TF32 matmuls on Ampere+ GPUs (on by default, as the DiT release)")
    p.add_argument("--out", default=None,
                   help="output folder (default: samples/<ckpt>-cfg<s>-<sampler><steps>-seed<seed>)")
    p.add_argument("--npz", action="store_true",
                   help="also write samples.npz (arr_0 uint8 N x H x W x 3, labels) for FID tooling")


def sample_parser() -> argparse.ArgumentParser:
    """Parser of the default (sampling) command."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_sampling_flags(p)
    add_vae_flags(p)
    return p


def decode_parser() -> argparse.ArgumentParser:
    """Parser of `decode`."""
    p = argparse.ArgumentParser(prog=f"{PROG} decode",
                                description="Decode RUN/samples/step-*.safetensors latents to PNGs and a grid.")
    p.add_argument("latents", help="a latents file written by training's --sample-every")
    p.add_argument("--out", default=None, help="output folder (default: the file's path without .safetensors)")
    p.add_argument("--batch-size", type=int, default=16, help="latents decoded per VAE call")
    add_vae_flags(p)
    return p


def main(argv=None) -> None:
    """Dispatch `decode` or sampling; print UserErrors as one paragraph."""
    argv = sys.argv[1:] if argv is None else list(argv)
    decoding = bool(argv) and argv[0] == "decode"
    prog = f"{PROG} decode" if decoding else PROG
    try:
        if decoding:
            run_decode(DecodeOptions(**vars(decode_parser().parse_args(argv[1:]))))
        else:
            run_sample(SampleOptions(**vars(sample_parser().parse_args(argv))))
    except UserError as err:
        exit_with(err, prog, FLAGS)


if __name__ == "__main__":
    main()
