"""The run lock (shared/runtime/lock.py) with real processes: a SIGKILL with DataLoader workers on, file systems without flock.

Issue 21: a trainer killed with `kill -9` while its default 4 DataLoader workers were alive left the lock
held by those workers for seconds, so rerunning the same command at once was refused. And where the file
system answers ENOLCK/ENOSYS to flock, every launch read as "in use by PID unknown".
"""
import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.runtime import lock
from shared.runtime.distributed import default_workers
from tests.helpers import LAUNCHER, checkpoints, cli, finish, train_args, wait_for
from train.loop import WORKER_CAP


def _default_workers(args: list[str]) -> list[str]:
    """train_args without its --num-workers 0: the default workers apply, as for a new user."""
    i = args.index("--num-workers")
    return args[:i] + args[i + 2:]


def _children(pid: int) -> list[int]:
    """PIDs of the direct children of `pid` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads DataLoader worker PIDs from Linux /proc")
def test_sigkill_with_workers_then_immediate_rerun_resumes(latents, tmp_path):
    run, pauses = tmp_path / "run", tmp_path / "pause"
    args = _default_workers(train_args(latents, run, "--max-steps", "4", "--ckpt-every", "2"))
    victim = cli(LAUNCHER + args, {"TRACE_DIR": str(pauses), "PAUSE_AT": "checkpoint:2"})
    wait_for(pauses / "paused", victim)
    workers = _children(victim.pid)
    expected = default_workers(WORKER_CAP)  # the default --num-workers on this machine (1 on 2 cores)
    assert expected >= 1, "this machine has too few cores for a default DataLoader worker"
    assert len(workers) == expected, workers  # the loader's workers are alive
    victim.kill()
    victim.wait(timeout=60)  # not communicate(): the orphaned workers still hold its pipes
    # At once, while the orphaned workers live on (they poll for a dead parent every 5 s), the lock is free.
    lingering = [pid for pid in workers if _alive(pid)]
    lock.hold_lock(run, "run folder").release()
    assert lingering, "the workers had exited already: this run did not exercise inherited descriptors"
    out = finish(cli(args))  # the same command, immediately
    victim.communicate(timeout=60)
    assert victim.returncode == -9
    assert f"resumed from {run / 'checkpoints' / 'step-0000002'} at step 2" in (run / "log.txt").read_text(), out
    assert checkpoints(run)[-1] == "step-0000004"


def test_forked_child_does_not_hold_the_lock(tmp_path):
    held = lock.hold_lock(tmp_path / "f", "run folder")
    pid = os.fork()
    if pid == 0:  # the child sleeps holding nothing; os._exit so pytest's own teardown never runs here
        time.sleep(5)
        os._exit(0)
    try:
        held.release()
        lock.hold_lock(tmp_path / "f", "run folder").release()  # free although the forked child lives on
        assert _alive(pid)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


# ---------------------------------------------------------------------------------------------------------
# File systems without flock: the owner-file fallback
# ---------------------------------------------------------------------------------------------------------

def _no_flock(monkeypatch, code=errno.ENOLCK):
    def refuse(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(lock, "_os_lock", refuse)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_without_flock_an_owner_file_locks_the_folder(tmp_path, monkeypatch, capsys, code):
    _no_flock(monkeypatch, code)
    folder = tmp_path / "run"
    first = lock.hold_lock(folder, "run folder")
    assert "does not support flock" in capsys.readouterr().err
    assert json.loads((folder / lock.OWNER_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(lock.FolderBusyError) as refused:
        lock.hold_lock(folder, "run folder")  # the same live PID: not stale
    message = " ".join(str(refused.value).split())
    assert f"PID {os.getpid()}" in message and f"the lock is the file {folder / lock.OWNER_NAME}" in message
    first.release()
    assert not (folder / lock.OWNER_NAME).exists()
    lock.hold_lock(folder, "run folder").release()


def test_without_flock_a_dead_local_owner_is_taken_over(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "run"
    folder.mkdir()
    owner = {"pid": int(dead.stdout), "host": socket.gethostname(), "command": "python -m train", "since": "x"}
    (folder / lock.OWNER_NAME).write_text(json.dumps(owner))  # what a SIGKILLed holder leaves
    held = lock.hold_lock(folder, "run folder")
    assert json.loads((folder / lock.OWNER_NAME).read_text())["pid"] == os.getpid()
    held.release()


def test_other_errors_still_mean_busy(tmp_path, monkeypatch):
    _no_flock(monkeypatch, errno.EWOULDBLOCK)
    with pytest.raises(lock.FolderBusyError):
        lock.hold_lock(tmp_path / "run", "run folder")


# The real command, with flock answering ENOLCK (as on a Lustre mount without -o flock).
NO_FLOCK_TRAIN = ("import errno, os, sys; import shared.runtime.lock as lock\n"
                  "def refuse(fd): raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))\n"
                  "lock._os_lock = refuse\n"
                  "from train.__main__ import main; sys.exit(main())")


@pytest.mark.slow
def test_train_without_flock_refuses_another_hosts_owner_then_runs(latents, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    other = {"pid": 4242, "host": "node-7", "command": "python -m train --results-dir run", "since": "yesterday"}
    (run / lock.OWNER_NAME).write_text(json.dumps(other))
    args = train_args(latents, run, "--max-steps", "2", "--ckpt-every", "2")
    refused = cli([sys.executable, "-c", NO_FLOCK_TRAIN, *args])
    _, err = refused.communicate(timeout=300)
    err = " ".join(err.split())
    assert refused.returncode == 2 and "Traceback" not in err, err
    assert f"--results-dir {run} is in use by another process: PID 4242 on node-7" in err
    assert f"the lock is the file {run / lock.OWNER_NAME}: if that process is no longer running" in err
    assert not (run / "checkpoints").exists()  # nothing written

    (run / lock.OWNER_NAME).unlink()  # following the advice
    finish(cli([sys.executable, "-c", NO_FLOCK_TRAIN, *args]))
    assert checkpoints(run) == ["step-0000002"] and not (run / lock.OWNER_NAME).exists()
