"""CLI: `python -m sample --ckpt ...` draws images; `python -m sample decode LATENTS|DIR` decodes training samples."""
from __future__ import annotations

import argparse
import sys

from shared.cli import HelpFormatter
from shared.objectives import OBJECTIVE_NAMES
from shared.samplers import SAMPLER_NAMES, SAMPLERS
from shared.errors import cli_errors
from shared.guidance import GUIDE_CHANNELS
from shared.models import DiT_models
from shared.precision import PRECISIONS

from sample.checkpoint import WEIGHTS
from sample.decode import DecodeOptions, run_decode
from sample.export import EXPORT_FORMATS, ExportOptions, run_export
from sample.generate import SampleOptions, run_sample
from sample.watch import REPORT_TO as WATCH_REPORT_TO, WatchOptions, run_watch

PROG = "python -m sample"
DESCRIPTION = """Class-conditional DiT sampling with classifier-free guidance, decoded by the VAE to PNGs, a grid and
an optional .npz. Commands:
  python -m sample --ckpt RUN|FILE [flags]       draw images (the flags below)
  python -m sample decode LATENTS|DIR [flags]    decode training's preview latents (python -m sample decode -h)
  python -m sample export RUN OUT [flags]        write a diffusers DiTPipeline folder (python -m sample export -h)
  python -m sample watch RUN [flags]             decode each preview as training writes it (python -m sample watch -h)
The DiT release's flag names work too: --global-seed, --per-proc-batch-size, --sample-dir, --num-fid-samples."""
EPILOG = """Resume: rerun the same command; images already in --out are kept and only the missing ones are
drawn. Image i's label and noise depend only on --seed and i, not on --batch-size or the number of
processes (pixels then match exactly wherever the floating-point kernels do: same device and threads).
Several GPUs: `accelerate launch -m sample ...` (rank r draws images i with i % world == r).
Decode training's latent samples: `python -m sample decode RUN/samples/step-0000100.safetensors`, or
`python -m sample decode RUN` for the newest preview (--all: every one)."""
# The flag that sets each setting shared/ names in its errors (shared.errors.ChoiceError / SettingError kinds).
FLAGS = {"model preset": "--model", "objective": "--objective", "weights": "--weights", "cfg scale": "--cfg-scale",
         "guide-channel choice": "--guide-channels", "sampler": "--sampler", "precision": "--precision",
         "ddim eta": "--ddim-eta", "vae": "--vae", "vae config": "--vae-config", "sample folder": "--out",
         "export format": "--format", "cfg interval": "--cfg-interval", "time shift": "--time-shift",
         "last step size": "--last-step-size", "sampling steps": "--num-sampling-steps",
         "flow time convention": "--flow-convention"}


