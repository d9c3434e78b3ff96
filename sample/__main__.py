"""CLI: `python -m sample --ckpt ...` draws images; `python -m sample decode LATENTS|DIR` decodes training samples."""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import sys
from functools import partial

from shared.runtime.cli import HelpFormatter, add_flags, from_args
from shared.runtime.errors import cli_errors
from shared.sampling.flags import SAMPLING_SETTING_FLAGS
from shared.runtime.plugins import load_plugins

from sample.decode import DecodeOptions, run_decode
from sample.to_diffusers import ToDiffusersOptions, run_to_diffusers
from shared.sampling.plan import SampleOptions
from shared.sampling.generate import run_sample
from sample.watch import WatchOptions, run_watch

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
# The flag of each setting shared/ names in its errors (shared.runtime.errors.ChoiceError / SettingError settings).
FLAGS = {"model preset": "--model", "objective": "--objective", "weights": "--weights", "vae": "--vae",
         "vae config": "--vae-config", "sample folder": "--out", "export format": "--format", **SAMPLING_SETTING_FLAGS}


def _parser(prog: str, options, **kwargs) -> argparse.ArgumentParser:
    """A parser whose flags are the fields of the options dataclass `options`."""
    return add_flags(argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, **kwargs), options)


# The parser of each command: the default (drawing images), decode, watch and export.
sample_parser = partial(_parser, PROG, SampleOptions, description=DESCRIPTION, epilog=EPILOG)
decode_parser = partial(_parser, f"{PROG} decode", DecodeOptions,
                        description="Decode RUN/samples/step-*.safetensors latents to PNGs and a grid.")
watch_parser = partial(_parser, f"{PROG} watch", WatchOptions,
                       description="Beside a training run: decode every RUN/samples/step-*.safetensors preview as it "
                                   "appears into a labelled grid RUN/samples/step-*.png (and the images into "
                                   "RUN/samples/step-*/), skipping those already decoded.")
export_parser = partial(_parser, f"{PROG} export", ToDiffusersOptions,
                        description="Write DiT weights as a folder diffusers' DiTPipeline.from_pretrained loads: "
                                    "transformer/, a copy of the VAE, a DDIM scheduler with DiT's betas.")
# Each command after `python -m sample`: its parser, options and run (None: drawing images, the default command).
COMMANDS = {None: (sample_parser, SampleOptions, run_sample), "decode": (decode_parser, DecodeOptions, run_decode),
            "watch": (watch_parser, WatchOptions, run_watch),
            "export": (export_parser, ToDiffusersOptions, run_to_diffusers)}


@interruptible(PROG)
def main(argv=None) -> None:
    """Dispatch a command; UserErrors and a full disk are printed as one paragraph (exit status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv[:1] and argv[0] in COMMANDS else None
    parser, options, run = COMMANDS[command]
    with cli_errors(f"{PROG} {command}" if command else PROG, FLAGS):
        if command != "export":  # first: a plugin's sampler is a --sampler choice; its objective, tokenizer class exist
            load_plugins(argv)
        run(from_args(options, parser().parse_args(argv[1:] if command else argv)))


if __name__ == "__main__":
    main()
