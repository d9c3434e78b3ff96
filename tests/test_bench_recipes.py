"""The recipe benchmark's arithmetic (tests/bench/bench_recipes.py) on hand-made rows: no training, no sampling."""
import importlib.util
from pathlib import Path

import pytest

from tests.helpers import space_of

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


def test_a_run_longer_than_steps_is_cut_at_steps():
    seconds = {500: 100.0, 1000: 200.0, 1500: 300.0, 2000: 400.0}
    fds = {"1.5": {500: 90.0, 1000: 50.0, 1500: 45.0, 2000: 40.0}}
    record = bench.run_record("sit", 0, Path("runs/sit-seed0"), seconds, fds, 1000)
    assert record["steps"] == [500, 1000] and record["fd"] == {"1.5": [90.0, 50.0]}
    assert record["seconds"] == [100.0, 200.0] and record["seconds_per_step"] == pytest.approx(0.2)
    # An export scored at one cfg only is left out of every curve, as is one not timed.
    record = bench.run_record("sit", 0, Path("r"), seconds, {"1": {500: 1.0}, "1.5": {500: 2.0, 1000: 3.0}}, 2000)
    assert record["steps"] == [500]


def test_curves_are_read_with_the_settings_evaluate_run_records(tmp_path):
    """A recipe that records its sampling half (lightning) is scored, and its rows found, with that half."""
    from types import SimpleNamespace

    from evaluate.curve import settings_of
    from shared.network.models import ModelConfig
    from shared.runtime import rundir
    from shared.weights.export import save_weights

    args = SimpleNamespace(num_samples=300, num_sampling_steps=10, guide_channels="all", batch_size=300)
    for sampling, expected in (({"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, 0.89]},
                                {"sampler": "euler", "cfg_interval": [0.0, 0.89], "time_shift": 0.3}),
                               ({}, {"sampler": "euler"})):
        run = tmp_path / f"run{len(sampling)}"
        config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=10, learn_sigma=False,
                             objective="flow", sampling=sampling)
        save_weights(rundir.export_path(run, 100), config.build().state_dict(), config,
                     space_of({"image_size": 32, "latent_shape": [4, 4, 4]}), 100)
        settings = settings_of(bench.eval_options(args, run, 1.5, 0))
        assert {k: settings[k] for k in expected} == expected
        assert ("cfg_interval" in settings) == bool(sampling)


def test_final_only_links_the_export_of_the_records_last_step(tmp_path):
    from types import SimpleNamespace

    from shared.runtime import rundir

    run = tmp_path / "runs" / "sit-seed0"
    for step in (2000, 4000):
        rundir.export_path(run, step).parent.mkdir(parents=True, exist_ok=True)
        rundir.export_path(run, step).write_bytes(str(step).encode())
    folder = bench.final_only(SimpleNamespace(out=tmp_path), run, 2000)
    assert folder.name == "sit-seed0-step2000"
    assert [p.read_bytes() for p in rundir.list_exports(folder)] == [b"2000"]


def test_steps_must_end_on_an_export(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "100", "--every", "30"])
    assert "multiple of --every" in capsys.readouterr().err


@pytest.mark.parametrize("objective,sampler,interval", [("ddpm", "ddim", (0.0, 700.0)), ("flow", "euler", (0.0, 0.7))])
def test_model_rows_count_the_samplers_own_calls(tmp_path, objective, sampler, interval):
    from shared.runtime import rundir
    from shared.weights.export import save_weights
    from shared.network.models import ModelConfig

    config = ModelConfig(model="DiT-T/2", input_size=4, num_classes=5, objective=objective)
    export = save_weights(rundir.export_path(tmp_path, 10), config.build().state_dict(), config,
                          space_of({"image_size": 32, "latent_shape": [4, 4, 4]}), 10)
    assert bench.model_rows(export, sampler, 20, 1.0) == 20  # no guidance: one row per step
    assert bench.model_rows(export, sampler, 20, 1.5) == 40  # guided: [cond; null] every step
    # 20 steps visit noise levels 999..0 in DiT timesteps (ddim: 0, 53, ..., 684 are <= 700) or sigma 1.0..0.05
    # (flow: 0.7, 0.65, ..., 0.05 are <= 0.7): 14 guided steps (2 rows) and 6 conditional ones (1 row).
    assert bench.model_rows(export, sampler, 20, 1.5, interval) == 2 * 14 + 6


def test_arms_and_the_combined_arm_join_the_options_of_one_recipe():
    assert bench.ARMS["sit-route"][:2] == ["--recipe", "sit"] and "--route-ratio" in bench.ARMS["sit-route"]
    joined = bench.combined_flags(["sit-repa", "sit-route"])
    assert joined[:2] == ["--recipe", "sit"] and joined.count("--recipe") == 1
    assert joined[2:] == bench.REPA + bench.ROUTE  # each option once, in the arms' order
    with pytest.raises(SystemExit, match="mixes the recipes"):
        bench.combined_flags(["dit", "sit-route"])
    # The route of the routing arms starts after REPA's depth, as train refuses otherwise.
    assert bench.ROUTE[bench.ROUTE.index("--route-start") + 1] >= bench.REPA[bench.REPA.index("--repa-depth") + 1]


