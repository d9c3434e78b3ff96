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


class NoLockingError(OSError):
    """The folder's file system does not support flock."""


def _os_lock(fd: int) -> None:
    """The OS call: an exclusive, non-blocking lock on the open file (the seam tests simulate errors at)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock without waiting; False if another process holds it."""
    try:
        _os_lock(fd)
    except OSError as err:
        if err.errno in NO_LOCKING:
            raise NoLockingError(err.errno, os.strerror(err.errno)) from err
        return False
    return True


# Locks held by this process, closed in every forked child (see the module docstring).
_HELD: dict[int, "FolderLock"] = {}


def _forget_in_child() -> None:
    """In a freshly forked child: close the inherited lock descriptors; the child holds no lock."""
    for lock in list(_HELD.values()):
        lock._disown()
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
            locked = _try_lock(self._fd)
        except NoLockingError:
            self._take_owner_file()
        else:
            if not locked:
                os.close(self._fd)
                self._fd = None
                raise _busy(self.folder, setting, _holder(self.path))
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
                if not _stale(holder):
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

    def _disown(self) -> None:
        """Forget the lock without releasing it (a forked child's inherited copy; the parent still holds it)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Drop the lock (the file stays: an unlocked lock file means free)."""
        if self._fd is not None:
            _HELD.pop(id(self), None)
            if self.owner_file is not None:
                self.owner_file.unlink(missing_ok=True)  # the fallback's lock is the file's existence
            self._remove_if_untouched()
            os.close(self._fd)  # closing the last descriptor releases flock
            self._fd = None

    def _remove_if_untouched(self) -> None:
        """Delete the lock file and the folder when the lock made the folder and it holds nothing else."""
        with contextlib.suppress(OSError):  # someone else is using it after all: leave it
            if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                self.folder.rmdir()

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


def _stale(holder: dict) -> bool:
    """Whether a fallback owner file was left by a process of this host that no longer runs."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False  # another host's process cannot be checked from here; an unreadable file is not ours
    return not pid_alive(holder["pid"])


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still exists (on this host; owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by another user
        return True
    return True


def hold_lock(folder, setting: str) -> FolderLock:
    """Lock `folder` (created if missing) for this process, or raise FolderBusyError naming the holder."""
    return FolderLock(Path(folder), setting)
