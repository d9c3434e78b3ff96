"""Released files by name, downloaded once into one cache (the DiTs' checkpoints, RAE's tokenizer files).

The cache is $DIT_CHECKPOINT_DIR, else torch's hub checkpoints folder; $DIT_DOWNLOAD_URL replaces every URL by
BASE/NAME. A download streams into a temp name, renamed once whole (every byte, an intact zip directory); one
process downloads a file at a time.
"""
from __future__ import annotations

import contextlib
import http.client
import os
import socket
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from shared.runtime.errors import UserError, disk_full
from shared.runtime.fsio import publish_file, stale_tmps, tmp_name

try:  # POSIX: a waiting lock, released by the OS when its holder dies
    import fcntl
except ImportError:  # Windows: no lock; two simultaneous downloads still never publish a partial file
    fcntl = None

URL_ENV = "DIT_DOWNLOAD_URL"
CACHE_ENV = "DIT_CHECKPOINT_DIR"
CHUNK_BYTES = 1 << 20
TIMEOUT_S = 30  # per socket operation: a stalled server ends the download instead of hanging it


def cache_dir() -> Path:
    """Where downloaded checkpoints live: $DIT_CHECKPOINT_DIR, else torch's hub checkpoints folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    import torch
    return Path(torch.hub.get_dir()) / "checkpoints"


def zip_problem(path: Path) -> str | None:
    """Why a torch zip file is cut short or damaged (its central directory is at the end); None if whole."""
    with open(path, "rb") as f:
        if f.read(2) != b"PK":  # not torch's zip format (a legacy pickle): torch.load judges it
            return None
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        return f"{err}; {path.stat().st_size:,} bytes"
    return None


@contextlib.contextmanager
def _one_downloader(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock for `dest` (waiting for another process that downloads it)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(dest.with_name(f".{dest.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"waiting for another process that is downloading {dest.name} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def release_url(name: str, url: str) -> str:
    """The URL a release file downloads from: its own, or $DIT_DOWNLOAD_URL/NAME when that is set."""
    if os.environ.get(URL_ENV):
        return os.environ[URL_ENV].rstrip("/") + "/" + name
    return url


def fetch(name: str, url: str, instead: str) -> tuple[Path, list[str]]:
    """(path, notes) of the release file `name` in the cache, downloaded from `url` into it when absent or cut short."""
    dest = cache_dir() / name
    notes = []
    with _one_downloader(dest):
        if dest.is_file():
            if (problem := zip_problem(dest)) is None:
                return dest, [f"{name} read from the checkpoint cache {dest.parent}"]
            note = (f"the cached {dest} is not a whole checkpoint ({problem}): an earlier copy or download was cut "
                    f"short; it was deleted and is downloaded again")
            print(f"note: {note}")
            notes.append(note)
            dest.unlink()
        download(url, dest, cached_copy_removed=bool(notes), instead=instead)
    return dest, notes + [f"{name} downloaded from {url} into {dest.parent}"]


def download(url: str, dest: Path, cached_copy_removed: bool = False,
             instead: str = "or pass its path as --ckpt") -> Path:
    """Stream `url` into a temp file beside `dest`, check it is whole, then rename; UserError on any failure."""
    for stale in stale_tmps(dest):  # leftovers of killed downloads (we hold the lock: nobody else writes)
        stale.unlink(missing_ok=True)
    tmp = tmp_name(dest)
    written, total = 0, None
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out, \
                tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"downloading {dest.name}") as bar:
            total = int(response.headers.get("Content-Length") or 0) or None
            bar.total = total
            while chunk := response.read(CHUNK_BYTES):
                out.write(chunk)
                written += len(chunk)
                bar.update(len(chunk))
        if total is not None and written != total:
            raise UserError(_interrupted(url, dest, written, total, "the server closed the connection", instead))
        if problem := zip_problem(tmp):
            raise UserError(_interrupted(url, dest, written, total, f"the file is not whole: {problem}", instead))
        return publish_file(tmp, dest)
    except (urllib.error.URLError, http.client.HTTPException, socket.timeout, OSError) as err:
        if (full := disk_full(err, dest.parent, written)) is not None:
            raise full from None
        if written:
            raise UserError(_interrupted(url, dest, written, total, _reason(err), instead)) from None
        gone = " The damaged cached copy was deleted." if cached_copy_removed else ""
        raise UserError(f"{dest.name} is not on this machine and could not be downloaded from {url} ({_reason(err)})."
                        f"{gone} {_where_to_put(url, dest, instead)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _reason(err: BaseException) -> str:
    """A short cause: the HTTP status, the network error, or the exception's first line."""
    if isinstance(err, urllib.error.HTTPError):
        return f"the server answered {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return f"{err.reason}"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:200] if text else type(err).__name__


def _where_to_put(url: str, dest: Path, instead: str) -> str:
    """How to get the file there by hand."""
    return (f"Download it where the network allows (e.g. `wget {url}`) and put it at {dest} (the checkpoint cache; "
            f"set {CACHE_ENV} to use another folder) {instead}.")


def _interrupted(url: str, dest: Path, written: int, total: int | None, reason: str, instead: str) -> str:
    """The paragraph for a download that stopped part way."""
    of = f" of {total:,}" if total else ""
    return (f"the download of {dest.name} from {url} stopped after {written:,}{of} bytes ({reason}). The partial "
            f"file was deleted; nothing was saved as {dest}. Rerun the same command to download it again. "
            f"{_where_to_put(url, dest, instead)}")
