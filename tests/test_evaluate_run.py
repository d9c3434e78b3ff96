"""`python -m evaluate run RUN`: every EMA export sampled through python -m sample's code path, evaluated with the
digits features, appended to RUN/eval.jsonl, the curve drawn; a rerun continues where it stopped."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from evaluate import digits
from evaluate.__main__ import main
from evaluate.curve import RunEvalOptions, export_image_size, read_rows, settings_of
from shared.sampling.evalcurve import same_series
from shared.runtime import rundir
from shared.weights.export import save_weights
from shared.network.models import ModelConfig
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace
from tests.helpers import run_main, space_of

FLAGS = ["--features", "digits", "--num-samples", 6, "--sampler", "ddim", "--num-sampling-steps", 2,
         "--cfg-scale", 1, "--batch-size", 6, "--cpu"]


pytestmark = pytest.mark.usefixtures("private_digits_cache")


def export(run, step, vae, seed):
    """Write RUN/exports/ema-step-<step> of a random DiT-T/2 drawing 32x32 images through the tiny VAE."""
    config = ModelConfig("DiT-T/2", input_size=16, in_channels=4, num_classes=10)
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # adaLN-Zero layers start at 0: perturb so outputs differ
    meta = {"image_size": 32, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 16, 16],
            "vae": vae.identity, "class_names": [str(c) for c in range(10)]}
    save_weights(rundir.export_path(run, step), model.state_dict(), config, space_of(meta), step)


def test_run_evaluates_every_export_draws_the_curve_and_continues(tiny_vae_dir, tmp_path, capsys):
    run = tmp_path / "run"
    vae = load_tokenizer(tiny_vae_dir)
    export(run, 100, vae, seed=0)
    export(run, 200, vae, seed=1)
    code, out, err = run_main(main, ["run", run, "--vae", tiny_vae_dir, *FLAGS], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in rundir.eval_path(run).read_text().splitlines()]
    assert [r["step"] for r in rows] == [100, 200]
    assert all(r["fid"] > 0 and r["num_samples"] == 6 and r["features"]["name"] == "digits" for r in rows)
    assert rows[0]["fid"] != rows[1]["fid"]  # two different networks were sampled
    assert rows[0]["sampler"] == "ddim" and rows[0]["num_sampling_steps"] == 2 and rows[0]["export"].endswith(".safetensors")
    assert rundir.eval_plot_path(run).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any((run / rundir.EVAL_SAMPLES).iterdir())  # sample folders removed once recorded

    export(run, 300, vae, seed=2)
    code, out, err = run_main(main, ["run", run, "--vae", tiny_vae_dir, "--keep-samples", *FLAGS], capsys)
    assert code == 0, err
    assert "2 already evaluated with these settings, 1 to go" in out
    again = [json.loads(line) for line in rundir.eval_path(run).read_text().splitlines()]
    assert again[:2] == rows and [r["step"] for r in again] == [100, 200, 300]
    kept = list((run / rundir.EVAL_SAMPLES).iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("step-0000300-ddim2-cfg1-n6-") and (kept[0] / "samples.npz").is_file()

    # Other settings make another curve: none of these points would be skipped for them.
    other = RunEvalOptions(run=str(run), num_samples=6, features="digits", sampler="ddim", num_sampling_steps=2,
                           cfg_scale=1.0, seed=1)
    assert same_series(read_rows(run), settings_of(other)) == []
    assert len(same_series(read_rows(run), settings_of(replace(other, seed=0)))) == 3


def test_run_mistakes_are_refused_before_sampling(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(main, ["run", tmp_path / "empty", *FLAGS], capsys)
    assert code == 2 and "holds no EMA exports" in err
    run = tmp_path / "run"
    rundir.export_path(run, 100).parent.mkdir(parents=True)
    rundir.export_path(run, 100).write_bytes(b"not read")  # refused before the export is opened
    code, _, err = run_main(main, ["run", run, "--num-samples", 100, "--ref", tmp_path / "ref.npz", "--is-split-size", 0],
                            capsys)
    assert code == 2 and "the Inception Score split size must be at least 1; got 0" in err
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=10)
    space = LatentSpace({"source": "t", "latent_channels": 4}, (4, 8, 8), 64, [str(i) for i in range(10)],
                        {"dit": LatentNorm.scale_only(0.5)})
    save_weights(rundir.export_path(run, 100), config.build().state_dict(), config, space, 100)  # the current format
    assert export_image_size(rundir.export_path(run, 100)) == 64
    code, _, err = run_main(main, ["run", run, *FLAGS], capsys)
    assert code == 2 and "fitted to 32x32 images" in err and "64x64" in err
    assert not rundir.eval_path(run).exists() and not (run / rundir.EVAL_SAMPLES).exists()
    save_weights(rundir.export_path(run, 100), config.build().state_dict(), config, None, 100)  # no record
    code, _, err = run_main(main, ["run", run, *FLAGS], capsys)
    assert code == 2 and "is absent or names no image size" in err, err  # not skipped: refused before sampling
    assert not rundir.eval_path(run).exists() and not (run / rundir.EVAL_SAMPLES).exists()


def test_the_demo_asks_evaluate_run_for_its_curve_and_reports_the_digits_distance(tmp_path):
    from data import demo
    from shared.datasets.digits import digit_images
    from evaluate.curve import run_parser

    dirs = demo.stage_dirs(tmp_path, demo.QUICK)
    args = run_parser().parse_args([str(a) for a in demo.curve_args(dirs, demo.QUICK, seed=0)][1:])
    assert args.run == str(dirs["run"]) and args.features == "digits" and args.num_samples == 10
    assert args.sampler == demo.QUICK.curve_sampler == "euler" and args.num_sampling_steps == demo.QUICK.curve_steps
    images, labels = digit_images()
    (tmp_path / "samples").mkdir()
    np.savez(tmp_path / "samples" / "samples.npz", arr_0=images[:100], labels=labels[:100])
    distance, floor = demo.digits_distance(tmp_path / "samples")
    assert distance == pytest.approx(digits.digits_fd(images[:100])) and floor == pytest.approx(digits.real_floor(100))
    assert demo.curve_png(dirs["run"]) == rundir.eval_plot_path(dirs["run"]).resolve()
