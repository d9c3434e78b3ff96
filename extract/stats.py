"""`python -m extract --stats --out DIR`: add the per-channel latent statistics to a finished folder's index.json.

The statistics come from the stored moments (shared/tokenizers/norm.py `ChannelStats`, float64), the same numbers
an extraction writes, so a folder extracted before they existed gets them without encoding any image again.
index.json is rewritten atomically with only the "latent_stats" entry added or replaced, under the folder's lock.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from shared.datasets.shards import FOLDER_KIND, INDEX_NAME, LatentDataset, load_index
from shared.runtime.cli import counted
from shared.runtime.fsio import atomic_write_text
from shared.runtime.lock import hold_lock
from shared.tokenizers.classes import TOKENIZER_CLASSES
from shared.tokenizers.norm import ChannelStats, ElementStats

BATCH = 256  # samples per gather while reading the moments


def folder_stats(dataset: LatentDataset, progress: bool = True) -> dict:
    """index.json's "latent_stats" of a folder, computed from every stored sample and flip."""
    deterministic = dataset.deterministic
    columns = ("mean",) if deterministic else ("mean", "std")
    kind = TOKENIZER_CLASSES.get(dataset.vae.get("class"))
    stats, elements = ChannelStats(), ElementStats() if kind is not None and kind.element_stats else None
    for start in tqdm(range(0, len(dataset), BATCH), unit="batch", desc="stats", disable=not progress):
        batch = dataset.gather(np.arange(start, min(start + BATCH, len(dataset))), columns)  # (B, F, C, h, w) each
        stats.add(batch["mean"], batch.get("std"))
        if elements is not None:  # RAE tokens: also per element (C, h, w)
            elements.add(batch["mean"])
    summary = stats.summary(len(dataset), dataset.flips, deterministic)
    if elements is not None:
        summary["element"] = elements.summary(len(dataset), dataset.flips)
    return summary


def run_stats(out) -> str:
    """Compute the statistics of the folder `out` and write them into its index.json; the report line."""
    out = Path(out)
    load_index(out)  # a clear paragraph when it is not a finished latent folder
    with hold_lock(out, FOLDER_KIND):
        dataset = LatentDataset(out)  # hashes every shard against index.json first
        summary = folder_stats(dataset)
        index = load_index(out)
        before = index.get("latent_stats")
        index["latent_stats"] = summary
        atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=1) + "\n")
    change = "unchanged" if before == summary else ("replaced" if before else "added")
    element = " and per element" if "element" in summary else ""
    return (f"stats: {out}: per-channel{element} statistics of {counted(len(dataset), 'sample')} x "
            f"{counted(dataset.flips, 'flip')}, "
            f"{counted(len(summary['mean']), 'channel')} ({change} in {INDEX_NAME}); train with --latent-norm channel"
            f"{' or element' if element else ''}")
