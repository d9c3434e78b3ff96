"""The one atomic write of the project: temp name in the same folder, fsync, rename, fsync the folder.

A reader (or a rerun after a kill or power cut) sees the old file or the whole new one. Temp names start with
TMP_PREFIX so a rerun can remove leftovers; published files get open()'s mode (safetensors writes 0600).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator

from shared.runtime.errors import DiskFullError, disk_full

TMP_PREFIX = ".tmp-"


def user_cache(name: str) -> Path:
    """$XDG_CACHE_HOME (else ~/.cache)/dit-latent-pipeline/<name>: the project's one user cache folder."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dit-latent-pipeline" / name


def tmp_name(path: Path) -> Path:
    """The temp sibling of `path` used while it is written (unique per process)."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc), else set and restored at once."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:  # os.umask can only be read by setting it: no other writer here sees the 0 in between
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a written file the mode open() would have: read-write for all, less the umask (0644 under 022)."""
    os.chmod(path, 0o666 & ~current_umask())


def fsync_dir(folder: Path) -> None:
    """fsync a folder's entry list, so a rename inside it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def stale_tmps(path: Path) -> list[Path]:
    """Temp siblings of `path` that writers (of any process, any version) left behind when killed mid-write."""
    path = Path(path)
    return sorted(path.parent.glob(f"{TMP_PREFIX}{path.name}*"))


def publish_file(tmp: Path, path: Path) -> Path:
    """Make a fully written (and closed) temp file visible as `path`: fsync it, rename, fsync the folder."""
    tmp, path = Path(tmp), Path(path)
    follow_umask(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def link_file(source: Path, path: Path) -> bool:
    """Make `path` a hard link to `source` atomically; False where the filesystem cannot link (write a copy then)."""
    # One file under two names (a checkpoint's EMA and its export: 2.7 GB each at XL/2); writers replace files by
    # rename, never in place, so the two names never come to differ.
    source, path = Path(source), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        os.link(source, tmp)
    except OSError:
        return False
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def atomic_write(path, write: Callable[[Path], object], durable: bool = True) -> Path:
    """Call write(tmp) to produce the file at a temp name, then fsync and rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with space_guard(path, tmp):
            write(tmp)
            if durable:
                publish_file(tmp, path)
            else:
                follow_umask(tmp)
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def space_guard(path, partial=None) -> Iterator[None]:
    """Re-raise a write error inside as DiskFullError (naming `path`) when a full disk caused it."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised as is unless the disk is full
        written = partial.stat().st_size if partial is not None and Path(partial).exists() else None
        if disk_full(err, Path(path).parent, written) is None:
            raise
        raise DiskFullError(path, written) from None


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write bytes to `path` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path, text: str) -> Path:
    """Write text (UTF-8) to `path` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def json_text(data, indent: int | None = 1) -> str:
    """The one JSON layout of the files we write: sorted keys, fixed separators, a trailing newline."""
    separators = (",", ": ") if indent is not None else (",", ":")
    return json.dumps(data, indent=indent, sort_keys=True, separators=separators) + "\n"


def atomic_write_json(path, data, indent: int | None = 1) -> Path:
    """Write `data` as JSON (json_text's layout) to `path` atomically."""
    return atomic_write_text(path, json_text(data, indent))


def publish_dir(staging: Path, final: Path) -> Path:
    """Make a fully written folder visible under its final name: fsync its files, rename, fsync the parent."""
    staging, final = Path(staging), Path(final)
    for entry in staging.iterdir():
        if entry.is_file():
            follow_umask(entry)  # files written straight into the folder (e.g. a checkpoint's safetensors)
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(staging)
    if final.exists():  # the same name published again (e.g. a rerun of a finished step): replace it
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(final.parent)
    return final


def remove_tree(path: Path) -> None:
    """Delete a folder by renaming it to a temp name first, so a kill mid-delete never leaves it half-gone."""
    path = Path(path)
    doomed = path.with_name(f"{TMP_PREFIX}del-{path.name}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