def add_vae_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by sampling and decoding: which VAE and how it decodes."""
    p.add_argument("--vae", default=None,
                   help="VAE that decodes the latents: ema | mse (stabilityai/sd-vae-ft-*), a hub id, or a local "
                        "diffusers folder / weight file. Default: the VAE recorded in the weights' latent metadata, "
                        "else ema")
    p.add_argument("--vae-config", default=None, help="config.json for a single-file --vae (default: the config.json beside it)")
    p.add_argument("--vae-precision", choices=list(PRECISIONS), default="fp32",
                   help="VAE decoder precision (fp32 default; bf16/fp16 halve its memory)")
    p.add_argument("--vae-tiling", action="store_true", help="decode in overlapping tiles (less memory, faint seams)")
    p.add_argument("--vae-slicing", action="store_true", help="decode one image of a batch at a time (less memory)")
    p.add_argument("--allow-other-vae", action="store_true",
                   help="decode with a VAE whose scaling factor or config differs from the one recorded with the "
                        "latents (a deliberate swap); a VAE with other latent channels or downsample factor is "
                        "always refused")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Which weights, and the checks for official bare state dicts."""
    p.add_argument("--ckpt", required=True,
                   help="training run folder (newest EMA export), a checkpoints/step-* folder, a .safetensors "
                        "export (config read from it), or an official DiT .pt/.pth state dict")
    p.add_argument("--weights", choices=WEIGHTS, default=None,
                   help="with a run or checkpoint folder (or an official training checkpoint holding both): the EMA "
                        "weights or the raw training weights (default: ema; a file of one set is used as saved, "
                        "and asking it for the other set is refused)")
    p.add_argument("--model", choices=list(DiT_models), default=None,
                   help="official .pt only: the preset (default: inferred from tensor shapes, and said)")
    p.add_argument("--objective", choices=OBJECTIVE_NAMES, default=None,
                   help="official .pt only: the objective the weights were trained with (default: the release's for "
                        "a released name such as SiT-XL-2-256x256.pt, else ddpm); exports record their own")
    p.add_argument("--image-size", type=int, default=None,
                   help="official .pt only: image size in pixels, checked against latent size x VAE factor "
                        "(default: not checked)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """What to draw and how."""
    p.add_argument("--class-labels", nargs="+", default=None, metavar="CLASS",
                   help="class indices, or class names recorded with the latents (matched exactly, then ignoring "
                        "case), cycled over --num-samples (default: label i = i %% num_classes)")
    p.add_argument("--random-labels", action="store_true",
                   help="draw each image's class uniformly from its own (seed, i) generator instead")
    p.add_argument("--num-samples", "--num-fid-samples", type=int, default=None,
                   help="images to draw (default: one per --class-labels entry, else one per class)")
    p.add_argument("--cfg-scale", type=float, default=4.0,
                   help="classifier-free guidance scale; 1 = none (4.0 for pictures, 1.5 for FID)")
    p.add_argument("--guide-channels", choices=GUIDE_CHANNELS, default="auto",
                   help="latent channels guided: 3 (the DiT release's quirk for 4-channel latents), all, or auto "
                        "(3 for 4-channel latents, as the release; all otherwise); the rule used is printed")
    p.add_argument("--sampler", choices=SAMPLER_NAMES, default=None,
                   help="; ".join(f"{s.name} [{'/'.join(s.objectives)}]: {s.help}" for s in SAMPLERS.values())
                        + ". DiT's respacing calls the model at t = 0 too; the solvers' linspace spacing (diffusers' "
                          "default) steps from about t = 999/K straight to clean data. Default: the objective's own "
                          "(ddpm for DDPM models, sde for flow models); a sampler of another objective is refused")
    p.add_argument("--num-sampling-steps", type=int, default=250,
                   help="steps per image (model calls, twice the batch with guidance; heun: 2 calls per step): 250 "
                        "as the paper for ddpm and SiT's sde, ~50 for ddim, 10-25 for dpmpp-2m and unipc")
    p.add_argument("--cfg-interval", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="guide only at noise levels in [LO, HI] (Kynkaanniemi et al. 2024); elsewhere one conditional "
                        "call (half the work). Levels are the objective's: DiT timesteps 0-1000 for ddpm, the flow's "
                        "noise level 0-1 (REPA's time; 0 = data) for flow. REPA: 0 0.7; LightningDiT: 0 0.89 (default: guide at every level)")
    p.add_argument("--time-shift", type=float, default=None,
                   help="flow samplers (euler, heun, sde): LightningDiT's timestep shift s, tau' = s tau / (1 + (s-1) "
                        "tau); s < 1 puts more steps near noise (LightningDiT: 0.3; default 1 = none)")
    p.add_argument("--last-step-size", type=float, default=None,
                   help="sde only: the size of SiT's final deterministic Mean step (default 0.04, as SiT)")
    p.add_argument("--ddim-eta", type=float, default=None,
                   help="DDIM's noise scale eta in [0, 1] (Song et al. Eq. 16): 0 deterministic, 1 DDPM-like; only "
                        "with --sampler ddim (default 0)")
    p.add_argument("--seed", "--global-seed", type=int, default=0, help="image i's label and noise come from (seed, i)")
    p.add_argument("--batch-size", "--per-proc-batch-size", type=int, default=32,
                   help="images per forward pass (per process)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="DiT precision: fp32, or fp16/bf16 autocast")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="disable TF32 matmuls on Ampere+ GPUs (on by default, as the DiT release)")
    p.add_argument("--out", "--sample-dir", default=None,
                   help="output folder (default: samples/<ckpt>-cfg<s>-<sampler><steps>-seed<seed>)")
    p.add_argument("--npz", action="store_true",
                   help="also write samples.npz (arr_0 uint8 N x H x W x 3, labels) for FID tooling")


def sample_parser() -> argparse.ArgumentParser:
    """Parser of the default (sampling) command."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    add_model_flags(p)
    add_sampling_flags(p)
    add_vae_flags(p)
    return p


def decode_parser() -> argparse.ArgumentParser:
    """Parser of `decode`."""
    p = argparse.ArgumentParser(prog=f"{PROG} decode", formatter_class=HelpFormatter,
                                description="Decode RUN/samples/step-*.safetensors latents to PNGs and a grid.")
    p.add_argument("latents", metavar="LATENTS|DIR",
                   help="a latents file written by training's --sample-every, or a folder of them (RUN/samples, or "
                        "RUN itself): its newest file, or every file with --all")
    p.add_argument("--all", action="store_true", help="with a folder: decode every preview file, not just the newest")
    p.add_argument("--out", default=None,
                   help="output folder (default: the file's path without .safetensors; with --all, one subfolder "
                        "per file)")
    p.add_argument("--batch-size", type=int, default=16, help="latents decoded per VAE call")
    add_vae_flags(p)
    return p


def watch_parser() -> argparse.ArgumentParser:
    """Parser of `watch`."""
    p = argparse.ArgumentParser(prog=f"{PROG} watch", formatter_class=HelpFormatter,
                                description="Beside a training run: decode every RUN/samples/step-*.safetensors "
                                            "preview as it appears into a labelled grid RUN/samples/step-*.png (and "
                                            "the images into RUN/samples/step-*/), skipping those already decoded.")
    p.add_argument("run", metavar="RUN", help="the training run folder (train's --results-dir)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between looks for new preview files")
    p.add_argument("--exit-when-done", action="store_true",
                   help="stop once no training process holds RUN (finished, stopped or killed), after decoding "
                        "every preview; without it, run until Ctrl-C or SIGTERM")
    p.add_argument("--until-step", type=int, default=None, metavar="STEP",
                   help="stop once the checkpoint of STEP exists, after decoding every preview (train --watch-vae "
                        "passes its last step)")
    p.add_argument("--until-pid", type=int, default=None, metavar="PID",
                   help="stop once process PID has ended, after decoding every preview (train --watch-vae passes "
                        "its own PID)")
    p.add_argument("--report-to", choices=WATCH_REPORT_TO, default="auto",
                   help="log each grid as a TensorBoard image under RUN/tensorboard/previews: auto = when the run "
                        "was launched with --report-to tensorboard")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for decoding (default: torch's choice)")
    p.add_argument("--batch-size", type=int, default=16, help="latents decoded per VAE call")
    add_vae_flags(p)
    return p


def export_parser() -> argparse.ArgumentParser:
    """Parser of `export`."""
    p = argparse.ArgumentParser(prog=f"{PROG} export", formatter_class=HelpFormatter,
                                description="Write DiT weights as a folder diffusers' DiTPipeline.from_pretrained "
                                            "loads: transformer/, a copy of the VAE, a DDIM scheduler with DiT's betas.")
    p.add_argument("ckpt", metavar="RUN|FILE",
                   help="the weights, as sampling's --ckpt takes them: a run folder (newest EMA export), a checkpoint "
                        "folder, a .safetensors export, an official .pt, or a diffusers DiT")
    p.add_argument("out", metavar="OUT", help="the folder to write; refused if it exists (an empty folder is fine)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="diffusers",
                   help="output layout (diffusers: a DiTPipeline folder)")
    p.add_argument("--weights", choices=WEIGHTS, default=None,
                   help="with a run or checkpoint folder: the EMA weights or the raw training weights (default: ema)")
    p.add_argument("--vae", default=None,
                   help="VAE copied into OUT/vae (same forms as sampling's --vae). Default: the VAE recorded in the "
                        "weights' latent metadata, else ema")
    p.add_argument("--vae-config", default=None, help="config.json for a single-file --vae (default: the one beside it)")
    p.add_argument("--allow-other-vae", action="store_true",
                   help="copy a VAE whose scaling factor or config differs from the one recorded with the latents "
                        "(its configured scaling factor is set to the one used in training)")
    return p


def main(argv=None) -> None:
    """Dispatch `decode` or sampling; UserErrors and a full disk are printed as one paragraph (exit status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:
        with cli_errors(f"{PROG} export", FLAGS):
            run_export(ExportOptions(**vars(export_parser().parse_args(argv[1:]))))
        return
    if argv[:1] == ["watch"]:
        with cli_errors(f"{PROG} watch", FLAGS):
            run_watch(WatchOptions(**vars(watch_parser().parse_args(argv[1:]))))
        return
    decoding = bool(argv) and argv[0] == "decode"
    prog = f"{PROG} decode" if decoding else PROG
    with cli_errors(prog, FLAGS):
        if decoding:
            run_decode(DecodeOptions(**vars(decode_parser().parse_args(argv[1:]))))
        else:
            run_sample(SampleOptions(**vars(sample_parser().parse_args(argv))))


if __name__ == "__main__":
    main()
