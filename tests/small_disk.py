"""Test helper: run real commands with their output folder on a tiny tmpfs, to meet a real full disk (ENOSPC).

`unshare --user --map-root-user --mount` gives the commands a private mount namespace in which an
unprivileged user may mount a tmpfs of a chosen size; it disappears when the shell ends, so the helper
copies what the commands left on it to `snapshot` for the test to inspect. Between commands the tmpfs can be
remounted bigger (the "free some space and rerun" of the error message).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    """One command's exit status, output, and the paths on the tmpfs after it (relative, sorted)."""

    returncode: int
    stdout: str
    stderr: str
    files: list


def available() -> bool:
    """Whether this machine lets us mount a private tmpfs (unshare present and user namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    probe = "mkdir -p /tmp/.small-disk-probe && mount -t tmpfs -o size=64k tmpfs /tmp/.small-disk-probe"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", probe],
                          capture_output=True)
    return done.returncode == 0


def run(mount: Path, steps: list[tuple[int, list[str]]], logs: Path, snapshot: Path, env: dict,
        cwd: Path) -> list[Result]:
    """Run each (size_kib, argv) with `mount` a tmpfs of size_kib (grown in place between steps)."""
    mount, logs, snapshot = Path(mount), Path(logs), Path(snapshot)
    mount.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    lines = ["set -u"]
    for i, (size, argv) in enumerate(steps):
        verb = "mount -t tmpfs" if i == 0 else "mount -o remount"
        target = f"tmpfs {shlex.quote(str(mount))}" if i == 0 else shlex.quote(str(mount))
        lines.append(f"{verb} -o size={size}k {target} || exit 99")
        lines.append(f"{shlex.join(argv)} >{logs}/{i}.out 2>{logs}/{i}.err; echo $? >{logs}/{i}.rc")
        lines.append(f"find {shlex.quote(str(mount))} -mindepth 1 -printf '%P\\n' | sort >{logs}/{i}.files")
    lines.append(f"cp -a {shlex.quote(str(mount))}/. {shlex.quote(str(snapshot))}/")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "\n".join(lines)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return [Result(int((logs / f"{i}.rc").read_text()), (logs / f"{i}.out").read_text(),
                   (logs / f"{i}.err").read_text(), (logs / f"{i}.files").read_text().split("\n")[:-1])
            for i in range(len(steps))]
