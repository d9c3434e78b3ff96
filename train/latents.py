"""Where training's latents come from: a local folder, or a URL copied once to local disk; opened once per node.

URLs (`s3://`, `gs://`, `hf://`, `memory://`, ... anything fsspec knows, given its package) are copied
into the local cache and then read exactly as a local folder is: the memory-mapped reader, its sha256
verification and the stream position all stay the same, so training from a URL equals training from the
folder bit for bit, and resume stays exact. The cache folder is named after the sha256 of the remote
index.json, so re-extracted latents never mix with an older copy; files already there at their listed
size are not fetched again (an interrupted copy resumes), and index.json is written last, as extract
writes it.

    ~/.cache/dit-latent-pipeline/latents/<sha256 of index.json, 16 hex>/   (or $DIT_LATENT_CACHE/<...>)

Several processes on one machine: the node's local main process fetches and verifies first (the
sha256 check of every shard, remembered in verified-sha256.json); the others wait, then open the folder
and find it verified, so each node hashes its shards once instead of once per rank.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write_bytes
from shared.datasets.shards import INDEX_NAME, LatentDataset

CACHE_ENV = "DIT_LATENT_CACHE"  # overrides the cache root (a fast local disk, per node)
_CHUNK = 16 << 20


def is_url(source: str) -> bool:
    """Whether --latents names a remote location (protocol://...) rather than a local folder."""
    return "://" in str(source) and not str(source).startswith("file://")


def cache_root() -> Path:
    """Where copies of remote latent folders are kept on this machine."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dit-latent-pipeline" / "latents"


def _filesystem(url: str):
    """(fsspec filesystem, path inside it) for a URL; UserError naming the package a protocol needs."""
    try:
        import fsspec
    except ImportError:
        raise UserError(f"--latents {url} is a URL; reading it needs fsspec (pip install fsspec).") from None
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise UserError(f"--latents {url}: {str(err).splitlines()[0]} (fsspec needs a package per protocol: "
                        "s3fs for s3://, gcsfs for gs://, huggingface_hub for hf://). Install it, or copy the "
                        "folder to a local disk and pass its path.") from None


def _read_remote(fs, path: str, url: str) -> bytes:
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise UserError(f"--latents {url} has no {path.rsplit('/', 1)[-1]}: pass the URL of a finished latent "
                        "folder (the one `python -m extract --out` wrote, copied whole).") from None
    except OSError as err:
        raise UserError(f"--latents {url}: cannot read {path} ({err}).") from None


def _copy_file(fs, remote: str, local: Path) -> None:
    """Stream one remote file to local (temp name, then rename: a kill never leaves a short file in place)."""
    tmp = local.with_name(f".tmp-{local.name}")
    with fs.open(remote, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
    os.replace(tmp, local)


def fetch_latents(url: str) -> Path:
    """Copy a remote latent folder into the local cache (only what is missing); returns the local folder."""
    fs, root = _filesystem(url)
    root = root.rstrip("/")
    index_bytes = _read_remote(fs, f"{root}/{INDEX_NAME}", url)
    try:
        index = json.loads(index_bytes)
        entries = [*index["shards"], index["arrays"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--latents {url}: its {INDEX_NAME} is not a latent index; pass a folder extract "
                        "wrote.") from None
    local = cache_root() / hashlib.sha256(index_bytes).hexdigest()[:16]
    local.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        target = local / entry["name"]
        if not (target.is_file() and target.stat().st_size == entry["size"]):
            _copy_file(fs, f"{root}/{entry['name']}", target)
    if not (local / INDEX_NAME).is_file():
        atomic_write_bytes(local / INDEX_NAME, index_bytes)  # last: a complete copy
    return local


def local_latents(source: str) -> Path:
    """The local folder to read: the path itself, or the cached copy of a URL."""
    if is_url(source):
        return fetch_latents(source)
    return Path(str(source).removeprefix("file://"))


def open_latents(source: str, accelerator=None) -> LatentDataset:
    """Open --latents (fetched first when a URL); one process per machine fetches and verifies first."""
    if accelerator is None or accelerator.num_processes == 1:
        return LatentDataset(local_latents(source))
    first = accelerator.is_local_main_process
    if not first:
        accelerator.wait_for_everyone()  # the node's first process is fetching and hashing
    try:
        return LatentDataset(local_latents(source))  # the others find every shard in verified-sha256.json
    finally:
        if first:
            accelerator.wait_for_everyone()  # even when it failed: the others then report it themselves
