"""`python -m extract --stats --out DIR`: (re)write a finished folder's latent space with its statistics.

The statistics come from the stored moments (shared/datasets/shards.py `ChannelStats`, float64), the numbers an
extraction writes, so an older folder gets them without encoding again and a damaged latent_space.json is rebuilt
(its tokenizer from index.json's record, loaded on the CPU). Only latent_space.* and index.json's "latent_space" hash
are rewritten (atomically, under the folder's lock).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from shared.datasets.shards import FOLDER_KIND, INDEX_NAME, ChannelStats, ElementStats, LatentDataset, load_index
from shared.runtime.cli import counted
from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write_text
from shared.runtime.lock import hold_lock
from shared.tokenizers.tokenizer import TOKENIZER_CLASSES
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import SPACE_JSON, LatentSpace

BATCH = 256  # samples per gather while reading the moments


def folder_stats(dataset: LatentDataset, element: bool, progress: bool = True) -> tuple[dict, dict]:
    """(normalisations by name, what they were computed from) of a folder, from every stored sample and flip."""
    deterministic = dataset.deterministic
    columns = ("mean",) if deterministic else ("mean", "std")
    stats, elements = ChannelStats(), ElementStats() if element else None
    for start in tqdm(range(0, len(dataset), BATCH), unit="batch", desc="stats", disable=not progress):
        batch = dataset.gather(np.arange(start, min(start + BATCH, len(dataset))), columns)  # (B, F, C, h, w) each
        stats.add(batch["mean"], batch.get("std"))
        if elements is not None:  # RAE tokens: also per element (C, h, w)
            elements.add(batch["mean"])
    norms = {}
    norms["channel"], statistics = stats.summary(len(dataset), dataset.flips, deterministic)
    if elements is not None:
        norms["element"], statistics["element"] = elements.summary(len(dataset), dataset.flips)
    return norms, statistics


def tokenizer_space(dataset: LatentDataset, vae: str | None, vae_config) -> LatentSpace:
    """The tokenizer's part of the folder's space, from the tokenizer index.json records (or --vae), on the CPU."""
    recorded = dataset.meta.get("extract_settings", {}).get("vae", {})
    if not (vae or recorded.get("source")):
        raise UserError(f"{dataset.root}/index.json names no tokenizer to rebuild its latent space from; pass the "
                        f"--vae the folder was extracted with.")
    tokenizer = load_tokenizer(vae or recorded["source"], config=vae_config)
    if recorded.get("config_sha256") not in (None, tokenizer.identity["config_sha256"]):
        raise UserError(f"the tokenizer {tokenizer.identity['source']} is not the one that made the latents of "
                        f"{dataset.root} (its config hash differs from the one index.json records); pass the --vae "
                        f"the folder was extracted with.")
    return LatentSpace.of_tokenizer(tokenizer, dataset.image_size, dataset.latent_shape, dataset.class_names)


def run_stats(out, vae: str | None = None, vae_config=None) -> str:
    """Compute the statistics of the folder `out`, write its latent_space.* and index.json; the report line."""
    out = Path(out)
    load_index(out)  # a clear paragraph when it is not a finished latent folder
    with hold_lock(out, FOLDER_KIND):
        dataset = LatentDataset(out)  # hashes every shard against index.json first
        try:  # the folder's space as recorded, or None when its record is damaged (it is rebuilt)
            before = dataset.space
        except UserError:
            before = None
        base = before.tokenizer_only() if before is not None and vae is None else \
            tokenizer_space(dataset, vae, vae_config)
        kind = TOKENIZER_CLASSES.get(base.tokenizer.get("class"))
        norms, statistics = folder_stats(dataset, kind is not None and kind.element_stats)
        space = base.with_norms(statistics, **norms)
        index = load_index(out)
        index["latent_space"] = space.write(out)
        atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=1) + "\n")
    change = "unchanged" if before == space else ("replaced" if before is not None and "channel" in before.norms
                                                  else "added")
    element = " and per element" if "element" in norms else ""
    return (f"stats: {out}: per-channel{element} statistics of {counted(len(dataset), 'sample')} x "
            f"{counted(dataset.flips, 'flip')}, {counted(norms['channel'].mean.numel(), 'channel')} ({change} in "
            f"{SPACE_JSON}); train with --latent-norm channel{' or element' if element else ''}")
