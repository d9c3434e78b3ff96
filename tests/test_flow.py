"""Flow matching (shared/generative/flow.py) and the objective seam, against references written here from SiT's equations.

The official SiT code itself is compared by tests/bench/check_sit_parity.py (it needs a SiT checkout).
"""
import math

import pytest
import torch

from shared.runtime.errors import SettingError, UserError
from shared.generative.flow import draw_time, flow_grid, shift_time
from shared.generative.guidance import GuidedModelFn
from shared.network.models import ModelConfig
from shared.generative.flow_objectives import FlowObjective
from shared.generative.diffusion import DDPMObjective
from shared.generative.objectives import make_objective, objective_of, run_sampler
from shared.generative.samplers import sampler_options

MU, S = 0.7, 0.5  # Gaussian data N(MU, S^2) per coordinate: its exact velocity field is known


def oracle_velocity(x, tau):
    """E[x1 - eps | x_tau] for x1 ~ N(MU, S^2), eps ~ N(0, 1), x_tau = tau x1 + (1 - tau) eps (Gaussian algebra)."""
    t = tau.view(-1, *([1] * (x.ndim - 1))).double()
    var = t ** 2 * S ** 2 + (1 - t) ** 2
    centred = x.double() - t * MU
    e_x1 = MU + t * S ** 2 / var * centred
    e_eps = (1 - t) / var * centred
    return (e_x1 - e_eps).float()


def oracle_model(convention="sit"):
    """A network answering with the exact velocity in the given convention, 2C channels like a DiT."""
    def model_fn(x, t):
        tau = t if convention == "sit" else 1 - t
        v = oracle_velocity(x, tau)
        v = v if convention == "sit" else -v
        return torch.cat([v, torch.full_like(v, 123.0)], dim=1)  # the second half must be ignored
    return model_fn


