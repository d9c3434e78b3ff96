"""`python -m train.plot RUN`: curves of metrics.jsonl and eval.jsonl as one PNG; bad input is one paragraph."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.runtime.rundir import read_step_rows
from shared.sampling.evalcurve import SERIES_KEYS, metric_lines, metric_title, same_series
from train.plot import auto_weight, main, panels, smooth


def write_jsonl(path: Path, rows, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


@pytest.fixture
def run(tmp_path) -> Path:
    """A run folder with 40 logged steps (fp16: a loss scale, skipped steps, one NaN loss) and 3 evaluations."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 1 / s if s != 7 else math.nan, "lr": 1e-4, "grad_norm": 10.0 / s,
             "steps_per_s": 2.0, "images_per_s": 16.0, "skipped": int(s == 7), "skipped_total": int(s >= 7),
             "loss_scale": 65536.0 / (2 if s >= 7 else 1)} for s in range(1, 41)]
    write_jsonl(run / "metrics.jsonl", rows, tail='{"step": 41, "loss": 0.0')  # a line cut short by a kill
    evals = [{"step": s, "fid": 100.0 / s, "digits_fd": 5.0 - s / 10, "my_score": s * 1.5, "num_samples": 1000,
              "cfg_scale": 1.5, "sampler": "ddim"} for s in (10, 20, 40)]
    write_jsonl(run / "eval.jsonl", evals)
    return run


def test_every_panel_is_drawn_from_what_the_run_logged(run, capsys):
    assert main([str(run)]) == 0
    assert f"wrote {run / 'curves.png'}" in capsys.readouterr().out
    with Image.open(run / "curves.png") as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000 and pixels.std() > 10  # 3 rows of 3 panels, not blank
    titles = [p[0] for p in panels(read_step_rows(run / "metrics.jsonl"), read_step_rows(run / "eval.jsonl"))]
    assert titles == ["training loss", "learning rate", "gradient norm (before clipping)", "throughput (images/s)",
                      "fp16 loss scale", "skipped steps (total)", "fid (eval.jsonl)", "digits_fd (eval.jsonl)",
                      "my_score (eval.jsonl)"]  # unknown metric keys too; settings (num_samples, cfg_scale) not
    assert read_step_rows(run / "metrics.jsonl")[-1]["step"] == 40  # the torn line is skipped


def test_evaluations_made_two_ways_are_two_labelled_lines():
    rows = [{"step": s, "fid": 10.0 / s, "cfg_scale": cfg, "sampler": "ddim", "seconds": 3.0}
            for s in (1, 2) for cfg in (1.5, 4.0)]
    assert metric_lines(rows, "fid") == [("cfg_scale 1.5", [1, 2], [10.0, 5.0]), ("cfg_scale 4.0", [1, 2], [10.0, 5.0])]
    assert metric_lines(rows[:1], "fid") == [(None, [1], [10.0])]
    digits = [{**row, "feature_network": "digits"} for row in rows]
    assert metric_title(digits, "fid") == "digits FD" and metric_title(rows, "fid") == "fid"
    assert metric_title([*digits, {"step": 3, "fid": 1.0, "feature_network": "inception"}], "fid") == "fid"


def test_a_guidance_interval_is_its_own_series_in_both_pictures():
    """curves.png (train.plot) and eval.png (evaluate run) group points by the same settings: a point measured
    with a guidance interval never joins the line of one measured without, nor counts as already evaluated."""
    from evaluate.curve import RunEvalOptions, settings_of

    plain = {"step": 1, "fid": 9.0, "cfg_scale": 4.0, "sampler": "ddim"}
    rows = [plain, {**plain, "step": 2, "fid": 7.0, "cfg_interval": [0.0, 0.89]}]
    assert metric_lines(rows, "fid") == [("cfg_interval None", [1], [9.0]), ("cfg_interval (0.0, 0.89)", [2], [7.0])]
    settings = {"cfg_scale": 4.0, "sampler": "ddim"}
    assert same_series(rows, settings) == [plain] and same_series(rows, {**settings, "cfg_interval": (0, 0.89)}) == rows[1:]
    options = RunEvalOptions(run="r", num_samples=2, cfg_interval=(0.0, 0.89))
    assert set(settings_of(options)) <= set(SERIES_KEYS)  # every setting evaluate records separates series


def test_out_flag_and_only_eval_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "eval.jsonl", [{"step": 5, "fid": 50.0}])
    assert main([str(run), "--out", str(tmp_path / "c.png"), "--smooth", "0"]) == 0
    assert (tmp_path / "c.png").is_file() and not (run / "curves.png").exists()


def test_smoothing_is_debiased_and_skips_non_finite():
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    assert auto_weight(20) == 0.5 and auto_weight(4000) == pytest.approx(0.9875)  # ~1/50 of the points
    out = smooth([math.nan, 1.0, math.inf, 3.0], 0.5)
    assert math.isnan(out[0]) and out[1] == 1.0 and out[2] == 1.0 and out[3] == pytest.approx((0.5 * 1 + 3) / 1.5)


@pytest.mark.parametrize("argv, words", [
    (["{tmp}/missing"], "is not a folder"),
    (["{tmp}"], "has no metrics to draw yet"),
    (["{tmp}", "--smooth", "1"], "--smooth 1.0 must lie in [0, 1)"),
    (["{tmp}", "--out", "{tmp}/curves.jpg"], "must name a .png file"),
])
def test_bad_input_is_one_paragraph(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main([a.format(tmp=tmp_path) for a in argv])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("python -m train.plot: error:") and words in err and "Traceback" not in err
