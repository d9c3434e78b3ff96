"""One sampling flag family: sample and evaluate run take the same flags, a sampler's options are flags derived
from its record, and a model that records its recipe's sampling half (LightningDiT's euler, time shift 0.3,
interval 0 0.89) samples, previews and is evaluated with it unless a flag says otherwise."""
import dataclasses
import json

import pytest
import torch

from evaluate.curve import RunEvalOptions, run_parser
from sample.__main__ import sample_parser
from shared.sampling.plan import SampleOptions
from shared.generative.objectives import make_objective
from shared.generative.samplers import SAMPLER_OPTIONS, SAMPLERS, SAMPLING_KEYS, resolve_sampling
from shared.network.models import ModelConfig
from shared.runtime import rundir
from shared.runtime.cli import FLAG_KEY
from shared.runtime.errors import SettingError
from shared.weights.export import read_config, save_weights
from shared.sampling.flags import SamplingFlags
from shared.tokenizers.locate import load_tokenizer
from tests.helpers import run_main, space_of
from train.recipes import RECIPES

LIGHTNING = RECIPES["lightning"]["sampling"]


def test_sample_and_evaluate_run_take_the_one_family():
    """Every flag of the family is a flag of both commands with the same help (evaluate run: cheaper defaults)."""
    family = {f.name: f.metadata[FLAG_KEY] for f in dataclasses.fields(SamplingFlags)}
    assert set(SAMPLER_OPTIONS) <= set(family) and "precision" in family
    for cls, parser in ((SampleOptions, sample_parser()), (RunEvalOptions, run_parser())):
        fields = {f.name: f.metadata[FLAG_KEY] for f in dataclasses.fields(cls)}
        dests = {a.dest for a in parser._actions}
        for name, flag in family.items():
            # evaluate run states its own step count, not sample's recorded-count rule (STEPS_HELP begins both).
            same = fields[name].help == flag.help or name == "sampler" or (
                name == "num_sampling_steps" and flag.help.startswith(fields[name].help))
            assert name in dests and same, (cls, name)
    args = run_parser().parse_args(["RUN", "--num-samples", "2", "--time-shift", "0.3", "--ddim-eta", "0.5",
                                    "--last-step-size", "0.02", "--precision", "bf16"])
    assert (args.time_shift, args.ddim_eta, args.last_step_size, args.precision) == (0.3, 0.5, 0.02, "bf16")


def test_each_option_flag_comes_from_its_sampler_records():
    for name, option in SAMPLER_OPTIONS.items():
        flag = {f.name: f for f in dataclasses.fields(SamplingFlags)}[name].metadata[FLAG_KEY]
        takers = [s.name for s in SAMPLERS.values() if option in s.options]
        assert flag.default is None and flag.help.startswith("/".join(takers) + " only: " + option.help)
        assert f"(default {option.default:g}, or the model's recorded value)" in flag.help


