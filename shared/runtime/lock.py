"""One writer per folder: an exclusive lock that the operating system drops when its process dies.

flock, not a PID file: a SIGKILL or power cut runs no cleanup, and the kernel releases a flock when its holder exits.
FOLDER/.lock records the holder (PID, host, command, start) for the refusal. Forked children close their copy of the
descriptor (os.register_at_fork; issue 21: a DataLoader worker kept the lock seconds after its trainer died). Where
the file system has no flock (ENOLCK, ENOSYS, EOPNOTSUPP) the lock is FOLDER/.lock.owner created exclusively; a launch
on the same host takes it over once its PID is gone.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from shared.runtime.errors import SettingError

LOCK_NAME = ".lock"
OWNER_NAME = ".lock.owner"  # the exclusive-create fallback where the file system has no flock
# errno values meaning "this file system cannot lock", as opposed to "someone else holds the lock"
NO_LOCKING = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

try:  # POSIX (Linux, macOS)
    import fcntl
except ImportError:  # Windows: no flock; msvcrt's byte lock has the same die-with-the-process rule
    fcntl = None
    import msvcrt


class FolderBusyError(SettingError):
    """Another live process holds the folder's lock."""


def _os_lock(fd: int) -> None:
    """The OS call: an exclusive, non-blocking lock on the open file (the seam tests simulate errors at)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


# Locks held by this process, closed in every forked child (see the module docstring).
_HELD: dict[int, "FolderLock"] = {}


def _forget_in_child() -> None:
    """In a freshly forked child: close the inherited lock descriptors (the parent still holds the locks)."""
    for lock in _HELD.values():
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_forget_in_child)


def _holder(path: Path) -> dict:
    """What the current holder wrote into the lock file (empty if unreadable or still being written)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _busy(folder: Path, setting: str, holder: dict, owner_file: Path | None = None) -> FolderBusyError:
    """The one-paragraph refusal naming the holder (and the file to delete for the no-flock fallback)."""
    pid = holder.get("pid", "unknown")
    where = f" on {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    command = holder.get("command", "")
    command = command if len(command) <= 120 else command[:117] + "..."
    what = f" ({command}, since {holder.get('since', '?')})" if command else ""
    return FolderBusyError(
        f"{{{setting}}} {folder} is in use by another process: PID {pid}{where}{what}. Two processes writing one "
        f"folder would overwrite each other's files. Wait for it to finish, stop it (kill {pid}), or pass a "
        + (f"different {{{setting}}}. The lock is released automatically when that process exits, even if it is "
           f"killed." if owner_file is None else
           f"different {{{setting}}}. This file system does not support flock, so the lock is the file {owner_file}: "
           f"if that process is no longer running (a kill leaves the file behind), delete the file and rerun."))


class FolderLock:
    """An exclusive lock on FOLDER/.lock (or FOLDER/.lock.owner without flock), held until release() or exit."""
    def __init__(self, folder: Path, setting: str):
        self.folder, self.path = Path(folder), Path(folder) / LOCK_NAME
        self.setting, self.owner_file = setting, None  # owner_file: set when the no-flock fallback is in use
        self.created = not self.folder.exists()  # a folder this lock made is removed again if left empty
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _os_lock(self._fd)
        except OSError as err:
            if err.errno in NO_LOCKING:
                self._take_owner_file()
            else:  # another process holds it
                os.close(self._fd)
                self._fd = None
                raise _busy(self.folder, setting, _holder(self.path)) from None
        else:
            _write_holder(self._fd)
        _HELD[id(self)] = self

    def _take_owner_file(self) -> None:
        """The no-flock fallback: create FOLDER/.lock.owner exclusively; take over one left by a dead local PID."""
        os.close(self._fd)  # the unlockable .lock is not used
        owner = self.folder / OWNER_NAME
        for _ in range(2):
            try:
                self._fd = os.open(owner, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _holder(owner)
                # stale: left by a process of this host that no longer runs (another host's cannot be checked)
                if not (holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
                        and not pid_alive(holder["pid"])):
                    self._fd = None
                    raise _busy(self.folder, self.setting, holder, owner_file=owner) from None
                owner.unlink(missing_ok=True)  # its process is gone (a kill): take the folder over
                continue
            self.owner_file = owner
            _write_holder(self._fd)
            print(f"note: the file system of {self.folder} does not support flock; the lock is the file {owner}, "
                  "which a killed run leaves behind (a later launch on this host removes it).", file=sys.stderr)
            return
        self._fd = None
        raise _busy(self.folder, self.setting, _holder(owner), owner_file=owner)

    def release(self) -> None:
        """Drop the lock (the file stays: an unlocked lock file means free)."""
        if self._fd is not None:
            _HELD.pop(id(self), None)
            if self.owner_file is not None:
                self.owner_file.unlink(missing_ok=True)  # the fallback's lock is the file's existence
            with contextlib.suppress(OSError):  # someone else is using the folder after all: leave it
                if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                    self.path.unlink()
                    self.folder.rmdir()
            os.close(self._fd)  # closing the last descriptor releases flock
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _write_holder(fd: int) -> None:
    """Record this process as the holder (in place: the lock belongs to this open file)."""
    command = " ".join(getattr(sys, "orig_argv", sys.argv))  # orig_argv (3.10+): as typed, with -m
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    data = (json.dumps(info) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0) if hasattr(os, "pwrite") else os.write(fd, data)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still exists (on this host; owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except OSError as err:  # any error but "no such process": it exists, owned by another user
        return not isinstance(err, ProcessLookupError)
    return True


def hold_lock(folder, setting: str) -> FolderLock:
    """Lock `folder` (created if missing) for this process, or raise FolderBusyError naming the holder."""
    return FolderLock(Path(folder), setting)
