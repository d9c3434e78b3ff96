"""The recipe benchmark's arithmetic (tests/bench/bench_recipes.py) on hand-made rows: no training, no sampling."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "tests" / "bench" / "bench_recipes.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_cumulative_seconds_sums_each_window_and_skips_repeats():
    rows = [{"step": 50, "steps_per_s": 10.0}, {"step": 100, "steps_per_s": 5.0}, {"step": 150, "steps_per_s": 25.0}]
    assert bench.cumulative_seconds(rows) == pytest.approx({50: 5.0, 100: 15.0, 150: 17.0})
    # A row that does not advance (a duplicate) adds nothing.
    assert bench.cumulative_seconds(rows + [{"step": 150, "steps_per_s": 1.0}])[150] == pytest.approx(17.0)


def test_seconds_at_interpolates_from_zero_and_stops_at_the_end():
    seconds = {100: 10.0, 200: 30.0}
    assert bench.seconds_at(seconds, 50) == pytest.approx(5.0)
    assert bench.seconds_at(seconds, 150) == pytest.approx(20.0)
    assert bench.seconds_at(seconds, 201) is None


def test_first_reach_interpolates_between_the_exports_around_the_crossing():
    steps, fds = [100, 200, 300], [30.0, 20.0, 10.0]
    assert bench.first_reach(steps, fds, 15.0) == pytest.approx(250.0)
    assert bench.first_reach(steps, fds, 20.0) == pytest.approx(200.0)
    assert bench.first_reach(steps, fds, 40.0) == 100.0  # already below at the first export
    assert bench.first_reach(steps, fds, 5.0) is None
    # The first crossing counts, even when the curve rises again afterwards.
    assert bench.first_reach([100, 200, 300], [30.0, 10.0, 25.0], 20.0) == pytest.approx(150.0)


def test_reach_table_gives_ratios_against_dit_and_not_reached():
    curves = {
        "dit": {"steps": [100, 200], "fd": [30.0, 20.0], "seconds": [10.0, 20.0]},
        "sit": {"steps": [100, 200], "fd": [25.0, 15.0], "seconds": [20.0, 40.0]},
        "slow": {"steps": [100, 200], "fd": [40.0, 35.0], "seconds": [10.0, 20.0]},
    }
    reach = bench.reach_table(curves)
    assert reach["dit"]["step"] == pytest.approx(200.0) and reach["dit"]["step_ratio"] == pytest.approx(1.0)
    assert reach["sit"]["target"] == 20.0
    assert reach["sit"]["step"] == pytest.approx(150.0) and reach["sit"]["seconds"] == pytest.approx(30.0)
    assert reach["sit"]["step_ratio"] == pytest.approx(200 / 150)
    assert reach["sit"]["seconds_ratio"] == pytest.approx(20 / 30)  # fewer steps, but each costs twice as much
    assert reach["slow"]["step"] is None and reach["slow"]["step_ratio"] is None


def test_summarise_means_over_seeds_per_cfg():
    runs = [{"recipe": "dit", "seed": s, "steps": [10, 20], "seconds": [1.0 + s, 2.0 + s],
             "fd": {"1": [10.0 + s, 8.0 + s], "1.5": [9.0, 7.0]}} for s in (0, 1)]
    summary = bench.summarise(runs, [1.0, 1.5])
    dit = summary["1"]["curves"]["dit"]
    assert dit["fd"] == pytest.approx([10.5, 8.5]) and dit["seconds"] == pytest.approx([1.5, 2.5])
    assert dit["seeds"] == {0: [10.0, 8.0], 1: [11.0, 9.0]}
    assert summary["1.5"]["reach"]["dit"]["target"] == pytest.approx(7.0)


def test_steps_must_end_on_an_export(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "100", "--every", "30"])
    assert "multiple of --every" in capsys.readouterr().err


@pytest.mark.parametrize("objective,sampler,interval", [("ddpm", "ddim", (0.0, 700.0)), ("flow", "euler", (0.0, 0.7))])
def test_model_rows_count_the_samplers_own_calls(tmp_path, objective, sampler, interval):
    from shared.runtime import rundir
    from shared.runtime.export import save_weights
    from shared.network.models import ModelConfig

    config = ModelConfig(model="DiT-T/2", input_size=4, num_classes=5, objective=objective)
    export = save_weights(rundir.export_path(tmp_path, 10), config.build().state_dict(), config, {"image_size": 32},
                          10)
    assert bench.model_rows(export, sampler, 20, 1.0) == 20  # no guidance: one row per step
    assert bench.model_rows(export, sampler, 20, 1.5) == 40  # guided: [cond; null] every step
    # 20 steps visit noise levels 999..0 in DiT timesteps (ddim: 0, 53, ..., 684 are <= 700) or sigma 1.0..0.05
    # (flow: 0.7, 0.65, ..., 0.05 are <= 0.7): 14 guided steps (2 rows) and 6 conditional ones (1 row).
    assert bench.model_rows(export, sampler, 20, 1.5, interval) == 2 * 14 + 6