def test_loss_is_velocity_mse_on_the_linear_path():
    """SiT Eq. 1-5 written out: x_t = t x1 + (1 - t) eps, target x1 - eps, per-sample mean of squares."""
    g = torch.Generator().manual_seed(0)
    x1, eps = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    tau = torch.tensor([0.0, 0.3, 0.9])
    seen = {}

    def model_fn(x, t):
        seen["x"], seen["t"] = x, t
        return torch.cat([x * 0.5, x], dim=1)

    losses = FlowObjective().training_losses(model_fn, x1, tau, eps)
    xt = tau.view(3, 1, 1, 1) * x1 + (1 - tau.view(3, 1, 1, 1)) * eps
    torch.testing.assert_close(seen["x"], xt)
    assert torch.equal(seen["t"], tau)
    expected = ((0.5 * xt - (x1 - eps)) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(losses["loss"], expected)
    # REPA's convention: the network gets 1 - tau and answers eps - x1; the same loss for the mirrored network.
    repa = FlowObjective(convention="repa").training_losses(lambda x, t: -model_fn(x, 1 - t), x1, tau, eps)
    torch.testing.assert_close(repa["loss"], expected)
    assert torch.allclose(seen["t"], 1 - (1 - tau))


def test_cosine_loss_term():
    """LightningDiT's 1 - cos(v_hat, v) over channels, added with its weight; zero for a perfect direction."""
    x1, eps = torch.ones(1, 2, 1, 1), torch.zeros(1, 2, 1, 1)
    tau = torch.tensor([0.5])
    losses = FlowObjective(cos_weight=1.0).training_losses(lambda x, t: torch.cat([3 * x, x], 1), x1, tau, eps)
    assert losses["cos"].item() == pytest.approx(0.0, abs=1e-6)  # 3 x_t points along x1 - eps = (1, 1)
    opposite = FlowObjective(cos_weight=2.0).training_losses(lambda x, t: torch.cat([-x, x], 1), x1, tau, eps)
    assert opposite["cos"].item() == pytest.approx(2.0) and opposite["loss"].item() == pytest.approx(
        opposite["mse"].item() + 4.0)


@pytest.mark.parametrize("sampler,steps,tol", [("euler", 200, 0.02), ("heun", 25, 0.01), ("sde", 250, 0.03),
                                                ("dopri5", 1, 0.01)])
@pytest.mark.parametrize("convention", ["sit", "repa"])
def test_samplers_recover_gaussian_data(sampler, steps, tol, convention):
    """With the exact velocity every flow sampler lands on N(MU, S^2) (16,000 coordinates)."""
    objective = FlowObjective(convention=convention)
    noise = torch.randn(4000, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    x = run_sampler(objective, sampler, oracle_model(convention), noise, steps, {},
                    generator=torch.Generator().manual_seed(1))
    assert x.mean().item() == pytest.approx(MU, abs=0.02)
    assert x.std().item() == pytest.approx(S, rel=tol + 0.02)


def test_euler_and_sde_follow_the_written_recurrences():
    """Euler: x += dt v. SDE (SiT, w = 1 - tau): N - 1 Euler-Maruyama steps on linspace(0, 1 - h, N), then
    x + h (v + w score) at 1 - h, score = (tau v - x) / (1 - tau); increments from the generator in order."""
    noise = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(2))
    model = oracle_model()
    x = noise.clone()
    for a, b in zip(torch.linspace(0, 1, 6).tolist()[:-1], torch.linspace(0, 1, 6).tolist()[1:]):
        x = x + (b - a) * oracle_velocity(x, torch.full((3,), a))
    torch.testing.assert_close(run_sampler(FlowObjective(), "euler", model, noise, 5, {}), x)

    n, h = 6, 0.04
    grid = torch.linspace(0, 1 - h, n, dtype=torch.float64).tolist()
    g = torch.Generator().manual_seed(5)
    x = noise.clone()
    for a, b in zip(grid[:-1], grid[1:]):
        tau = torch.full((3,), a)
        v = oracle_velocity(x, tau)
        score = (a * v - x) / (1 - a)
        x = x + (v + (1 - a) * score) * (b - a) + math.sqrt(2 * (1 - a) * (b - a)) * torch.randn(
            x.shape, generator=g)
    v = oracle_velocity(x, torch.full((3,), grid[-1]))
    x = x + (v + (1 - grid[-1]) * (grid[-1] * v - x) / (1 - grid[-1])) * h
    ours = run_sampler(FlowObjective(), "sde", model, noise, n, {}, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-6)


def test_time_shift_grid_and_the_model_sees_it():
    """LightningDiT's tau' = s tau / (1 + (s - 1) tau): identity at s = 1; s = 0.3 crowds steps near noise."""
    assert torch.equal(flow_grid(4), torch.linspace(0, 1, 5, dtype=torch.float64))
    tau = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(shift_time(tau, 0.3), torch.tensor([0.0, 0.15 / 0.65, 1.0], dtype=torch.float64))
    seen = []
    run_sampler(FlowObjective(), "euler", lambda x, t: (seen.append(float(t[0])), torch.zeros_like(x))[1],
                torch.zeros(1, 1, 1, 1), 4, {"time_shift": 0.3})
    assert seen == pytest.approx(shift_time(torch.linspace(0, 1, 5, dtype=torch.float64), 0.3)[:-1].tolist())
    assert sampler_options("euler", {})["time_shift"] == 1.0
    with pytest.raises(SettingError, match="does not take"):
        sampler_options("ddim", {"time_shift": 0.3})


def test_time_draws_are_keyed_by_the_generator():
    """uniform: torch.rand; lognormal: sigmoid(loc + scale N(0, 1)); the same generator state, the same time."""
    a = draw_time(torch.Generator().manual_seed(9), "uniform")
    assert torch.equal(a, torch.rand(1, generator=torch.Generator().manual_seed(9)))
    b = draw_time(torch.Generator().manual_seed(9), "lognormal", 0.5, 2.0)
    assert torch.allclose(b, torch.sigmoid(0.5 + 2.0 * torch.randn(1, generator=torch.Generator().manual_seed(9))))
    many = torch.cat([draw_time(torch.Generator().manual_seed(i), "lognormal") for i in range(2000)])
    assert 0.45 < many.median().item() < 0.55 and many.min() > 0 and many.max() < 1
    ddpm = DDPMObjective().draw_time(torch.Generator().manual_seed(3))  # DiT's draw, unchanged
    assert torch.equal(ddpm, torch.randint(0, 1000, (1,), generator=torch.Generator().manual_seed(3)))


def test_objective_settings_refused_where_they_cannot_apply():
    with pytest.raises(SettingError, match="applies to the flow objective only"):
        make_objective("ddpm", time_sampling="lognormal")
    assert isinstance(make_objective("ddpm", time_sampling="uniform", cos_weight=0.0), DDPMObjective)
    repa = ModelConfig("DiT-T/2", 8, objective="flow", objective_args={"convention": "repa"})
    assert objective_of(repa).path.convention == "repa"
    old = {"model": "DiT-T/2", "input_size": 8, "objective": "flow", "flow_convention": "repa"}  # an earlier form
    with pytest.raises(UserError, match=r"unknown keys \['flow_convention'\].*Re-export"):
        ModelConfig.from_dict(old)
    with pytest.raises(SettingError, match="records only nothing"):
        ModelConfig("DiT-T/2", 8, objective_args={"convention": "repa"})  # ddpm records no convention


class _Tiny(torch.nn.Module):
    """Stands in for a DiT in guidance tests: output = x * (1 + label), so cond and null rows differ."""

    in_channels, null_label = 2, 5

    def __init__(self):
        super().__init__()
        self.y_embedder = type("E", (), {"has_null": True})()

    def forward(self, x, t, y):
        scale = (1 + y.float()).view(-1, 1, 1, 1)
        return torch.cat([x * scale, x], dim=1)


@pytest.mark.parametrize("objective,interval,expected_guided", [
    (DDPMObjective(), (0, 500), "t <= 500"), (FlowObjective(), (0.0, 0.7), "sigma <= 0.7")])
def test_guidance_interval_guides_inside_and_saves_calls_outside(objective, interval, expected_guided):
    """Guided steps are exactly those whose noise level lies in [lo, hi]; the others cost N rows, not 2N."""
    fn = GuidedModelFn(_Tiny(), 4.0, None, "fp32", interval, objective.noise_level)
    levels = []
    real = fn.__call__

    def spy(x, t, y):
        levels.append(float(objective.noise_level(t)[0]))
        return real(x, t, y)

    steps = 10
    sampler = "ddim" if isinstance(objective, DDPMObjective) else "euler"
    run_sampler(objective, sampler, spy, torch.ones(2, 2, 1, 1), steps, {}, model_kwargs=dict(y=torch.tensor([0, 1])))
    inside = [lo for lo in levels if interval[0] <= lo <= interval[1]]
    assert 0 < len(inside) < steps
    assert fn.calls == {"guided": len(inside), "conditional": steps - len(inside)}
    assert fn.rows == 2 * (2 * len(inside)) + 2 * (steps - len(inside))
    x, y = torch.ones(2, 2, 1, 1), torch.tensor([0, 1])
    outside_t = torch.full((2,), 900) if isinstance(objective, DDPMObjective) else torch.full((2,), 0.1)
    torch.testing.assert_close(fn(x, outside_t, y), _Tiny()(x, outside_t, y))  # conditional only


# --------------------------------------------------------------------------------------------------
# Through the real commands: train a flow model, sample it with no flags, the refusals
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """A tiny flow-matching run (logit-normal times, cosine loss) trained by python -m train."""
    from tests.helpers import make_latents, run_inprocess

    root = tmp_path_factory.mktemp("flow")
    latents = make_latents(root / "lat")
    run = run_inprocess(latents, root / "run", "--objective", "flow", "--time-sampling", "lognormal", "--cos-weight",
                        "1", "--max-steps", "12", "--lr", "2e-3", "--ckpt-every", "6", "--sample-every", "12",
                        "--sample-steps", "3")
    return {"latents": latents, "run": run}


def test_flow_training_records_its_objective(flow_run):
    """The loss falls; config, checkpoint and export all say flow; previews come from the Euler sampler."""
    import json

    from shared.weights.export import read_config
    from tests.helpers import metrics

    run = flow_run["run"]
    losses = [m["loss"] for m in metrics(run)]
    assert all(math.isfinite(v) for v in losses) and sum(losses[-3:]) < sum(losses[:3])
    assert json.loads((run / "config.json").read_text())["objective"] == "flow"
    export = sorted((run / "exports").glob("*.safetensors"))[-1]
    assert read_config(export).objective == "flow"
    assert read_config(export).objective_args == {"convention": "sit", "time_dist_shift": 1.0}
    assert (run / "samples" / "step-0000012.safetensors").is_file()
    # A velocity network learns no variance: C output channels, recorded as such.
    assert read_config(export).learn_sigma is False and read_config(export).build().out_channels == 4


def test_a_flow_run_of_the_old_2c_layout_resumes_with_it(tmp_path, monkeypatch):
    """Flow runs started when flow models were built with DiT's 2C outputs (learn_sigma true) keep that layout."""
    import train.config
    from shared.weights.export import read_config
    from tests.helpers import make_latents, run_inprocess

    latents = make_latents(tmp_path / "lat")
    argv = ["--objective", "flow", "--ckpt-every", "2", "--sample-every", "0"]
    with monkeypatch.context() as old:
        old.setattr(train.config, "learns_sigma", lambda name: True)  # the old rule, for the first two steps
        run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", *argv)
    assert read_config(run / "exports" / "ema-step-0000002.safetensors").learn_sigma is True
    run_inprocess(latents, run, "--max-steps", "4", *argv)  # resumed with today's rule
    resumed = read_config(run / "exports" / "ema-step-0000004.safetensors")
    assert resumed.learn_sigma is True and resumed.build().out_channels == 8


def test_flow_resume_with_another_objective_is_refused(flow_run, capsys):
    from tests.helpers import expect_user_error, train_args

    err = expect_user_error(capsys, train_args(flow_run["latents"], flow_run["run"], "--max-steps", "14"))
    assert "objective: 'flow' -> 'ddpm'" in err and "Rerun with the original settings" in err
    err = expect_user_error(capsys, train_args(flow_run["latents"], flow_run["run"].parent / "other",
                                               "--time-sampling", "lognormal"))
    assert "--time-sampling lognormal applies to the flow objective only" in err and "--objective flow" in err


@pytest.fixture(scope="module")
def flow_export(tmp_path_factory, tiny_vae_dir):
    """A flow-objective export whose latents metadata names the tiny test VAE (so sample can decode)."""
    from shared.weights.export import save_weights
    from shared.tokenizers.locate import load_tokenizer
    from tests.helpers import random_dit as _random_dit, space_of

    config = ModelConfig("DiT-T/2", input_size=8, num_classes=10, objective="flow")
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8], "vae": vae.identity,
            "class_names": [str(c) for c in range(10)]}
    path = tmp_path_factory.mktemp("flowexp") / "run" / "exports" / "ema-step-0000010.safetensors"
    save_weights(path, _random_dit(config).state_dict(), config, space_of(meta), 10)
    return path


