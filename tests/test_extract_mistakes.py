"""Everyday mistakes around extraction end in the right result or one paragraph naming the fix (issue 11).

Real folders on disk, the real `python -m extract` entry point (in-process `main` or a subprocess where a
second process, a lock or a full disk is the point).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extract.__main__ import main as extract_main
from shared.datasets.imagefolder import scan_image_folder
from extract.config import SETTINGS_NAME
from extract.run import sidecar_path
from shared.datasets.shards import INDEX_NAME, LatentDataset, shard_name
from tests import small_disk
from tests.conftest import ROOT, make_image_folder, make_tiny_vae

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _argv(data, out, vae, *extra) -> list:
    """Flags of a small extraction: 16 px images, shards of 4, no worker processes."""
    return ["--data-path", str(data), "--out", str(out), "--vae", str(vae), "--image-size", "16",
            "--shard-size", "4", "--batch-size", "4", "--num-workers", "0", *map(str, extra)]


def _run(argv, capsys) -> tuple[int, str, str]:
    """Run `python -m extract` in this process: (exit status, stdout, stderr as one line)."""
    try:
        rc = extract_main(argv)
    except SystemExit as stop:
        rc = stop.code
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())


# ----------------------------------------------------------------------------------------------------------
# Messy folders: hidden entries and symlink loops
# ----------------------------------------------------------------------------------------------------------

def _messy(root: Path) -> Path:
    """cat/dog folder with Jupyter and macOS leftovers that must not be data."""
    make_image_folder(root, classes=("cat", "dog"), per_class=2)
    make_image_folder(root / ".ipynb_checkpoints", classes=("x",), per_class=1)  # sorts first: would be class 0
    (root / "cat" / "._000.png").write_bytes(b"\0\5\26\7 AppleDouble resource fork")  # macOS metadata
    (root / "cat" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


def test_hidden_entries_are_not_data_and_are_counted(tmp_path, tiny_vae_dir, capsys):
    root = _messy(tmp_path / "data")
    scan = scan_image_folder(root)
    assert scan.classes == ["cat", "dog"] and scan.labels == [0, 0, 1, 1]  # labels as without the leftovers
    assert scan.skipped.counts == {"hidden": 3, "non-image": 1}
    rc, out, _ = _run(["--data-path", str(root), "--check", "--num-workers", "0"], capsys)
    assert rc == 0 and "4 images; skipped: 3 hidden entries (first: .ipynb_checkpoints/)" in out
    assert "1 non-image file (first: dog/notes.txt)" in out
    rc, out, err = _run(_argv(root, tmp_path / "lat", tiny_vae_dir), capsys)
    assert rc == 0, err
    assert "while scanning skipped: 3 hidden entries" in out and "0 bad files" in out
    assert len(LatentDataset(tmp_path / "lat")) == 4


def test_linked_datasets_are_followed_and_each_folder_walked_once(tmp_path):
    elsewhere = make_image_folder(tmp_path / "elsewhere", classes=("bird",), per_class=2)
    root = make_image_folder(tmp_path / "data", classes=("a",), per_class=2)
    (root / "b").symlink_to(elsewhere / "bird")        # a class linked in from elsewhere: followed
    (root / "a" / "birds").symlink_to("../b")          # another class's images nested here: not label a
    scan = scan_image_folder(root)
    assert scan.classes == ["a", "b"]
    assert scan.files == ["a/000.png", "a/001.png", "b/000.png", "b/001.png"] and scan.labels == [0, 0, 1, 1]
    assert scan.skipped.counts == {"linked folder": 1}
    assert "1 folder reached again via a symlink (first: a/birds -> ../b)" in scan.skipped.describe()


# ----------------------------------------------------------------------------------------------------------
# A corrupted shard: --verify names it, the rerun redoes exactly it
# ----------------------------------------------------------------------------------------------------------

def test_damaged_shard_is_named_by_verify_and_redone_by_the_rerun(tmp_path, tiny_vae_dir, capsys):
    data, out = make_image_folder(tmp_path / "data", per_class=4), tmp_path / "lat"  # 12 images, 3 shards
    assert _run(_argv(data, out, tiny_vae_dir), capsys)[0] == 0
    rc, text, _ = _run(["--verify", "--out", str(out)], capsys)
    assert rc == 0 and "all 3 shards" in text
    good = (out / shard_name(1)).read_bytes()
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x01  # one flipped bit inside a payload
    (out / shard_name(1)).write_bytes(bytes(damaged))
    untouched = {j: (out / shard_name(j)).stat().st_mtime_ns for j in (0, 2)}

    rc, _, err = _run(["--verify", "--out", str(out)], capsys)
    assert rc == 2 and "Traceback" not in err
    assert f"latent folder {out} is damaged: {shard_name(1)}" in err and "rerun the same `python -m extract`" in err
    with pytest.raises(Exception, match="is damaged"):
        LatentDataset(out)  # training refuses it too (the reader verifies by default)

    rc, text, err = _run(_argv(data, out, tiny_vae_dir), capsys)
    assert rc == 0, err
    assert "this run encoded 4 images" in text and "1 of them damaged" in text
    assert (out / shard_name(1)).read_bytes() == good  # the same bytes as before the damage
    assert {j: (out / shard_name(j)).stat().st_mtime_ns for j in (0, 2)} == untouched  # others kept
    index = json.loads((out / INDEX_NAME).read_text())
    assert _run(["--verify", "--out", str(out)], capsys)[0] == 0 and index["num_samples"] == 12


def test_verify_needs_a_finished_folder(tmp_path, capsys):
    rc, _, err = _run(["--verify"], capsys)
    assert rc == 2 and "--verify needs --out" in err
    rc, _, err = _run(["--verify", "--out", str(tmp_path)], capsys)
    assert rc == 2 and f"has no {INDEX_NAME}" in err


# ----------------------------------------------------------------------------------------------------------
# A failed VAE load does not tie --out to that VAE
# ----------------------------------------------------------------------------------------------------------

def test_settings_of_a_run_that_wrote_no_shard_are_replaced(tmp_path, capsys):
    data, out = make_image_folder(tmp_path / "data"), tmp_path / "lat"
    broken = make_tiny_vae(tmp_path / "broken")
    (broken / "diffusion_pytorch_model.safetensors").write_bytes(b"truncated")  # config fine, weights not
    rc, _, err = _run(_argv(data, out, broken), capsys)
    assert rc == 2 and "Traceback" not in err
    assert not any(out.glob("shard-*"))
    other = make_tiny_vae(tmp_path / "other", seed=1)  # a different VAE: different config hash
    rc, text, err = _run(_argv(data, out, other), capsys)
    assert rc == 0, err
    assert "held the settings of an earlier run that wrote no shard" in err
    assert json.loads((out / SETTINGS_NAME).read_text())["vae"]["source"].endswith("other")
    # Once shards exist, the settings are fixed: the first VAE is refused again.
    rc, _, err = _run(_argv(data, out, make_tiny_vae(tmp_path / "third", seed=2, latent_channels=8)), capsys)
    assert rc == 2 and "holds shards of a different extraction" in err


# ----------------------------------------------------------------------------------------------------------
# A second launch; a full disk
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_second_launch_on_the_same_out_exits_naming_the_pid(tmp_path, tiny_vae_dir):
    data, out = make_image_folder(tmp_path / "data", per_class=4), tmp_path / "lat"
    blocker = data / "dog" / "002.png"  # a FIFO: the first run blocks on it, holding the lock, mid-extraction
    blocker.unlink()
    os.mkfifo(blocker)
    first = subprocess.Popen([sys.executable, "-m", "extract", *_argv(data, out, tiny_vae_dir)], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not sidecar_path(out, 0).exists():  # shard 0 done: the first run is inside its locked section
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-m", "extract", *_argv(data, out, tiny_vae_dir)], cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=120)
        assert first.poll() is None
        err = " ".join(second.stderr.split())
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"--out {out} is in use by another process: PID {first.pid}" in err
    finally:
        first.kill()
        first.communicate()
    blocker.unlink()
    make_image_folder(tmp_path / "data", per_class=4)  # the same images again, the FIFO replaced
    done = subprocess.run([sys.executable, "-m", "extract", *_argv(data, out, tiny_vae_dir)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # the killed holder's lock died with it
    assert "this run encoded 8 images" in done.stdout


def test_a_second_run_is_refused_by_the_lock_before_any_scan(tmp_path, tiny_vae_dir, capsys, monkeypatch):
    """Issue 38.5: the lock on --out comes first; the folder is never scanned or hashed for a refused run."""
    import extract.config
    from shared.datasets.shards import FOLDER_KIND
    from shared.runtime.lock import hold_lock

    data, out = make_image_folder(tmp_path / "data"), tmp_path / "lat"
    scans = []
    monkeypatch.setattr(extract.config, "open_source", lambda *a, **k: scans.append(a) or pytest.fail("scanned"))
    with hold_lock(out, FOLDER_KIND):  # another run holding --out (flock: a second open file conflicts)
        start = time.monotonic()
        rc, _, err = _run(_argv(data, out, tiny_vae_dir), capsys)
        elapsed = time.monotonic() - start
    assert rc == 2 and "Traceback" not in err and err.count("error:") == 1
    assert f"--out {out} is in use by another process: PID {os.getpid()}" in err
    assert scans == [] and elapsed < 30  # refused before the scan (the bound only guards against a hang)


@pytest.mark.slow
@pytest.mark.skipif(not small_disk.available(), reason="needs unshare + an unprivileged tmpfs mount (Linux)")
def test_full_disk_is_one_paragraph_and_the_rerun_finishes(tmp_path, tiny_vae_dir):
    data = make_image_folder(tmp_path / "data", per_class=8, size=(40, 40))  # 24 images, 6 shards
    mount = tmp_path / "mnt"
    argv = [sys.executable, "-m", "extract", *_argv(data, mount / "lat", tiny_vae_dir, "--dtype", "fp32")]
    results = small_disk.run(mount, [(64, argv), (4096, argv)], tmp_path / "logs", tmp_path / "snap", ENV, ROOT)
    full, rerun = results
    err = " ".join(full.stderr.split())
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-2000:]
    assert "no space left on the disk holding" in err and "rerun the same command" in err
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert 0 < int(rerun.stdout.split("this run encoded ")[1].split()[0]) < 24  # kept what the full disk had written
    snap = tmp_path / "snap" / "lat"
    assert not list(snap.glob(".tmp-*")) and len(LatentDataset(snap, verify=True)) == 24
