"""`python -m extract --dry-run`: the plan in words (images, shards, tokenizer, storage); nothing loaded or written."""
from __future__ import annotations

import json

from extract.config import ExtractConfig, Plan, make_plan
from extract.run import read_finished
from shared.datasets.columns import columns
from shared.datasets.shards import FLIP_MODES, STORAGE_DTYPES
from shared.datasets.sources import describe_source
from shared.runtime.cli import counted


def describe_plan(cfg: ExtractConfig) -> str:
    """What a run would do (--dry-run): every check, nothing loaded or written."""
    plan = make_plan(cfg)
    done = sum(read_finished(plan, j) is not None for j in range(plan.num_shards))
    frames = "original + mirror" if cfg.flip == "both" else "original only"
    return "\n".join([
        f"data: {plan.scan.root} ({describe_source(plan.scan)}): {counted(len(plan.scan), 'image')} in "
        f"{counted(len(plan.scan.classes), 'class', 'classes')}",
        f"data: {plan.scan.skipped.describe()}",
        *(f"data: {note}" for note in plan.scan.notes),
        f"vae: {plan.vae_name} (encoder fp32); moments stored as {cfg.dtype}, {frames}",
        describe_tokenizer(plan),
        f"out: {plan.out}: {counted(plan.num_shards, 'shard')} of {counted(cfg.shard_size, 'image')}, {done} "
        f"already finished (their sha256 is checked when the run starts)",
        *describe_storage(plan),
        *(f"warning: {w}" for w in plan.warnings),
        "settings: " + json.dumps(plan.settings, sort_keys=True),
    ])


def describe_tokenizer(plan: Plan) -> str:
    """The dry run's tokenizer line: class, measured latent and factor, its own normalisation."""
    kind, size = plan.kind, plan.cfg.image_size
    channels, side, _ = plan.latent_shape
    norm = kind.native_norm(plan.vae_config, None)
    if norm is not None:
        own = norm.describe()
    elif kind.element_stats:
        own = "none in its config: the folder's per-element statistics (train --latent-norm auto uses them)"
    else:
        own = "read from its weights when loaded"
    stats = "per-channel and per-element" if kind.element_stats else "per-channel"
    return (f"tokenizer: {kind.name}{' (deterministic)' if kind.deterministic else ''}: latent {channels}x{side}x{side} "
            f"at {size} px (f{size // side}, measured by encoding one {size}x{size} image on the meta device); own "
            f"normalisation {own}; {stats} statistics of the folder are written to index.json")


def _size(n: float) -> str:
    """Bytes in binary units (KiB .. TiB), three significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024


IMAGENET_TRAIN_IMAGES = 1_281_167  # for the dry run's "at ImageNet scale" line


def describe_storage(plan: Plan) -> list[str]:
    """What the shards will take: per image (latent moments, extra columns) and for the folder (payloads only)."""
    frames, dtype = FLIP_MODES[plan.cfg.flip], plan.cfg.dtype
    channels, side, _ = plan.latent_shape
    tensors, what = (1, "latent (deterministic tokenizer, no std)") if plan.kind.deterministic else (2, "mean+std")
    moments = tensors * frames * channels * side * side * STORAGE_DTYPES[dtype].itemsize
    lines = [f"storage: moments {_size(moments)} per image ({frames} flip(s) x {what} {channels}x{side}x{side} "
             f"{dtype}) = {moments:,} bytes"]
    per_image = moments
    for name, record in plan.columns.items():
        nbytes, line = columns()[name].storage(record, frames)
        per_image += nbytes
        lines.append("storage: " + line.format(size=_size(nbytes)))
    lines.append(f"storage: {_size(per_image)} per image, {_size(per_image * len(plan.scan))} for these "
                 f"{counted(len(plan.scan), 'image')} (+ tar headers, ~1 KiB per image); at ImageNet's "
                 f"{IMAGENET_TRAIN_IMAGES:,} images: {_size(per_image * IMAGENET_TRAIN_IMAGES)}")
    return lines
