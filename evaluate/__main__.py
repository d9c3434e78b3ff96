"""CLI: `python -m evaluate SAMPLES.npz --ref REF` measures FID, sFID, IS, precision and recall."""
from __future__ import annotations

import argparse
import sys

from evaluate.evaluation import EvalOptions, evaluate_samples
from evaluate.features import FEATURE_NETWORKS
from evaluate.metrics import IS_SPLIT_SIZE
from shared.errors import cli_errors

PROG = "python -m evaluate"
DESCRIPTION = """Sample quality as DiT papers report it (the ADM evaluator's definitions): FID and precision/recall
on Inception pool features, sFID on mixed_6/conv spatial features, IS on the 1008 logits. Prints a table and one
JSON line, and appends that line to SAMPLES.eval.jsonl beside the samples.
  python -m evaluate SAMPLES.npz --ref REF          Inception features (REF: ADM reference batch, stats file,
                                                    images npz or folder)
  python -m evaluate SAMPLES.npz --features digits  the digits yardstick (reference: the real digits)
  python -m evaluate run RUN --num-samples N [...]  every EMA export of a training run -> RUN/eval.jsonl and
                                                    RUN/eval.png (python -m evaluate run -h)"""
EPILOG = """Several processes: `accelerate launch -m evaluate ...` splits the images over processes.
Inception weights: pytorch-fid's pt_inception-2015-12-05-6726825d.pth, from --inception-weights or the torch hub
checkpoints folder (downloaded there on first use where the network allows)."""
FLAGS = {"feature network": "--features"}


def eval_parser() -> argparse.ArgumentParser:
    """Parser of the default (one samples file) command."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", metavar="SAMPLES.npz",
                   help="images to evaluate: npz with arr_0 uint8 N x H x W x 3 (as `python -m sample --npz` writes)")
    p.add_argument("--ref", default=None,
                   help="reference: an ADM reference batch (arr_0 and/or mu, sigma, mu_s, sigma_s), a statistics file "
                        "from --save-stats, or an images npz / image folder (its statistics are cached). Default with "
                        "--features digits: the real digits; required otherwise")
    p.add_argument("--features", choices=FEATURE_NETWORKS, default="inception",
                   help="feature network: inception (the FID network, 299x299) or digits (the demo's yardstick, "
                        "32x32 digits only) (default: inception)")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass per process (default: 64)")
    p.add_argument("--is-split-size", type=int, default=IS_SPLIT_SIZE,
                   help=f"samples per Inception Score split (default: {IS_SPLIT_SIZE}, as ADM; other values, or fewer "
                        f"samples than one split, give an IS marked not comparable to published ones)")
    p.add_argument("--save-stats", default=None, metavar="OUT.npz",
                   help="also write the samples' statistics (mu, sigma, mu_s, sigma_s, pool features) to OUT.npz, "
                        "usable as --ref later (default: not written)")
    p.add_argument("--inception-weights", default=None, metavar="FILE",
                   help="pytorch-fid's FID Inception state dict (default: the torch hub checkpoints folder)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present (default: off)")
    p.add_argument("--no-save", action="store_true",
                   help="print only; do not append the result to SAMPLES.eval.jsonl (default: off)")
    return p


class CommandParser:
    """The two commands' parsers behind one parse_args: `run ...` goes to the run parser, anything else to eval's."""

    def parse_args(self, argv=None) -> argparse.Namespace:
        """Parse argv with the parser of its command; the namespace's `command` says which."""
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv[:1] == ["run"]:
            from evaluate.curve import run_parser

            return argparse.Namespace(command="run", **vars(run_parser().parse_args(argv[1:])))
        return argparse.Namespace(command="evaluate", **vars(eval_parser().parse_args(argv)))


def build_parser() -> CommandParser:
    """The CLI's parser (both commands)."""
    return CommandParser()


def main(argv=None) -> None:
    """Dispatch `run` or one evaluation; UserErrors are printed as one paragraph (exit status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from evaluate.curve import main_run

        return main_run(argv[1:])
    with cli_errors(PROG, FLAGS):
        evaluate_samples(EvalOptions(**vars(eval_parser().parse_args(argv))))


if __name__ == "__main__":
    main()
