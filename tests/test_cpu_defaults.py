"""What a new user on a CPU meets first (issue 29.11): DataLoader workers fitted to the cores, a word before
DiT-XL/2 is built and how long its step will take, progress inside a sampling batch, a labelled sample grid,
--check's upscaling count at --image-size, and a refused resume that shows the values that differ."""
import re

import numpy as np
from PIL import Image

import shared.runtime.distributed as distributed
import train.loop as loop
from extract.__main__ import main as extract_main
from tests.conftest import make_image_folder
from tests.helpers import expect_user_error, make_latents, run_main, train_args, space_of
from train.__main__ import main as train_main
from train.estimate import duration, step_seconds


def _no_workers_flag(args: list[str]) -> list[str]:
    """train_args without its --num-workers 0, so the default applies."""
    i = args.index("--num-workers")
    return args[:i] + args[i + 2:]


def test_default_workers_leave_a_core_per_process(monkeypatch):
    monkeypatch.setattr(distributed, "usable_cores", lambda: 2)
    assert distributed.default_workers(4) == 1 and distributed.default_workers(4, num_processes=2) == 0
    monkeypatch.setattr(distributed, "usable_cores", lambda: 32)
    assert distributed.default_workers(4) == 4 and distributed.default_workers(8, num_processes=4) == 7


def test_train_on_two_cores_uses_one_worker_and_says_what_a_step_costs(latents, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(distributed, "usable_cores", lambda: 2)
    used = []
    real = loop.make_loader
    monkeypatch.setattr(loop, "make_loader", lambda *a, **kw: used.append(kw["num_workers"]) or real(*a, **kw))
    code, _, err = run_main(train_main, _no_workers_flag(train_args(latents, tmp_path / "run", "--max-steps", 1)),
                            capsys)
    assert code == 0, err
    assert used == [1]  # not PyTorch's 4 on a 2-core machine (it warns about that)
    assert re.search(r"train: on this CPU \(\d+ GFLOP/s in fp32 matrix products\), one step of DiT-T/2 at global "
                     r"batch 8 .* will take about (under 0.01 s|[\d.,]+ (s|min|h|days|years)) at best", err), err
    assert "no --model given" not in err


def test_no_model_says_dit_xl_and_its_step_time_before_building(latents, tmp_path, capsys):
    args = train_args(latents, tmp_path / "run", "--dry-run")
    args = args[2:]  # no --model
    code, _, err = run_main(train_main, args, capsys)
    assert code == 0, err
    note = err.index("no --model given: training DiT-XL/2, DiT's headline model")
    estimate = err.index("one step of DiT-XL/2 at global batch 8")
    assert note < estimate and "pass --model DiT-S/2" in err


def test_the_step_estimate_scales_with_the_model_and_batch():
    from shared.network.models import ModelConfig

    small = ModelConfig("DiT-S/2", input_size=32, in_channels=4, num_classes=1000)
    xl = ModelConfig("DiT-XL/2", input_size=32, in_channels=4, num_classes=1000)
    s, gmac_s = step_seconds(small, 256, rate=1e12)
    x, gmac_x = step_seconds(xl, 256, rate=1e12)
    assert round(gmac_x, 1) == 118.6 and round(gmac_s, 2) == 6.06  # DiT's Table 4 (FACTS.md)
    assert abs(x - 6 * 118.6e9 * 256 / 1e12) / x < 1e-3 and x / s > 19
    assert duration(1e-5) == "under 0.01 s" and duration(0.4) == "0.4 s" and duration(600) == "10 min" and duration(86400 * 41) == "41 days"
    assert duration(86400 * 365 * 1240) == "1,240 years"


def test_sample_shows_progress_inside_a_batch_and_a_labelled_grid(tmp_path, tiny_vae_dir, capsys):
    from sample.__main__ import main as sample_main
    from shared.network.models import ModelConfig
    from shared.runtime import rundir
    from shared.weights.export import save_weights
    from shared.tokenizers.locate import load_tokenizer

    vae = load_tokenizer(tiny_vae_dir)
    config = ModelConfig("DiT-T/2", input_size=4, in_channels=4, num_classes=3)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 4, 4], "vae": vae.identity,
            "class_names": ["cat", "dog", "eel"]}
    save_weights(rundir.export_path(tmp_path / "run", 10), config.build().state_dict(), config, space_of(meta), 10)
    out = tmp_path / "s"
    code, _, err = run_main(sample_main, ["--ckpt", tmp_path / "run", "--vae", tiny_vae_dir, "--out", out,
                                          "--num-samples", 3, "--num-sampling-steps", 7, "--sampler", "ddim",
                                          "--batch-size", 3, "--cpu"], capsys)
    assert code == 0, err
    assert re.search(r"\b0/7\b", err), err  # a bar over the 7 sampling steps of the one batch
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    assert grid.shape[1] > 3 * 16 and (grid[:10] < 128).any()  # cells enlarged, a dark title on a white band


def test_check_counts_upscaling_at_the_given_image_size(tmp_path, capsys):
    root = make_image_folder(tmp_path / "d", classes=("a",), per_class=2, size=(100, 120))
    for size, expected in ((64, None), (128, "2 images have a short side below --image-size 128")):
        code, out, _ = run_main(extract_main, ["--data-path", root, "--check", "--num-workers", 0,
                                               "--image-size", size], capsys)
        assert ("short side below" in out) == (expected is not None) and (expected is None or expected in out)


def test_a_refused_resume_shows_the_values_that_differ(tmp_path, capsys):
    first, other = make_latents(tmp_path / "a", n=32), make_latents(tmp_path / "b", n=40)
    run = tmp_path / "run"
    assert train_main(train_args(first, run, "--max-steps", "1")) == 0
    message = expect_user_error(capsys, train_args(other, run, "--max-steps", "2"))
    assert "num_samples: 32 -> 40" in message and re.search(r"index_sha256: '[0-9a-f]{12}' -> '[0-9a-f]{12}'",
                                                             message), message
