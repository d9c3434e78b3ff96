"""`python -m extract` (or `accelerate launch -m extract ...`): ImageFolder -> latent shards + index.json."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.cli import HelpFormatter
from shared.errors import UserError, exit_with
from shared.shard_schema import EXTRA_STORAGE_DTYPES
from shared.shards import FLIP_MODES, FOLDER_KIND, STORAGE_DTYPES

PROG = "python -m extract"
# The flag that sets each setting shared/ and extract name in their errors (ChoiceError / SettingError kinds).
FLAGS = {"flip mode": "--flip", "storage dtype": "--dtype", "vae": "--vae", "vae config": "--vae-config",
         FOLDER_KIND: "--out", "feature storage dtype": "--repr-dtype"}


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags; every one has help."""
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Encode an ImageFolder (root/<class>/<image>) once with a frozen VAE into resumable latent\n"
                    "shards (posterior mean and std, optionally of both flips) for `python -m train`. Rerun the\n"
                    "same command to resume; run under `accelerate launch` to use several GPUs.",
    )
    p.add_argument("--data-path", type=Path, help="ImageFolder root: one sub-folder per class (required unless "
                                                  "--verify).")
    p.add_argument("--out", type=Path, help="Output folder for shards and index.json (required unless --check).")
    p.add_argument("--vae", default="ema",
                   help="ema | mse (stabilityai/sd-vae-ft-*), a local diffusers folder, a single weight file "
                        "(.safetensors/.ckpt/.pt) or a hub id (default: ema).")
    p.add_argument("--vae-config", type=Path,
                   help="config.json for a single-file --vae when none sits beside the file.")
    p.add_argument("--image-size", type=int, default=256,
                   help="Side of the square centre crop (ADM preprocessing); a multiple of the VAE's "
                        "downsample factor (default: 256).")
    p.add_argument("--flip", choices=list(FLIP_MODES), default="both",
                   help="both: also store the horizontally mirrored image's moments (train picks one per "
                        "step); none: originals only (default: both).")
    p.add_argument("--batch-size", type=int, default=64,
                   help="Images per encoder batch (x2 with --flip both; default: 64).")
    p.add_argument("--num-workers", type=int, default=None,
                   help="Image-decoding processes per extract process (default: up to 8, from the CPU count).")
    p.add_argument("--dtype", choices=list(STORAGE_DTYPES), default="fp16",
                   help="Storage dtype of the moments; encoding always runs in fp32 (default: fp16).")
    p.add_argument("--shard-size", type=int, default=4096,
                   help="Images per shard, also the unit of resume (default: 4096).")
    p.add_argument("--limit", type=int, default=None,
                   help="Use only N images, spread evenly over the sorted list (for a quick trial; default: all).")
    p.add_argument("--repr-encoder", default=None,
                   help="Also store a frozen encoder's patch tokens for REPA (train --repa-weight): a DINOv2 "
                        "folder saved by transformers' save_pretrained or a Hub id such as facebook/dinov2-base; "
                        "run once per image and stored flip, fp32 (default: none). The dry run prints the storage.")
    p.add_argument("--repr-image-size", type=int, default=None,
                   help="Pixels per side the encoder sees, a multiple of its patch size (default: REPA's, "
                        "image-size / 16 patches: 224 for DINOv2/14 at 256 px).")
    p.add_argument("--repr-dtype", choices=list(EXTRA_STORAGE_DTYPES), default="fp16",
                   help="Storage dtype of the encoder tokens (default: fp16; DINOv2-B at 256 px: ~384 KiB per "
                        "image and flip).")
    p.add_argument("--check", action="store_true",
                   help="Validate the dataset without encoding: images per class, first image's size and "
                        "mode, bad files (opens every image; no VAE). Exit status 1 if bad files are found.")
    p.add_argument("--dry-run", action="store_true",
                   help="Run every check and print the plan (images, shards, VAE, settings) without loading "
                        "the VAE or writing anything.")
    p.add_argument("--verify", action="store_true",
                   help="Hash every shard of the finished folder --out against its index.json and report damage; "
                        "changes nothing (a damaged folder: rerun the extraction command, it redoes those shards).")
    p.add_argument("--strict", action="store_true",
                   help="Stop at the first bad image instead of skipping and recording it.")
    return p


def _config(args):
    """ExtractConfig from parsed arguments."""
    from extract.run import ExtractConfig

    if args.out is None:
        raise UserError("--out is required to extract: pass the folder for the shards (or use --check).")
    return ExtractConfig(
        data_path=args.data_path, out=args.out, vae=args.vae, vae_config=args.vae_config,
        image_size=args.image_size, flip=args.flip, batch_size=args.batch_size, num_workers=args.num_workers,
        dtype=args.dtype, shard_size=args.shard_size, limit=args.limit, strict=args.strict,
        repr_encoder=args.repr_encoder, repr_image_size=args.repr_image_size, repr_dtype=args.repr_dtype,
    )


def main(argv=None) -> int:
    """Parse flags and run the check or the extraction; UserError becomes one clear paragraph."""
    args = build_parser().parse_args(argv)
    try:
        if args.verify:
            from extract.verify import run_verify

            if args.out is None:
                raise UserError("--verify needs --out: the latent folder to check.")
            print(run_verify(args.out))
            return 0
        if args.data_path is None:
            raise UserError("--data-path is required: pass the ImageFolder root (one sub-folder per class).")
        if args.check:
            from extract.check import run_check

            num_bad = run_check(args.data_path, args.image_size, args.num_workers, args.limit)
            return 1 if num_bad else 0
        from extract.run import describe_plan, format_summary, run_extract

        if args.dry_run:
            print(describe_plan(_config(args)))
            return 0
        summary = run_extract(_config(args))
        if summary:
            print(format_summary(summary))
        return 0
    except UserError as err:
        exit_with(err, PROG, FLAGS)


if __name__ == "__main__":
    sys.exit(main())
