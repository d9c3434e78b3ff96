"""A latent folder's files checked against the sha256 index.json records, remembered so a resume does not rehash.

extract checks its shards before it writes the index and on resume, `python -m extract --verify` rehashes them
all, and train checks a folder when it opens it (shared/datasets/shards.py `LatentDataset`).
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write_text, user_cache

# Files whose sha256 was checked, by name -> {"sha256", "stamp": [size, mtime_ns, inode]}. A file whose
# stamp is unchanged still holds the bytes that were hashed: writing changes mtime, and a copy (cp, rsync
# -t, a new disk) gets a new inode, so copied folders are hashed again where transfer damage happens.
VERIFIED_NAME = "verified-sha256.json"
_VERIFIED_VERSION = 1
_HASH_THREADS = 8  # sha256 runs outside the GIL: several files at once, until the disk is the limit
_FIX = ("rerun the same `python -m extract` command that wrote it (same --data-path and flags): it re-verifies "
        "every shard and redoes exactly the damaged ones")


def _stamp(path: Path) -> list[int]:
    """[size, mtime_ns, inode]: what must stay equal for an earlier hash of the file to still hold."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _user_cache(root: Path) -> Path:
    """Where a read-only latent folder's verification record goes instead (one file per folder path)."""
    key = hashlib.sha256(str(root.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return user_cache("verified") / f"{key}.json"


def _read_verified(root: Path) -> dict:
    """The verification record of a folder (its own file wins over the user cache); {} if none is readable."""
    merged = {}
    for path in (_user_cache(root), root / VERIFIED_NAME):
        try:
            data = json.loads(path.read_text())
            if data.get("version") == _VERIFIED_VERSION and isinstance(data.get("files"), dict):
                merged.update(data["files"])
        except (OSError, ValueError, AttributeError):
            continue
    return merged


def _remember(root: Path, good: dict, bad) -> None:
    """Record newly verified files and forget failed ones; silently skipped where nothing can be written."""
    # re-read: another process may have added entries meanwhile
    files = {name: v for name, v in {**_read_verified(root), **good}.items() if name not in bad}
    text = json.dumps({"version": _VERIFIED_VERSION, "files": files}, indent=0, sort_keys=True) + "\n"
    for path in (root / VERIFIED_NAME, _user_cache(root)):
        try:
            atomic_write_text(path, text)
            return
        except (OSError, UserError):  # read-only folder, full disk: the check itself was done, only not kept
            continue


def file_problem(root: Path, entry: dict) -> str | None:
    """What is wrong with a listed file without reading it (missing, wrong size), or None."""
    path = Path(root) / entry["name"]
    if not path.is_file():
        return "is missing"
    if (size := path.stat().st_size) != entry["size"]:
        return f"is {size} bytes, the index says {entry['size']} (truncated or overwritten)"
    return None


def _hash_files(root: Path, entries: list[dict], progress: bool) -> dict:
    """name -> (sha256 of the bytes on disk, stamp taken before reading); hard links are read once."""
    paths = {e["name"]: root / e["name"] for e in entries}
    stamps = {name: _stamp(path) for name, path in paths.items()}
    identity = {name: (paths[name].stat().st_dev, *stamps[name]) for name in paths}
    first = {}  # file identity -> first name holding it
    for name, key in identity.items():
        first.setdefault(key, name)
    total = sum(stamps[name][0] for name in first.values())
    threads = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(first)))
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify sha256",
              disable=not progress, dynamic_ncols=True) as bar, ThreadPoolExecutor(threads) as pool:
        digests = dict(zip(first, pool.map(lambda name: sha256_file(paths[name], bar.update), first.values())))
    return {name: (digests[identity[name]], stamps[name]) for name in paths}


def damaged_files(root, entries, verify: bool = True, rehash: bool = False, progress: bool = True) -> dict:
    """name -> what is wrong, for each listed file ({name, size, sha256}) that is missing, resized or changed.

    verify=False checks names and sizes only; else each file is hashed unless the folder's verification record
    vouches for it (same expected sha256 and stamp); rehash=True hashes all."""
    root = Path(root)
    problems = {e["name"]: p for e in entries if (p := file_problem(root, e))}
    if not verify:
        return problems
    known = {} if rehash else _read_verified(root)
    todo = [e for e in entries if e["name"] not in problems
            and known.get(e["name"]) != {"sha256": e["sha256"], "stamp": _stamp(root / e["name"])}]
    if not todo:
        return problems
    hashed = _hash_files(root, todo, progress)
    good = {}
    for e in todo:
        digest, stamp = hashed[e["name"]]
        if digest != e["sha256"]:
            problems[e["name"]] = "fails its sha256 check (corrupted: its bytes changed after extract wrote them)"
        elif _stamp(root / e["name"]) == stamp:  # unchanged while it was read: the hash holds for this stamp
            good[e["name"]] = {"sha256": digest, "stamp": stamp}
    _remember(root, good, [e["name"] for e in todo if e["name"] in problems])
    return problems


def damaged_error(root, problems: dict) -> UserError:
    """The refusal naming every damaged file (the first 5) and the fix."""
    items = sorted(problems.items())
    listed = "; ".join(f"{name} {problem}" for name, problem in items[:5])
    more = f"; and {len(items) - 5} more" if len(items) > 5 else ""
    return UserError(f"latent folder {root} is damaged: {listed}{more}. Do not train on it: {_FIX}. "
                     f"`python -m extract --verify --out {root}` checks the folder again without changing it.")


def sha256_file(path: Path, on_bytes=None, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks into one reused buffer; on_bytes(n) after each chunk."""
    digest, buf = hashlib.sha256(), bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])  # hashlib drops the GIL here, so threads hash files in parallel
            if on_bytes is not None:
                on_bytes(n)
    return digest.hexdigest()
