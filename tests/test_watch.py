"""`python -m sample watch RUN`: preview latents become labelled grids as they appear, each once; the watcher stops
when asked or when the run ends; `train --watch-vae` runs it beside a real training process that never imports
diffusers."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sample.__main__ import main
from shared.sampling.generate import read_png
from sample.watch import WatchOptions, end_reason, run_is_locked
from shared.runtime.lock import hold_lock
from tests.helpers import LAUNCHER, cli, finish, make_latents, space_of, trace, train_args
from shared.sampling.previews import write_preview as write_preview_file
from train.preview import preview_labels

ROOT = Path(__file__).resolve().parents[1]
SCALE = 0.18215  # the tiny test VAE's scaling factor (diffusers' default), recorded with the latents
META = {"image_size": 8, "scaling_factor": SCALE, "latent_shape": [4, 4, 4], "class_names": ["c0", "c1", "c2", "c3"],
        "vae": {"source": "synthetic", "scaling_factor": SCALE, "latent_channels": 4, "downsample_factor": 2}}


def write_preview(run: Path, step: int, channels: int = 4) -> Path:
    """RUN/samples/step-X.safetensors as training writes it: 8 latents of 4 classes."""
    latents = torch.randn(8, channels, 4, 4, generator=torch.Generator().manual_seed(step))
    meta = {**META, "latent_shape": [channels, 4, 4], "vae": {**META["vae"], "latent_channels": channels}}
    return write_preview_file(run / "samples" / f"step-{step:07d}.safetensors", latents, preview_labels(4), space_of(meta), step)


@pytest.fixture
def run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"report_to": "tensorboard", "total_steps": 4}))
    return run


def watch(run: Path, vae: Path, *extra) -> None:
    main(["watch", str(run), "--vae", str(vae), "--cpu", "--interval", "0.1", *extra])


def expect_watch_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(["watch", *map(str, argv)])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("python -m sample watch: error:") and "Traceback" not in err
    return err


def test_each_preview_becomes_a_labelled_grid_once(run, tiny_vae_dir, capsys):
    for step in (2, 4):
        write_preview(run, step)
    watch(run, tiny_vae_dir, "--exit-when-done")  # no training holds the run: decode what is there, then stop
    out = capsys.readouterr().out
    assert "stopped (no training process holds the run folder): 2 grid(s) written" in out
    for step in (2, 4):
        folder = run / "samples" / f"step-{step:07d}"
        assert sorted(p.name for p in folder.iterdir())[:2] == ["000000-class0-c0.png", "000001-class0-c0.png"]
        grid = read_png(run / "samples" / f"step-{step:07d}.png")
        first = np.kron(read_png(folder / "000000-class0-c0.png"), np.ones((12, 12, 1), np.uint8))  # 8 px -> 96
        assert any(np.array_equal(grid[y:y + 96, 4:100], first) for y in range(60)), "first image not in the grid"
        assert grid.shape[0] > 4 * 96 and grid.shape[1] > 2 * 96  # one row per class (4), two images each
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard" / "previews"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("previews")] == [2, 4]

    stamps = {p: p.stat().st_mtime_ns for p in (run / "samples").glob("*.png")}
    watch(run, tiny_vae_dir, "--exit-when-done", "--report-to", "none")
    assert "0 grid(s) written" in capsys.readouterr().out  # already decoded: skipped
    assert stamps == {p: p.stat().st_mtime_ns for p in (run / "samples").glob("*.png")}
    newer = write_preview(run, 4)  # a resumed run wrote step 4 again
    os.utime(newer, ns=(time.time_ns() + 10**9,) * 2)
    watch(run, tiny_vae_dir, "--exit-when-done", "--report-to", "none")
    out = capsys.readouterr().out
    assert "step 4:" in out and "step 2:" not in out  # only the rewritten preview is decoded again


def test_the_end_of_a_run_is_seen_three_ways(run, tmp_path):
    lock = hold_lock(run, "run folder")  # what a live `python -m train` holds
    assert run_is_locked(run)
    assert end_reason(run, WatchOptions(run=str(run), exit_when_done=True)) is None
    lock.release()
    ended = end_reason(run, WatchOptions(run=str(run), exit_when_done=True))
    assert ended == "no training process holds the run folder"
    (run / "checkpoints" / "step-0000004").mkdir(parents=True)
    (run / "checkpoints" / "step-0000004" / "state.json").write_text("{}")
    assert end_reason(run, WatchOptions(run=str(run), until_step=6)) is None
    assert end_reason(run, WatchOptions(run=str(run), until_step=4)) == "the checkpoint of step 4 exists"
    sleeper = subprocess.Popen(["sleep", "30"])
    assert end_reason(run, WatchOptions(run=str(run), until_pid=sleeper.pid)) is None
    sleeper.kill()
    sleeper.wait()
    assert end_reason(run, WatchOptions(run=str(run), until_pid=sleeper.pid)) == f"process {sleeper.pid} has ended"


def test_mistakes_are_one_paragraph(run, tmp_path, tiny_vae_dir, capsys):
    assert "is not a folder" in expect_watch_error(capsys, [tmp_path / "nowhere", "--vae", tiny_vae_dir])
    assert "Unknown VAE" in expect_watch_error(capsys, [run, "--vae", tmp_path / "novae"])
    assert "--interval must be above 0" in expect_watch_error(capsys, [run, "--interval", "0"])
    with hold_lock(run / "samples", "preview folder"):
        err = expect_watch_error(capsys, [run, "--vae", tiny_vae_dir, "--exit-when-done"])
    assert "is in use by another process" in err and f"PID {os.getpid()}" in err
    write_preview(run, 2, channels=8)  # latents the 4-channel VAE cannot decode
    err = expect_watch_error(capsys, [run, "--vae", tiny_vae_dir, "--exit-when-done", "--cpu"])
    assert "cannot decode these latents" in err


@pytest.mark.slow
def test_a_launch_watcher_waits_for_the_last_one_and_sigterm_stops_it_cleanly(run, tiny_vae_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launch = subprocess.Popen(["sleep", "120"])  # stands in for the training process that started the watcher
    old = hold_lock(run / "samples", "preview folder")  # the previous launch's watcher, still decoding
    proc = subprocess.Popen([sys.executable, "-m", "sample", "watch", str(run), "--vae", str(tiny_vae_dir), "--cpu",
                             "--until-pid", str(launch.pid), "--interval", "0.2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("waiting: "), proc.stderr.read()[-2000:]
        old.release()
        line = proc.stdout.readline()
        while line.startswith("waiting: "):
            line = proc.stdout.readline()
        assert line.startswith("watching ")  # took the lock; nothing to decode; waiting for previews
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        launch.kill()
        launch.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "stopped (asked to): 0 grid(s) written" in out


@pytest.mark.slow
def test_train_watch_vae_decodes_a_real_run_beside_it(tmp_path, tiny_vae_dir):
    latents = make_latents(tmp_path / "lat", scaling_factor=SCALE)
    run = tmp_path / "run"
    args = train_args(latents, run, "--max-steps", "4", "--ckpt-every", "4", "--sample-every", "2",
                      "--sample-steps", "2", "--watch-vae", str(tiny_vae_dir), "--report-to", "none")
    finish(cli(LAUNCHER + args, {"TRACE_DIR": str(tmp_path / "trace")}))
    assert trace(tmp_path / "trace")["diffusers_imported"] is False  # the VAE lived in the watcher only
    for step in (2, 4):
        assert read_png(run / "samples" / f"step-{step:07d}.png").shape[0] > 4 * 96
    log = (run / "log.txt").read_text()
    assert "started the preview watcher" in log and "the preview watcher finished" in log
    watch_log = (run / "watch.log").read_text()
    assert "stopped (the checkpoint of step 4 exists): 2 grid(s) written" in watch_log
