"""`python -m extract --verify --out DIR`: hash every shard of a finished latent folder against index.json."""
from __future__ import annotations

from pathlib import Path

from shared.runtime.cli import counted
from shared.datasets.integrity import damaged_error, damaged_files
from shared.datasets.shards import INDEX_NAME, load_index


def run_verify(out) -> str:
    """Rehash every shard (no earlier verification is trusted); the report line, or UserError naming the damage."""
    out = Path(out)
    index = load_index(out)
    # rehash all: this is the check a user runs after a copy, a disk error or a doubt; the reader's remembered
    # hashes (size, mtime, inode) are the cheap path for every training start, not for this
    damaged = damaged_files(out, index["shards"], rehash=True)
    if damaged:
        raise damaged_error(out, damaged)
    total = sum(entry["size"] for entry in index["shards"])
    many = len(index["shards"]) != 1
    return (f"verify: {out}: {'all ' if many else ''}{counted(len(index['shards']), 'shard')} ({total / 2**20:.1f} MiB, "
            f"{counted(index['num_samples'], 'sample')}) {'match' if many else 'matches'} the sha256 in {INDEX_NAME}")
