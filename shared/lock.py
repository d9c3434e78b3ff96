"""One writer per folder: an exclusive lock that the operating system drops when its process dies.

Why flock and not a PID file: a SIGKILL, an OOM kill or a power cut never runs cleanup code, so a PID file
would be left behind and block (or worse, be "taken over" by) the next launch. `fcntl.flock` belongs to the
open file; the kernel releases it when the holder exits in any way, so a lock file that exists but is not
locked simply means "free". The file also records who holds it (PID, host, command, start time), read by a
second launch to name the holder. flock works on local disks and on NFSv4 (Linux maps it to a byte-range
lock there).

    FOLDER/.lock    {"pid": 1234, "host": "...", "command": "python -m train ...", "since": "..."}
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from shared.errors import SettingError

LOCK_NAME = ".lock"

try:  # POSIX (Linux, macOS)
    import fcntl
except ImportError:  # Windows: no flock; msvcrt's byte lock has the same die-with-the-process rule
    fcntl = None
    import msvcrt


class FolderBusyError(SettingError):
    """Another live process holds the folder's lock."""


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock without waiting; False if another process holds it."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


def _holder(path: Path) -> dict:
    """What the current holder wrote into the lock file (empty if unreadable or still being written)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _busy(folder: Path, kind: str, holder: dict) -> FolderBusyError:
    """The one-paragraph refusal naming the holder."""
    pid = holder.get("pid", "unknown")
    where = f" on {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    command = holder.get("command", "")
    command = command if len(command) <= 120 else command[:117] + "..."
    what = f" ({command}, since {holder.get('since', '?')})" if command else ""
    return FolderBusyError(
        f"{{{kind}}} {folder} is in use by another process: PID {pid}{where}{what}. Two processes writing one "
        f"folder would overwrite each other's files. Wait for it to finish, stop it (kill {pid}), or pass a "
        f"different {{{kind}}}. The lock is released automatically when that process exits, even if it is "
        f"killed."
    )


class FolderLock:
    """An exclusive lock on FOLDER/.lock, held until release() or the end of the process."""

    def __init__(self, folder: Path, kind: str):
        self.folder, self.path = Path(folder), Path(folder) / LOCK_NAME
        self.created = not self.folder.exists()  # a folder this lock made is removed again if left empty
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(self._fd):
            os.close(self._fd)
            self._fd = None
            raise _busy(self.folder, kind, _holder(self.path))
        self._write_holder()

    def _write_holder(self) -> None:
        """Record this process as the holder (in place: the lock belongs to this open file)."""
        command = " ".join(getattr(sys, "orig_argv", sys.argv))  # orig_argv (3.10+): as typed, with -m
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        data = (json.dumps(info) + "\n").encode("utf-8")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0) if hasattr(os, "pwrite") else os.write(self._fd, data)

    @property
    def held(self) -> bool:
        """True until release()."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (the file stays: an unlocked lock file means free).

        A folder the lock itself created and nothing else wrote into is removed, so a launch refused
        for a bad flag leaves no trace of itself.
        """
        if self._fd is not None:
            self._remove_if_untouched()
            os.close(self._fd)  # closing the last descriptor releases flock
            self._fd = None

    def _remove_if_untouched(self) -> None:
        """Delete the lock file and the folder when the lock made the folder and it holds nothing else."""
        try:
            if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                self.folder.rmdir()
        except OSError:
            pass  # someone else is using it after all: leave it

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def hold_lock(folder, kind: str) -> FolderLock:
    """Lock `folder` (created if missing) for this process, or raise FolderBusyError naming the holder.

    `kind` names the folder in the error as a SettingError field ("run folder", "latent folder", ...), so
    each stage's FLAGS map turns it into its flag (--results-dir, --out).
    """
    return FolderLock(Path(folder), kind)
