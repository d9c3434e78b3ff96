"""`python -m train` (or `accelerate launch -m train`): train a DiT on cached latents. Flags: --help."""
import sys

from shared.errors import UserError, exit_with
from train.config import build_parser, config_from_args

PROG = "python -m train"


def main(argv=None) -> int:
    """Parse flags, run training, print UserErrors as one paragraph (exit status 2)."""
    args = build_parser(PROG).parse_args(argv)
    try:
        from train.loop import train

        train(config_from_args(args))
    except UserError as err:
        exit_with(err, PROG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
