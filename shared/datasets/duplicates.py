"""One picture under several paths (a symlink, a hard link, identical bytes) and what `--duplicates` keeps of it.

One rule for extract's training set and evaluate's reference folders; found cheaply: os.stat for every file, bytes
read only where sizes collide (the first 8 KiB, then the whole file where those agree).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import defaultdict

from shared.datasets.imagefolder import ImageFolderScan, Skipped
from shared.datasets.integrity import sha256_file
from shared.runtime.cli import counted

# What each --duplicates choice keeps of a picture found under several paths (the default is the first).
DUPLICATE_POLICIES = {
    "first": "each picture once, under the label of its first path in sorted order",
    "all": "every copy, each under its own path's label (one picture may then train under two classes)",
    "none": "no copy of a picture whose paths disagree on the label; one copy of the others",
}
DEFAULT_DUPLICATES = "first"
HEAD_BYTES = 8192  # read from each file whose size collides with another's, before any full hash


def _digest(path, limit: int | None = None) -> str:
    """sha256 of the first `limit` bytes of a file (all of it when None)."""
    if limit is None:
        return sha256_file(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(limit)).hexdigest()


def _split_by(keys: list, digest) -> list[list]:
    """Groups of keys (two or more) whose digest agrees."""
    groups = defaultdict(list)
    for key in keys:
        try:
            groups[digest(key)].append(key)
        except OSError:
            continue
    return [g for g in groups.values() if len(g) > 1]


def find_duplicates(scan: ImageFolderScan) -> list[list[int]]:
    """Groups of positions (sorted, two or more) that are one picture: the same real file or identical bytes."""
    if getattr(scan, "digests", None):  # tar shards and parquet: hashed while listed (sources.py), no file to stat
        groups = defaultdict(list)
        for pos, sample_id in enumerate(scan.files):
            groups[scan.digests[sample_id]].append(pos)
        return sorted(group for group in groups.values() if len(group) > 1)
    positions, by_size = defaultdict(list), defaultdict(list)  # real file id -> positions; size -> real file ids
    for pos, rel in enumerate(scan.files):
        try:
            st = os.stat(scan.root / rel)  # follows symlinks: the real file's identity on this machine
        except OSError:  # left to the decoder to report
            continue
        key = (st.st_dev, st.st_ino)
        if key not in positions:
            by_size[st.st_size].append(key)
        positions[key].append(pos)
    merged = {key: list(found) for key, found in positions.items()}
    for keys in by_size.values():
        if len(keys) < 2:
            continue
        path = {key: scan.root / scan.files[positions[key][0]] for key in keys}
        for heads in _split_by(keys, lambda k: _digest(path[k], HEAD_BYTES)):
            for same in _split_by(heads, lambda k: _digest(path[k])):
                keep = same[0]
                for other in same[1:]:
                    merged[keep] += merged.pop(other)
    return sorted(sorted(group) for group in merged.values() if len(group) > 1)


def _dropped(scan: ImageFolderScan, group: list[int], policy: str) -> list[int]:
    """The positions of one group that `policy` leaves out."""
    if policy == "all":
        return []
    if policy == "none" and len({scan.labels[p] for p in group}) > 1:
        return list(group)
    return list(group[1:])


def describe_duplicates(scan: ImageFolderScan, groups: list[list[int]], policy: str) -> str:
    """One paragraph: how many pictures have several paths, how many across labels, and what was kept."""
    if not groups:
        return "duplicates: none (no two files are the same real file or hold identical bytes)"
    across = [g for g in groups if len({scan.labels[p] for p in g}) > 1]
    example = across[0] if across else groups[0]
    others = ", ".join(f"{choice} keeps {text}" for choice, text in DUPLICATE_POLICIES.items() if choice != policy)
    return (f"duplicates: {counted(len(groups), 'picture')} found under {sum(map(len, groups))} paths (symlinks, hard links "
            f"or identical bytes), {len(across)} of them under different labels (e.g. "
            f"{' = '.join(scan.files[p] for p in example[:3])}); --duplicates {policy} keeps "
            f"{DUPLICATE_POLICIES[policy]} (--duplicates {others})")


def apply_duplicates(scan: ImageFolderScan, policy: str) -> ImageFolderScan:
    """The scan without the copies `policy` leaves out (counted in skipped), its duplicates note attached."""
    groups = find_duplicates(scan)
    skipped = Skipped(dict(scan.skipped.counts), dict(scan.skipped.first))
    drop = {pos: group[0] if pos != group[0] else group[1]  # each dropped copy -> a twin of it
            for group in groups for pos in _dropped(scan, group, policy)}
    for pos, twin in sorted(drop.items()):
        skipped.add("duplicate", f"{scan.files[pos]} = {scan.files[twin]}")
    keep = [p for p in range(len(scan)) if p not in drop]
    return dataclasses.replace(scan, files=[scan.files[p] for p in keep], labels=[scan.labels[p] for p in keep],
                               skipped=skipped, notes=(*scan.notes, describe_duplicates(scan, groups, policy)))