def test_flow_export_samples_with_its_own_sampler_and_no_flags(flow_export, tmp_path, capsys):
    """No --sampler: the objective's SDE; the settings record it; the guidance interval is applied and said."""
    import json

    from tests.helpers import pngs, run_sample as run_cli

    out = tmp_path / "o"
    code, err = run_cli(["--ckpt", flow_export, "--num-samples", "3", "--num-sampling-steps", "4", "--cpu", "--out",
                         out, "--cfg-interval", "0", "0.7"], capsys)
    assert code == 0, err
    settings = json.loads((out / "settings.json").read_text())
    assert settings["identity"]["sampler"] == "sde" and settings["identity"]["last_step_size"] == 0.04
    assert settings["identity"]["cfg_interval"] == [0.0, 0.7]
    assert "at noise levels 0 to 0.7" in settings["run"]["guidance"]
    assert len(pngs(out)) == 3
    code, err = run_cli(["--ckpt", flow_export, "--num-samples", "2", "--num-sampling-steps", "3", "--cpu",
                         "--sampler", "heun", "--time-shift", "0.3", "--out", tmp_path / "h"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("extra,message", [
    (("--sampler", "ddpm"), "--sampler ddpm samples ddpm models, but these weights were trained with the flow "
                            "objective (recorded with the model); use one of its samplers: euler, heun, sde, dopri5"),
    (("--cfg-interval", "0", "300"), "--cfg-interval 0 300 is not a range inside [0, 1], the noise levels of a flow "
                                     "model"),
    (("--sampler", "euler", "--last-step-size", "0.1"), "which the euler sampler does not take (only sde)"),
    (("--cfg-interval", "0", "0.5", "--cfg-scale", "1"), "but --cfg-scale is 1 (no guidance)"),
])
def test_flow_sampling_refusals_write_nothing(flow_export, tmp_path, capsys, extra, message):
    from tests.helpers import run_sample as run_cli

    out = tmp_path / "o"
    code, err = run_cli(["--ckpt", flow_export, "--num-samples", "2", "--cpu", "--out", out, *extra], capsys)
    assert code == 2 and message in err, err
    assert not out.exists()


def test_flow_export_to_diffusers_is_refused(flow_export, tmp_path, capsys):
    from tests.helpers import run_sample as run_cli

    code, err = run_cli(["export", flow_export, tmp_path / "pipe"], capsys)
    assert code == 2 and "trained with the flow objective" in err and "cannot be exported as a DiTPipeline" in err
    assert not (tmp_path / "pipe").exists()


def test_ddpm_export_refuses_an_interval_outside_dit_timesteps(tmp_path, capsys, tiny_vae_dir):
    """A DDPM model's noise levels are DiT timesteps in [0, 1000]: 0 2000 is refused, 0 500 accepted."""
    from shared.weights.export import save_weights
    from shared.tokenizers.locate import load_tokenizer
    from tests.helpers import random_dit as _random_dit, run_sample as run_cli, space_of

    config = ModelConfig("DiT-T/2", input_size=8, num_classes=10)
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8], "vae": vae.identity}
    path = tmp_path / "ema.safetensors"
    save_weights(path, _random_dit(config).state_dict(), config, space_of(meta), 1)
    code, err = run_cli(["--ckpt", path, "--num-samples", "1", "--cpu", "--out", tmp_path / "o", "--cfg-interval",
                         "0", "2000"], capsys)
    assert code == 2 and "is not a range inside [0, 1000], the noise levels of a ddpm model (DiT timesteps" in err
    assert not (tmp_path / "o").exists()
    code, err = run_cli(["--ckpt", path, "--num-samples", "1", "--cpu", "--out", tmp_path / "ok", "--sampler", "ddim",
                         "--num-sampling-steps", "4", "--cfg-interval", "0", "500"], capsys)
    assert code == 0, err


