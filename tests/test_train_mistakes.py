"""Everyday mistakes around training end in the right result or one paragraph naming the fix (issue 11).

A second launch on a live run, a damaged newest checkpoint, NaN weights on disk, a full disk at a
checkpoint, the wrong --image-size, retention of EMA exports and the old precision spelling, each through
the real `python -m train` entry point (in process, or a real subprocess where processes are the point).
"""
import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shared.runtime import rundir
from tests import small_disk
from tests.conftest import ROOT
from tests.helpers import LAUNCHER, checkpoints, cli, expect_user_error, finish, run_inprocess, train_args, wait_for


def _ckpt(run, step: int):
    return run / "checkpoints" / f"step-{step:07d}"


@pytest.mark.slow
def test_second_launch_on_a_live_run_exits_naming_the_pid(latents, tmp_path):
    run, pauses = tmp_path / "run", tmp_path / "pause"
    flags = ["--max-steps", "4", "--ckpt-every", "2"]
    first = cli(LAUNCHER + train_args(latents, run, *flags), {"TRACE_DIR": str(pauses), "PAUSE_AT": "checkpoint:2"})
    try:
        wait_for(pauses / "paused", first)  # the first run holds the folder, with a checkpoint to "resume" from
        second = cli(train_args(latents, run, *flags))
        _, err = second.communicate(timeout=300)
        assert first.poll() is None
        err = " ".join(err.split())
        assert second.returncode == 2 and "Traceback" not in err
        assert f"--results-dir {run} is in use by another process: PID {first.pid}" in err
        assert checkpoints(run) == ["step-0000002"]  # the second launch wrote nothing
    finally:
        first.kill()
        first.communicate(timeout=60)
    out = finish(cli(train_args(latents, run, *flags)))  # the killed holder's lock died with it
    assert "resumed from" in (run / "log.txt").read_text() and checkpoints(run)[-1] == "step-0000004", out


def test_damaged_newest_checkpoint_names_the_one_to_delete(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "4", "--ckpt-every", "2", "--keep-last", "2")
    newest = _ckpt(run, 4)
    (newest / rundir.MODEL_FILE).write_bytes((newest / rundir.MODEL_FILE).read_bytes()[:1000])  # truncated
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "6", "--ckpt-every", "2"))
    assert f"the checkpoint {newest} cannot be resumed: cannot read {newest / rundir.MODEL_FILE}" in message
    assert "the file is truncated" in message
    assert f"Delete {newest} to resume from step-0000002" in message and "re-export" not in message
    # Following the advice works, and resumes where it said.
    import shutil
    shutil.rmtree(newest)
    run_inprocess(latents, run, "--max-steps", "6", "--ckpt-every", "2")
    assert f"resumed from {_ckpt(run, 2)} at step 2" in (run / "log.txt").read_text()


def test_nonfinite_weights_in_a_checkpoint_are_refused_on_resume(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2")
    path = _ckpt(run, 2) / rundir.EMA_FILE
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()  # the model config travels in the metadata: keep it
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, path, metadata=metadata)
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "4"))
    assert f"the checkpoint {_ckpt(run, 2)} holds non-finite ema weights ({name}" in message
    assert "No older checkpoint exists" in message and "--resume none" in message


def test_a_checkpoint_config_with_unknown_settings_is_refused_not_dropped(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2")
    state_file = _ckpt(run, 2) / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["ema_warmup"] = 1000  # a setting another version would train with
    state_file.write_text(json.dumps(state))
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "4"))
    assert f"the config of {_ckpt(run, 2)} holds settings this version does not know (ema_warmup)" in message
    assert "start a fresh run with a new --results-dir" in message
    assert checkpoints(run) == ["step-0000002"]


def test_keep_exports_retains_the_newest(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "6", "--ckpt-every", "2", "--keep-exports", "2")
    assert [p.name for p in rundir.list_exports(run)] == ["ema-step-0000004.safetensors",
                                                           "ema-step-0000006.safetensors"]
    assert checkpoints(run) == ["step-0000004", "step-0000006"]  # --keep-last 2, the default, unchanged


def test_image_size_is_checked_against_the_latents(latents, tmp_path, capsys):
    message = expect_user_error(capsys, train_args(latents, tmp_path / "run", "--image-size", "256"))
    assert f"--image-size 256, but the latents in {latents} were extracted at 8x8" in message
    assert not (tmp_path / "run").exists()
    run_inprocess(latents, tmp_path / "run", "--image-size", "8", "--max-steps", "1")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["image_size"] == 8


def test_one_precision_flag_under_accelerate_spelling(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--mixed-precision", "no", "--max-steps", "1")
    saved = json.loads((run / "config.json").read_text())
    assert saved["precision"] == "fp32" and "mixed_precision" not in saved
    message = expect_user_error(capsys, train_args(latents, tmp_path / "r2", "--keep-exports", "-1"))
    assert "--keep-exports must be at least 0; got -1" in message


@pytest.mark.parametrize("flags, needle", [
    (["--lr", "0"], "--lr must be above 0; got 0. Pass a value in (0, inf)."),
    (["--lr", "inf"], "--lr must be below inf; got inf."),
    (["--class-dropout-prob", "1"], "--class-dropout-prob must be below 1; got 1. Pass a value in [0, 1)."),
    (["--ema-decay", "1.5"], "--ema-decay must be at most 1; got 1.5. Pass a value in [0, 1]."),
    (["--adam-betas", "0.9", "1"], "--adam-betas must be below 1; got 1."),
    (["--epochs", "0"], "--epochs must be above 0; got 0."),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1; got 0. Pass a value of 1 or more."),
    (["--grad-checkpoint", "-1"], "--grad-checkpoint must be at least 0; got -1."),
])
def test_out_of_range_flags_are_one_paragraph_before_the_latents_are_read(tmp_path, capsys, flags, needle):
    message = expect_user_error(capsys, train_args(tmp_path / "no-latents", tmp_path / "run", *flags))
    assert needle in message and "Traceback" not in message
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(not small_disk.available(), reason="needs unshare + an unprivileged tmpfs mount (Linux)")
def test_full_disk_at_a_checkpoint_is_one_paragraph_and_the_rerun_continues(latents, tmp_path):
    mount = tmp_path / "mnt"
    argv = [sys.executable, "-m", "train", *train_args(latents, mount / "run", "--max-steps", "4", "--ckpt-every", "2",
                                                         "--keep-last", "1")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # One DiT-T/2 checkpoint + export is ~70 MB: 100 MB holds the first, not the second beside it.
    full, rerun = small_disk.run(mount, [(100 * 1024, argv), (400 * 1024, argv)], tmp_path / "logs",
                                 tmp_path / "snap", env, ROOT)
    err = " ".join(full.stderr.split())
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert "no space left on the disk holding" in err and "rerun the same command" in err
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    snap = tmp_path / "snap" / "run"
    log = (snap / "log.txt").read_text()
    assert f"resumed from {mount / 'run' / 'checkpoints' / 'step-0000002'} at step 2" in log
    assert checkpoints(snap) == ["step-0000004"] and not list((snap / "checkpoints").glob(".tmp-*"))
