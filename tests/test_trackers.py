"""--report-to through Accelerate's trackers: TensorBoard event files hold the run's metrics; a tracker that is
asked for but not installed, and a --watch-vae that cannot work, are one paragraph before anything is written."""
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import expect_user_error, make_latents, metrics, run_inprocess, train_args


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> Path:
    return make_latents(tmp_path_factory.mktemp("latents") / "lat")


def event_scalars(folder: Path) -> dict:
    """{tag: [(step, value)]} read back from the TensorBoard event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_logged_metrics(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "3", "--ckpt-every", "3", "--precision", "fp16",
                        "--report-to", "tensorboard")
    scalars = event_scalars(run / "tensorboard" / "train")
    logged = metrics(run)
    for key in ("loss", "lr", "grad_norm", "steps_per_s", "images_per_s", "skipped", "skipped_total", "loss_scale"):
        assert [s for s, _ in scalars[f"train/{key}"]] == [1, 2, 3], key
        assert [v for _, v in scalars[f"train/{key}"]] == pytest.approx([m[key] for m in logged], rel=1e-6), key
    assert "train/peak_mem_gb" not in scalars  # CUDA only: nothing is made up on the CPU
    assert (run / "curves.png").stat().st_size > 10_000  # redrawn after the checkpoint
    assert "drew " in (run / "log.txt").read_text()


def test_resume_hides_the_steps_a_killed_launch_logged_twice(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "1", "--keep-last", "0")
    shutil.rmtree(run / "checkpoints" / "step-0000002")  # as if killed after logging step 2, before its checkpoint
    run_inprocess(latents, run, "--max-steps", "2", "--ckpt-every", "1", "--keep-last", "0")
    steps = [s for s, _ in event_scalars(run / "tensorboard" / "train")["train/loss"]]
    assert steps == [1, 2]  # TensorBoard's purge_step hid the first launch's step 2 (else: 1, 2, 2)


def test_report_to_none_writes_no_event_files(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "1", "--report-to", "none")
    assert len(metrics(run)) == 1 and not (run / "tensorboard").exists()


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_tracker_that_is_not_installed_is_named(latents, tmp_path, capsys, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # importlib.util.find_spec now reports it missing
    argv = train_args(latents, tmp_path / "run", "--max-steps", "1", "--report-to", package)
    message = expect_user_error(capsys, argv)
    assert f"--report-to {package} needs the {package} package" in message
    assert f"pip install {package}" in message and "--report-to none" in message
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_watch_vae_needs_previews_and_a_vae_that_fits(latents, tmp_path, capsys, tiny_vae_dir):
    argv = train_args(latents, tmp_path / "run", "--max-steps", "1", "--dry-run", "--watch-vae", str(tiny_vae_dir))
    message = expect_user_error(capsys, argv)  # train_args sets --sample-every 0
    assert "--watch-vae decodes the --sample-every previews" in message
    message = expect_user_error(capsys, argv + ["--sample-every", "1", "--watch-vae", str(tmp_path / "nowhere")])
    assert "Unknown VAE" in message and str(tmp_path / "nowhere") in message
    wrong = make_latents(tmp_path / "lat8", shape=(8, 4, 4), scaling_factor=0.18215)  # 8 channels: tiny VAE has 4
    message = expect_user_error(capsys, train_args(wrong, tmp_path / "run", "--max-steps", "1", "--sample-every", "1",
                                                   "--watch-vae", str(tiny_vae_dir)))
    assert "cannot decode these latents" in message and "latent channels" in message


def test_a_failing_plot_is_logged_and_training_goes_on(latents, tmp_path, monkeypatch):
    import train.plot

    def broken(run_dir):
        raise RuntimeError("no fonts today")

    monkeypatch.setattr(train.plot, "plot_run", broken)
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2", "--report-to", "none")
    log = (run / "log.txt").read_text()
    assert log.count("could not draw curves.png (RuntimeError: no fonts today); training goes on") == 1
    assert json.loads((run / "checkpoints" / "step-0000002" / "state.json").read_text())["step"] == 2
