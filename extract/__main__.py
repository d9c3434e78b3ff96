"""`python -m extract` (or `accelerate launch -m extract ...`): images (ImageFolder, tar shards, parquet) -> latent
shards + index.json."""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import sys

from shared.runtime.cli import HelpFormatter, add_flags, from_args
from shared.runtime.errors import UserError, cli_errors, exit_with
from shared.runtime.plugins import load_plugins
from shared.datasets.shards import FOLDER_KIND

PROG = "python -m extract"
# The flag that sets each setting shared/ and extract name in their errors (ChoiceError / SettingError kinds).
FLAGS = {"flip mode": "--flip", "storage dtype": "--dtype", "vae": "--vae", "vae config": "--vae-config",
         FOLDER_KIND: "--out",
         "duplicate policy": "--duplicates", "image size": "--image-size"}


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags, from ExtractConfig, the registered shard columns and ExtractModes; all with help."""
    from extract.run import ExtractConfig, ExtractModes
    from shared.datasets.columns import columns

    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Encode an ImageFolder (root/<class>/<image>), webdataset tar shards or a parquet dataset once\n"
                    "with a frozen VAE into resumable latent shards (posterior mean and std, optionally of both\n"
                    "flips) for `python -m train`. Rerun the same command to resume; run under `accelerate launch`\n"
                    "to use several GPUs.",
    )
    add_flags(p, ExtractConfig, skip=("strict",))
    for column in columns().values():
        add_flags(p, column.extract_flags)
    add_flags(p, ExtractModes)
    return add_flags(p, ExtractConfig, only=("strict",))


def _config(args):
    """ExtractConfig from parsed arguments."""
    from extract.run import ExtractConfig
    from shared.datasets.columns import flag_values

    if args.out is None:
        raise UserError("--out is required to extract: pass the folder for the shards (or use --check).")
    return from_args(ExtractConfig, args, column_flags=flag_values(lambda c: c.extract_flags, args))


@interruptible(PROG)
def main(argv=None) -> int:
    """Parse flags and run the check or the extraction; UserError becomes one clear paragraph."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with cli_errors(PROG, FLAGS):
        load_plugins(argv)  # first: a plugin's shard column adds flags
    args = build_parser().parse_args(argv)
    try:
        if args.verify:
            from extract.verify import run_verify

            if args.out is None:
                raise UserError("--verify needs --out: the latent folder to check.")
            print(run_verify(args.out))
            return 0
        if args.stats:
            from extract.run import ExtractConfig
            from extract.stats import run_stats

            if args.out is None:
                raise UserError("--stats needs --out: the finished latent folder to add the statistics to.")
            given = args.vae if args.vae != ExtractConfig.vae or args.vae_config else None  # else the recorded one
            print(run_stats(args.out, given, args.vae_config))
            return 0
        if args.data_path is None:
            raise UserError("--data-path is required: pass the ImageFolder root (one sub-folder per class), the tar "
                            "shards (data/train-{000000..000146}.tar) or the parquet files.")
        if args.check:
            from extract.check import run_check
            from extract.run import source_options

            num_bad = run_check(args.data_path, args.image_size, args.num_workers, args.limit,
                                args.max_image_pixels, args.duplicates, source_options(args))
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
