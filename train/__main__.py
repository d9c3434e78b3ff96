"""`python -m train` (or `accelerate launch -m train`): train a DiT on cached latents. Flags: --help."""
from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import sys

from shared.runtime.cli import flag_name, given_flags
from shared.runtime.errors import cli_errors
from shared.runtime.plugins import load_plugins
from train.config import BLOCK_FLAGS, build_parser, config_from_args

PROG = "python -m train"


# Which flag sets each domain vocabulary that shared/ may report a bad value of.
FLAGS = {"model preset": "--model", "attention backend": "--attention", "precision": "--precision",
         "guide-channel choice": "--sample-guide-channels", "run folder": "--results-dir", "vae": "--watch-vae",
         "objective": "--objective", "time dist shift": "--time-dist-shift", "head depth": "--head-depth",
         "head width": "--head-width", "head heads": "--head-heads", **BLOCK_FLAGS}


def objective_flags() -> dict:
    """The flag of each registered objective's training field, by its domain name ("time sampling": ...)."""
    from shared.generative.objectives import training_flags

    return {name.replace("_", " "): flag_name(name) for name in training_flags()}


@interruptible(PROG)
def main(argv=None, callbacks=()) -> int:
    """Parse flags, run training, print UserErrors as one paragraph (exit status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with cli_errors(PROG, FLAGS):
        load_plugins(argv)  # first: a plugin's objective adds flags
    parser = build_parser(PROG)
    args = parser.parse_args(argv)
    explicit = given_flags(parser, argv)  # a --recipe never overrides a flag given on the command line
    if "model" not in explicit:  # said before anything is built: the default is DiT's largest model
        from shared.network.models import PRESETS

        preset = PRESETS[args.model]
        print(f"{PROG}: no --model given: training {args.model}, DiT's headline model (depth {preset['depth']}, "
              f"width {preset['hidden_size']}), at global batch {args.global_batch_size}, as the paper did on GPUs. "
              "Building it takes a while; pass --model DiT-S/2 (or DiT-T/2) for a quick trial.", file=sys.stderr,
              flush=True)
    with cli_errors(PROG, {**FLAGS, **objective_flags()}):
        from train.loop import train

        train(config_from_args(args, explicit), callbacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
