"""One evaluation: samples npz + reference -> FID, sFID, IS, precision, recall; a table and a JSON line.

Everything a user can get wrong (the npz, the reference, the resolution, the IS split) is checked before the
feature network is loaded.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from evaluate.images import compute_features, open_npz_images
from evaluate.metrics import IS_SPLIT_SIZE, METRICS, PR_NEIGHBOURS, check_reference, check_split_size, \
    comparability_note, is_comparable, open_reference, save_stats, score, source_meta, stats_from_features
from shared.runtime.cli import Flag, check_flag_bounds, option
from shared.sampling.flags import CPU
from shared.runtime.fsio import atomic_write_text

RESULT_SUFFIX = ".eval.jsonl"  # SAMPLES.npz -> SAMPLES.eval.jsonl, one line per evaluation
# Feature networks: uint8 image batches in, named arrays out; `pool` (N, D) feeds FID and precision/recall, Inception
# adds `spatial` (N, 2023) for sFID and `logits` (N, 1008) for IS.
FEATURE_NETWORKS = ("inception", "digits")


# Flags both evaluate commands take (one samples file, and `run` over a training run's exports).
REF = Flag("reference: an ADM reference batch (arr_0 and/or mu, sigma, mu_s, sigma_s), a statistics file from "
           "--save-stats, or an images npz / image folder (its statistics are cached). Default with --features "
           "digits: the real digits; required otherwise", None)
FEATURES = Flag("feature network: inception (the FID network, 299x299) or digits (the demo's yardstick, 32x32 digits "
                "only)", "inception", choices=FEATURE_NETWORKS)
IS_SPLIT = Flag("samples per Inception Score split (ADM's; other values, or fewer samples than one split, give an IS "
                "marked not comparable to published ones)", IS_SPLIT_SIZE)
INCEPTION_WEIGHTS = Flag("pytorch-fid's FID Inception weights file, pt_inception-2015-12-05-6726825d.pth, for a machine "
                         "that cannot download it; its sha256 must start with the 6726825d of its name (default: the "
                         "torch hub checkpoints folder, downloaded there on first use)", None, metavar="FILE")


@dataclass
class EvalOptions:
    """Everything `python -m evaluate SAMPLES.npz` accepts (one field per flag: its default and help)."""
    samples: str = option(help="images to evaluate: npz with arr_0 uint8 N x H x W x 3 (as `python -m sample --npz` "
                               "writes)", positional=True, metavar="SAMPLES.npz")
    ref: str | None = REF.field()
    features: str = FEATURES.field()
    batch_size: int = option(64, "images per forward pass per process", min=1)
    is_split_size: int = IS_SPLIT.field()
    save_stats: str | None = option(None, "also write the samples' statistics (mu, sigma, mu_s, sigma_s, pool "
                                          "features) to OUT.npz, usable as --ref later (default: not written)",
                                    metavar="OUT.npz")
    inception_weights: str | None = INCEPTION_WEIGHTS.field()
    cpu: bool = CPU.field()
    no_save: bool = option(False, "print only; do not append the result to SAMPLES.eval.jsonl")


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line to `path` (rewritten atomically: a kill never leaves half a line)."""
    old = Path(path).read_text(encoding="utf-8") if Path(path).is_file() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    atomic_write_text(path, old + json.dumps(record) + "\n")


def check_options(o: EvalOptions) -> None:
    """Numbers and choices that need no file."""
    assert o.features in FEATURE_NETWORKS, o.features  # a flag choice
    check_flag_bounds(o)  # the bounds declared on the options; again here for options built in Python (evaluate run)


def check_image_size(name: str, size) -> None:
    """UserError if feature network `name` cannot take images of `size` (H, W); loads no network."""
    if name == "digits":
        from evaluate.digits import check_size
        check_size(*size)


def build_features(name: str, device="cpu", weights=None):
    """The feature network `name` on `device` (`weights`: the Inception weights file, if given)."""
    if name == "digits":
        from evaluate.digits import DigitsFeatures
        return DigitsFeatures(device)
    assert name == "inception", name  # a flag choice, checked by check_options
    from evaluate.inception import InceptionFeatures
    return InceptionFeatures(device, weights)


def evaluate_samples(o: EvalOptions, net=None, show: bool = True) -> dict:
    """Evaluate `o.samples` against `o.ref`; return the result record (also appended beside the samples)."""
    check_options(o)
    samples = open_npz_images(o.samples)
    reference = open_reference(o.ref, o.features)
    check_reference(reference, o.features, samples.size)
    check_image_size(o.features, samples.size)
    if o.features == "inception":
        check_split_size(o.is_split_size)  # fewer samples than one split: IS computed, marked not comparable
    from shared.runtime.distributed import process_state
    state = process_state(cpu=o.cpu)
    rank, world, device = state.process_index, state.num_processes, state.device
    start = time.time()
    if net is None:
        net = build_features(o.features, "cpu" if o.cpu else device, o.inception_weights)
    feats = compute_features(samples, net, o.batch_size, rank, world, "samples")
    metrics, ref_stats = score(feats, reference, net, o.batch_size, rank, world, o.is_split_size)
    record = {**metrics,
              "num_samples": samples.count, "image_size": list(samples.size), "samples": str(o.samples),
              "ref": reference.label, "ref_count": ref_stats.meta.get("count"), "features": net.identity(),
              "pr_k": PR_NEIGHBOURS, "is_split_size": o.is_split_size if "logits" in feats else None,
              "is_comparable": is_comparable(samples.count, o.is_split_size) if "logits" in feats else None,
              "seconds": round(time.time() - start, 2)}
    if rank == 0:
        if o.save_stats:
            save_stats(o.save_stats, stats_from_features(feats, source_meta(net, samples)))
        if not o.no_save:
            append_jsonl(samples.path.with_name(samples.path.name.removesuffix(".npz") + RESULT_SUFFIX), record)
        if show:
            print(format_table(record))
            print(json.dumps(record), flush=True)
    return record


def _fmt(value) -> str:
    """A metric for the table: 4 significant decimals, '-' when not defined."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def format_table(record: dict) -> str:
    """The human table of one result."""
    rows = [("samples", f"{record['samples']} ({record['num_samples']} images, {record['image_size'][1]}x"
                        f"{record['image_size'][0]})"),
            ("reference", record["ref"] + (f" ({record['ref_count']} images)" if record["ref_count"] else "")),
            ("features", record["features"]["name"])]
    rows += [(name, _fmt(record[name])) for name in METRICS]
    if record.get("is_comparable") is False and record["inception_score"] is not None:
        note = comparability_note(record["num_samples"], record["is_split_size"])
        rows = [(n, f"{v}  ({note})" if n == "inception_score" else v) for n, v in rows]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