def test_recipes_record_their_sampling_half_in_the_family_names():
    assert LIGHTNING == {"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, 0.89]}
    for recipe in RECIPES.values():
        assert set(recipe.get("sampling", {})) <= set(SAMPLING_KEYS)
        # each setting is a flag's; beside a plugin's sampler the module that registers it (as objective_plugin)
        assert set(SAMPLING_KEYS) - {"sampler_plugin"} <= {f.name for f in dataclasses.fields(SamplingFlags)}


def test_resolution_flags_win_then_the_record_then_the_objective():
    flow = make_objective("flow")
    plan = resolve_sampling(flow, None, {}, None, LIGHTNING, guided=True)
    assert (plan.sampler, plan.options, plan.cfg_interval) == ("euler", {"time_shift": 0.3}, (0.0, 0.89))
    plan = resolve_sampling(flow, "heun", {"time_shift": 0.5}, (0.0, 0.7), LIGHTNING, guided=True)
    assert (plan.sampler, plan.options, plan.cfg_interval) == ("heun", {"time_shift": 0.5}, (0.0, 0.7))
    plan = resolve_sampling(flow, "dopri5", {}, None, LIGHTNING, guided=False)  # takes no shift; no guidance
    assert (plan.sampler, plan.options, plan.cfg_interval) == ("dopri5", {}, None)
    assert resolve_sampling(flow, None, {}, None, {}, guided=True).sampler == "sde"
    assert resolve_sampling(flow, None, {}, None, {}, guided=True, fast=True).sampler == "euler"
    with pytest.raises(SettingError, match="samples flow models"):
        ModelConfig("DiT-T/2", 8, sampling=LIGHTNING)  # a ddpm model cannot record a flow sampler
    with pytest.raises(SettingError, match="does not know"):
        ModelConfig("DiT-T/2", 8, objective="flow", sampling={"cfg_sacle": 2})


def _lightning_export(run, vae, step=100):
    """RUN/exports/ema-step-<step> of a random flow DiT-T/2 that records LightningDiT's sampling half."""
    config = ModelConfig("DiT-T/2", input_size=16, in_channels=4, num_classes=10, objective="flow", sampling=LIGHTNING)
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    meta = {"image_size": 32, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 16, 16],
            "vae": vae.identity, "class_names": [str(c) for c in range(10)]}
    save_weights(rundir.export_path(run, step), model.state_dict(), config, space_of(meta), step)
    assert read_config(rundir.export_path(run, step)).sampling == LIGHTNING  # written into the export
    return rundir.export_path(run, step)


def test_a_lightning_model_samples_with_its_recipe_unless_told(tiny_vae_dir, tmp_path, capsys):
    from sample.__main__ import main

    export = _lightning_export(tmp_path / "run", load_tokenizer(tiny_vae_dir))
    common = ["--ckpt", export, "--vae", tiny_vae_dir, "--num-samples", 2, "--num-sampling-steps", 2, "--cfg-scale", 2,
              "--cpu"]
    code, _, err = run_main(main, [*common, "--out", tmp_path / "a"], capsys)
    assert code == 0, err
    identity = json.loads((tmp_path / "a" / "settings.json").read_text())["identity"]
    assert (identity["sampler"], identity["time_shift"], identity["cfg_interval"]) == ("euler", 0.3, [0.0, 0.89])
    code, _, err = run_main(main, [*common, "--out", tmp_path / "b", "--sampler", "heun", "--time-shift", 0.5,
                                   "--cfg-interval", 0, 1], capsys)
    assert code == 0, err
    identity = json.loads((tmp_path / "b" / "settings.json").read_text())["identity"]
    assert (identity["sampler"], identity["time_shift"], identity["cfg_interval"]) == ("heun", 0.5, [0.0, 1.0])
    code, out, err = run_main(main, [*common[:-1], "--ddim-eta", 0.5], capsys)  # a flag the recorded euler lacks
    assert code == 2 and "--ddim-eta 0.5 sets DDIM's eta in [0, 1]" in err and "--sampler ddim" in err


@pytest.mark.usefixtures("private_digits_cache")
def test_evaluate_run_scores_a_lightning_model_at_its_own_time_shift(tiny_vae_dir, tmp_path, capsys):
    from evaluate.__main__ import main

    run = tmp_path / "run"
    _lightning_export(run, load_tokenizer(tiny_vae_dir))
    flags = ["run", run, "--vae", tiny_vae_dir, "--features", "digits", "--num-samples", 4, "--num-sampling-steps", 2,
             "--batch-size", 4, "--cpu"]
    code, _, err = run_main(main, flags, capsys)
    assert code == 0, err
    code, _, err = run_main(main, [*flags, "--time-shift", 0.6, "--precision", "bf16"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in rundir.eval_path(run).read_text().splitlines()]
    assert [(r["sampler"], r["time_shift"], r["cfg_interval"], r.get("dit_precision")) for r in rows] == [
        ("euler", 0.3, [0.0, 0.89], None), ("euler", 0.6, [0.0, 0.89], "bf16")]
    assert all(isinstance(r["precision"], float) for r in rows)  # the metric, not overwritten by a setting