def test_verdicts_call_a_gain_only_beyond_the_noise_floor():
    def arm(finals):  # two seeds whose last FDs are `finals`
        return {"fd": [20.0, sum(finals) / 2], "seeds": {0: [21.0, finals[0]], 1: [19.0, finals[1]]}}

    curves = {"dit": arm([10.0, 11.0]), "sit": arm([7.0, 8.0]), "close": arm([9.0, 10.4]), "bad": arm([14.0, 14.0])}
    out = bench.verdicts(curves, sampling_gap=0.5)
    assert set(out) == {"sit", "close", "bad"}
    assert out["sit"]["gain"] == pytest.approx(3.0) and out["sit"]["noise"] == pytest.approx(1.0)
    assert out["sit"]["verdict"] == "better"
    assert out["close"]["noise"] == pytest.approx(1.4)  # its own seed spread is the largest
    assert out["close"]["verdict"] == "within the noise floor"  # gain 0.8 < 1.4
    assert out["bad"]["verdict"] == "worse"
    assert bench.verdicts(curves, sampling_gap=5.0)["sit"]["verdict"] == "within the noise floor"


def test_step_timing_leaves_out_the_first_steps_and_the_checkpoint_step():
    rows = [{"step": s, "steps_per_s": r} for s, r in enumerate([0.1, 0.5, 2.0, 4.0, 1.0, 0.05], start=1)]
    t = bench.step_timing(rows)
    assert t["count"] == 3 and t["median"] == pytest.approx(0.5)
    assert t["min"] == pytest.approx(0.25) and t["max"] == pytest.approx(1.0)
    assert bench.step_timing(rows[:3])["median"] is None


def test_fewest_rows_and_solver_settings():
    assert bench.parse_solvers("euler:5,10 dopri5:1") == [("euler", 5), ("euler", 10), ("dopri5", 1)]
    rows = [{"arm": "sit", "sampler": "euler", "rows": r, "fd": fd} for r, fd in ((10, 9.0), (20, 6.0), (40, 5.0))]
    rows += [{"arm": "dit", "sampler": "ddpm", "rows": 500, "fd": 6.5}, {"arm": "sit", "sampler": "sde", "rows": 40,
                                                                           "fd": 8.0}]
    assert bench.fewest_rows(rows, 6.5) == {"sit euler": 20, "dit ddpm": 500, "sit sde": None}


def test_the_rae_arm_trains_dit_t1_on_its_own_latents_and_leaves_the_other_arms_unchanged(tmp_path):
    args = bench.parse_args(["--out", str(tmp_path), "--arms", "sit", "sit-rae"])
    shared = tmp_path / "latents"
    rae = [str(x) for x in bench.train_argv(args, "sit-rae", 0, shared)]
    assert rae.count("--model") == 1 and rae[rae.index("--model") + 1] == bench.RAE_MODEL == "DiT-T/1"
    assert rae[rae.index("--latents") + 1] == str(tmp_path / "latents-rae")
    assert rae[rae.index("--recipe") + 1] == "sit" and "--global-batch-size" in rae  # the demo's other settings
    # The arms before it: exactly the flags they had (so a long run of them resumes), on OUT/latents.
    sit = [str(x) for x in bench.train_argv(args, "sit", 0, shared)]
    assert sit[:2] == ["--recipe", "sit"] and sit[2:12] == [str(x) for p in bench.DEMO_TRAIN.items() for x in p]
    assert sit[sit.index("--latents") + 1] == str(shared)
    assert bench.decoder_of(args, "sit-rae") == args.rae and bench.decoder_of(args, "sit") == args.vae
    assert bench.arm_of(tmp_path / "runs" / "sit-rae-seed0") == "sit-rae"
    assert bench.arm_of(tmp_path / "final" / "sit-seed1-step100") == "sit"
    with pytest.raises(SystemExit):  # another tokenizer's arm cannot join the combined arm's shared latents
        bench.parse_args(["--combine", "sit-repa", "sit-rae"])


def test_the_tokenizer_comparison_is_rae_against_sit():
    def arm(finals, seconds):
        return {"steps": [100, 200], "fd": [40.0, sum(finals) / 2], "seconds": seconds,
                "seeds": {0: [41.0, finals[0]], 1: [39.0, finals[1]]}}

    runs = []
    for name, finals, secs in (("sit", (20.0, 22.0), [10.0, 20.0]), ("sit-rae", (10.0, 11.0), [12.0, 24.0])):
        for seed in (0, 1):
            runs.append({"recipe": name, "seed": seed, "steps": [100, 200], "seconds": secs,
                         "fd": {"1": arm(finals, secs)["seeds"][seed]}})
    summary = bench.summarise(runs, [1.0], {"repeats": [{"cfg": 1.0, "gap": 0.5}]})["1"]
    assert summary["reach"] == {} and summary["verdicts"] == {}  # no dit arm: the recipe tables stay empty
    reach, verdict = summary["tokenizers"]["reach"], summary["tokenizers"]["verdict"]
    assert reach["sit"]["target"] == pytest.approx(21.0)
    # sit-rae falls from 40 to 10.5 between steps 100 and 200: 21 is reached at 100 + 100 * 19 / 29.5.
    assert reach["sit-rae"]["step"] == pytest.approx(100 + 100 * 19 / 29.5)
    assert reach["sit-rae"]["step_ratio"] == pytest.approx(200 / (100 + 100 * 19 / 29.5))
    assert verdict["gain"] == pytest.approx(10.5) and verdict["noise"] == pytest.approx(2.0)
    assert verdict["verdict"] == "better"
    assert "tokenizers" not in bench.summarise([r for r in runs if r["recipe"] == "sit"], [1.0])["1"]
