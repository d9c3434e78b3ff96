"""`python -m extract` (or under `accelerate launch`): images (ImageFolder, tar, parquet) -> latent shards + index."""
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
         FOLDER_KIND: "--out", "duplicate policy": "--duplicates", "image size": "--image-size"}


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags, from ExtractConfig, the registered shard columns and ExtractModes; all with help."""
    from extract.config import ExtractConfig, ExtractModes
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


def _needs(value, refusal: str):
    """`value`, or the UserError paragraph `refusal` when the flag that sets it was not given."""
    if value is None:
        raise UserError(refusal)
    return value


def run_mode(args, cfg) -> int:
    """The job the flags pick: --verify, --stats, --check, --dry-run, else the extraction."""
    from extract.config import ExtractConfig

    if args.verify:
        from extract.verify import run_verify

        print(run_verify(_needs(cfg.out, "--verify needs --out: the latent folder to check.")))
        return 0
    if args.stats:
        from extract.stats import run_stats

        out = _needs(cfg.out, "--stats needs --out: the finished latent folder to add the statistics to.")
        given = cfg.vae if cfg.vae != ExtractConfig.vae or cfg.vae_config else None  # else the recorded one
        print(run_stats(out, given, cfg.vae_config))
        return 0
    _needs(cfg.data_path, "--data-path is required: pass the ImageFolder root (one sub-folder per class), the tar "
                          "shards (data/train-{000000..000146}.tar) or the parquet files.")
    if args.check:
        from extract.check import run_check
        from extract.config import source_options

        num_bad = run_check(cfg.data_path, cfg.image_size, cfg.num_workers, cfg.limit, cfg.max_image_pixels,
                            cfg.duplicates, source_options(cfg))
        return 1 if num_bad else 0
    from extract.dry_run import describe_plan
    from extract.run import format_summary, run_extract

    _needs(cfg.out, "--out is required to extract: pass the folder for the shards (or use --check).")
    if args.dry_run:
        print(describe_plan(cfg))
        return 0
    summary = run_extract(cfg)
    if summary:
        print(format_summary(summary))
    return 0


@interruptible(PROG)
def main(argv=None) -> int:
    """Parse flags, build the config once, run the job it picks; UserError becomes one clear paragraph."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with cli_errors(PROG, FLAGS):
        load_plugins(argv)  # first: a plugin's shard column adds flags
    from extract.config import ExtractConfig
    from shared.datasets.columns import flag_values

    args = build_parser().parse_args(argv)
    try:  # every flag's bounds checked once, by from_args
        return run_mode(args, from_args(ExtractConfig, args, column_flags=flag_values(lambda c: c.extract_flags, args)))
    except UserError as err:
        exit_with(err, PROG, FLAGS)


if __name__ == "__main__":
    sys.exit(main())
