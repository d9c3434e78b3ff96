"""CLI: `python -m evaluate SAMPLES.npz --ref REF` measures FID, sFID, IS, precision and recall."""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import sys

from evaluate.evaluation import EvalOptions, evaluate_samples
from shared.runtime.cli import HelpFormatter, add_flags, from_args
from shared.runtime.errors import cli_errors

PROG = "python -m evaluate"
DESCRIPTION = """Sample quality as DiT papers report it (the ADM evaluator's definitions): FID and precision/recall
on Inception pool features, sFID on mixed_6/conv spatial features, IS on the 1008 logits. Prints a table and one
JSON line, and appends that line to SAMPLES.eval.jsonl beside the samples.
  python -m evaluate SAMPLES.npz --ref REF          Inception features (REF: ADM reference batch, stats file,
                                                    images npz or folder)
  python -m evaluate SAMPLES.npz --features digits  the digits yardstick (reference: the real digits)
  python -m evaluate run RUN --num-samples N [...]  every EMA export of a training run -> RUN/eval.jsonl and
                                                    RUN/eval.png (python -m evaluate run -h)
  python -m evaluate reference IMAGES --image-size S --out REF.npz
                                                    real images centre-cropped to S (as extract) into a --ref"""
EPILOG = """Several processes: `accelerate launch -m evaluate ...` splits the images over processes.
Inception weights: pytorch-fid's pt_inception-2015-12-05-6726825d.pth, from --inception-weights or the torch hub
checkpoints folder (downloaded there on first use where the network allows)."""
FLAGS = {"feature network": "--features"}


def eval_parser() -> argparse.ArgumentParser:
    """Parser of the default (one samples file) command."""
    return add_flags(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                             formatter_class=HelpFormatter), EvalOptions)


@interruptible(PROG)
def main(argv=None) -> None:
    """Dispatch `run` or one evaluation; UserErrors are printed as one paragraph (exit status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from evaluate.curve import main_run
        return main_run(argv[1:])
    if argv[:1] == ["reference"]:
        from evaluate.reference import main_reference
        return main_reference(argv[1:])
    with cli_errors(PROG, FLAGS):
        evaluate_samples(from_args(EvalOptions, eval_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
