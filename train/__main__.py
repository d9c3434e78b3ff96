"""`python -m train` (or `accelerate launch -m train`): train a DiT on cached latents. Flags: --help."""
import sys

from shared.runtime.cli import given_flags
from shared.runtime.errors import cli_errors
from train.config import build_parser, config_from_args

PROG = "python -m train"


# Which flag sets each domain vocabulary that shared/ may report a bad value of.
FLAGS = {"model preset": "--model", "attention backend": "--attention", "precision": "--precision",
         "guide-channel choice": "--sample-guide-channels", "run folder": "--results-dir", "vae": "--watch-vae",
         "objective": "--objective", "time sampling": "--time-sampling", "time loc": "--time-loc",
         "time scale": "--time-scale", "cos weight": "--cos-weight", "time dist shift": "--time-dist-shift",
         "head depth": "--head-depth", "head width": "--head-width", "head heads": "--head-heads"}


def main(argv=None, callbacks=()) -> int:
    """Parse flags, run training, print UserErrors as one paragraph (exit status 2)."""
    parser = build_parser(PROG)
    args = parser.parse_args(argv)
    explicit = given_flags(parser, argv)  # a --recipe never overrides a flag given on the command line
    with cli_errors(PROG, FLAGS):
        from train.loop import train

        train(config_from_args(args, explicit), callbacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