# --------------------------------------------------------------------------------------------------
# --recipe: one word, every explicit flag wins
# --------------------------------------------------------------------------------------------------

def _dry_run(latents, run, capsys, *extra) -> dict:
    """The resolved config `python -m train --dry-run` prints."""
    import json

    from tests.helpers import train_args
    from train.__main__ import main

    assert main(train_args(latents, run, "--dry-run", *extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_recipes_set_their_settings_and_explicit_flags_win(latents, tmp_path, capsys):
    dit = _dry_run(latents, tmp_path / "a", capsys)
    assert (dit["recipe"], dit["objective"], dit["block"], dit["lr"], dit["adam_betas"]) == (
        "dit", "ddpm", "dit", 1e-4, [0.9, 0.999])
    sit = _dry_run(latents, tmp_path / "b", capsys, "--recipe", "sit")
    assert (sit["objective"], sit["objective_options"]["time_sampling"], sit["block"], sit["lr"]) == (
        "flow", "uniform", "dit", 1e-4)
    light = _dry_run(latents, tmp_path / "c", capsys, "--recipe", "lightning")
    light_objective = light["objective_options"]
    assert (light["objective"], light_objective["time_sampling"], light_objective["cos_weight"], light["lr"],
            light["adam_betas"]) == (
        "flow", "lognormal", 1.0, 2e-4, [0.9, 0.95])
    assert (light["block"], light["norm"], light["mlp"], light["rope"], light["qk_norm"]) == (
        "lightning", "rmsnorm", "swiglu", True, False)
    mixed = _dry_run(latents, tmp_path / "d", capsys, "--recipe", "lightning", "--lr", "1e-4", "--no-rope",
                     "--adam-betas", "0.9", "0.99", "--time-sampling", "uniform")
    assert (mixed["lr"], mixed["rope"], mixed["adam_betas"], mixed["objective_options"]["time_sampling"]) == (
        1e-4, False, [0.9, 0.99], "uniform")
    assert (mixed["norm"], mixed["objective_options"]["cos_weight"], mixed["objective"]) == ("rmsnorm", 1.0, "flow")  # the rest: recipe's
    assert not (tmp_path / "d").exists()
