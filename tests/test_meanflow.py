"""MeanFlow (issue 37): the loss against an independent float64 computation, exact one-step samples of an analytic
field, the samplers' refusals, --init-from a flow model (exact at the start, refusals), and bitwise resume."""
import json
import math

import pytest
import torch

from shared.generative.meanflow import average_velocity, meanflow_losses
from shared.generative.objectives import make_objective, run_sampler
from shared.network.models import ModelConfig
from shared.runtime.errors import SettingError
from tests.helpers import (cli, space_of, expect_user_error, final_tensors, finish, make_latents, metrics, killed_and_resumed,
                           random_dit, run_inprocess, train_args)


def _config(convention="sit", **kw) -> ModelConfig:
    """DiT-T/2 on 4x8x8 latents with MeanFlow's interval embedder."""
    return ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="meanflow", interval_time=True,
                       objective_args={"convention": convention}, **kw)


def _random_model(config, seed=0):
    """A float64 tiny DiT with every weight perturbed (so the time and interval inputs matter), in train mode."""
    return random_dit(config, seed).double().train()


# ----------------------------------------------------------------------------------------------------------
# The loss, independently: the paper's time and sign, a finite-difference du/dt, float64
# ----------------------------------------------------------------------------------------------------------

def _paper_loss(model, convention, x, eps, tau, h, y, drop, omega, kappa, levels, p, c, delta=1e-6):
    """Alg. 1 of the paper written out in its own time t (1 = noise), its sign (v = eps - x), with du/dt by a
    central difference along (dz, dr, dt) = (v_g, 0, 1); per-sample adaptively weighted loss (N,)."""
    t, r = 1 - tau, 1 - tau - h  # paper times, r <= t
    n = x.shape[0]

    def u(z, r_, t_, labels_dropped):
        """The network's average velocity in the paper's sign: the REPA convention is the paper's own."""
        times = torch.stack([t_ if convention == "repa" else 1 - t_, t_ - r_], dim=1)
        out = model(z, times, y, force_drop_ids=labels_dropped)[:, :4]
        return out if convention == "repa" else -out

    b = t.view(-1, 1, 1, 1)
    z = (1 - b) * x + b * eps
    v = eps - x
    inside = ((t >= levels[0]) & (t <= levels[1]) & ~drop).view(-1, 1, 1, 1)
    u_null = u(z, t, t, torch.ones(n, dtype=torch.bool))
    u_cond = u(z, t, t, torch.zeros(n, dtype=torch.bool))
    v_g = torch.where(inside, omega * v + kappa * u_cond + (1 - omega - kappa) * u_null, v)
    du_dt = (u(z + delta * v_g, r, t + delta, drop) - u(z - delta * v_g, r, t - delta, drop)) / (2 * delta)
    target = v_g - (t - r).view(-1, 1, 1, 1) * du_dt
    sq = ((u(z, r, t, drop) - target) ** 2).flatten(1).sum(1)
    return sq / (sq + c) ** p


def _float64_features(t, dim, max_period=10000):
    """DiT's sinusoidal time features in float64 (the model's own are fp32 on purpose, as the official checkpoints
    were trained with them; a finite difference in t of 1e-6 needs float64 all the way through)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / half)
    args = t[:, None].double() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


@pytest.mark.parametrize("convention", ["sit", "repa"])
@pytest.mark.parametrize("omega, kappa", [(1.0, 0.0), (0.6, 0.3), (0.4, 0.0)])
def test_the_loss_matches_an_independent_float64_computation(convention, omega, kappa, monkeypatch):
    from shared.network.dit import TimestepEmbedder

    monkeypatch.setattr(TimestepEmbedder, "timestep_embedding", staticmethod(_float64_features))
    torch.manual_seed(0)
    model = _random_model(_config(convention))
    n = 6
    x, eps = torch.randn(n, 4, 8, 8, dtype=torch.float64), torch.randn(n, 4, 8, 8, dtype=torch.float64)
    tau = torch.tensor([0.1, 0.35, 0.5, 0.62, 0.8, 0.3], dtype=torch.float64)
    h = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.15, 0.7], dtype=torch.float64)  # row 1: r = t
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    drop = torch.tensor([False, False, True, False, False, False])  # row 2: its label dropped, unguided
    levels, p, c = (0.25, 0.85), 0.75, 1e-3  # row 0 (t = 0.9) lies outside the guidance levels
    ours = meanflow_losses(make_objective("meanflow", {"convention": convention}).path, model, x,
                           torch.stack([tau, h], 1), eps, {"y": y, "force_drop_ids": drop}, omega=omega,
                           kappa=kappa, levels=levels, p=p, c=c)["loss"]
    theirs = _paper_loss(model, convention, x, eps, tau, h, y, drop, omega, kappa, levels, p, c)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=0)
    assert ours.dtype == torch.float64  # a float64 network's output stays float64 through the loss


def test_the_loss_is_the_same_with_checkpointing_autocast_and_the_objective_entry_point():
    torch.manual_seed(1)
    config = _config()
    model = random_dit(config, 3).train()
    objective = make_objective("meanflow", cfg_omega=0.5, cfg_kappa=0.2)
    g = torch.Generator().manual_seed(0)
    t = torch.cat([objective.draw_time(g) for _ in range(8)])
    assert t.shape == (8, 2) and (t[:, 1] >= 0).all() and (t.sum(1) <= 1 + 1e-6).all()
    x, eps = torch.randn(8, 4, 8, 8), torch.randn(8, 4, 8, 8)
    kwargs = {"y": torch.arange(8) % 3, "force_drop_ids": torch.arange(8) % 4 == 0}

    def grads(every):
        model.zero_grad()
        model.set_grad_checkpointing(every)
        loss = objective.training_losses(model, x, t, eps, kwargs)["loss"].mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (plain, g0), (checkpointed, g1) = grads(0), grads(1)
    assert torch.equal(plain, checkpointed) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the JVP under autocast, SDPA's math kernel
        mixed = objective.training_losses(model, x, t, eps, kwargs)["loss"].mean().detach()
    assert torch.isfinite(mixed) and abs(float(mixed) - float(plain)) < 0.05


def test_training_draws_follow_the_paper_sampler():
    objective = make_objective("meanflow", interval_fraction=0.25)
    g = torch.Generator().manual_seed(0)
    pairs = torch.cat([objective.draw_time(g) for _ in range(4000)])
    share = float((pairs[:, 1] > 0).float().mean())
    assert abs(share - 0.25) < 0.03  # the share with r != t
    t = 1 - pairs[:, 0]  # the paper's t = sigmoid(N(-0.4, 1)) maxed with another draw: median above sigmoid(-0.4)
    assert 0.4 < float(t.median()) < 0.75 and float(t.min()) > 0 and float(t.max()) < 1


# ----------------------------------------------------------------------------------------------------------
# Sampling an exact field: Gaussian data, whose flow is affine and whose average velocity is known in closed form
# ----------------------------------------------------------------------------------------------------------

MU, S = 1.5, 0.3  # data x1 ~ N(MU, S^2) per element, noise eps ~ N(0, 1)


def _m(tau):
    return tau * MU


def _sd(tau):
    return torch.sqrt(tau ** 2 * S ** 2 + (1 - tau) ** 2)


def _gaussian_average(x, pair, convention="sit"):
    """The exact average velocity over [tau, tau + h] of the linear path for Gaussian data, in the network's
    convention: the flow keeps (x - m(tau)) / sd(tau), so x_b = m(b) + sd(b) / sd(a) (x - m(a))."""
    first, h = pair[:, 0].double(), pair[:, 1].double()
    a = first if convention == "sit" else 1 - first
    b = a + h
    view = (-1, 1, 1, 1)
    x = x.double()
    ma, mb, sa, sb = (_m(a).view(view), _m(b).view(view), _sd(a).view(view), _sd(b).view(view))
    safe = torch.where(h > 0, h, torch.ones_like(h)).view(view)
    jump = (mb + sb / sa * (x - ma) - x) / safe
    velocity = MU + (a * S ** 2 - (1 - a)).view(view) / sa ** 2 * (x - ma)  # d/dtau of the flow at h = 0
    ubar = torch.where((h > 0).view(view), jump, velocity)
    return ubar if convention == "sit" else -ubar


@pytest.mark.parametrize("convention", ["sit", "repa"])
def test_one_step_of_the_exact_average_velocity_lands_on_the_ode_endpoint(convention):
    noise = torch.randn(5, 4, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    objective = make_objective("meanflow", {"convention": convention})
    exact = MU + S * noise  # the ODE's endpoint from tau = 0: m(1) + sd(1) / sd(0) (noise - m(0))
    for steps, options in ((1, {}), (2, {}), (5, {"time_shift": 0.3})):
        x = run_sampler(objective, "meanflow", lambda x, t, **_: _gaussian_average(x, t, convention), noise, steps,
                        options)
        assert float((x - exact).abs().max()) < 1e-5, (steps, options)


def test_the_exact_average_velocity_satisfies_the_identity_the_loss_trains():
    """u = v + h du/dtau (the MeanFlow identity in SiT time) holds for the closed form, through our JVP."""
    from shared.generative.flow import FlowPath
    from shared.generative.meanflow import average_and_derivative

    x = torch.randn(3, 4, 8, 8, dtype=torch.float64)
    tau = torch.tensor([0.1, 0.4, 0.7], dtype=torch.float64)
    h = torch.tensor([0.8, 0.3, 0.2], dtype=torch.float64)
    field = lambda x_, t_, **_: _gaussian_average(x_, t_)  # noqa: E731
    v = average_velocity(FlowPath("sit"), field, x, tau, torch.zeros_like(h), {})
    u, du = average_and_derivative(FlowPath("sit"), field, x, tau, h, v.double(), {})
    torch.testing.assert_close(u.double(), (v + h.view(-1, 1, 1, 1) * du).double(), rtol=1e-9, atol=1e-9)


def test_flow_and_meanflow_samplers_refuse_each_others_models():
    flow, meanflow = make_objective("flow"), make_objective("meanflow")
    noise = torch.randn(1, 4, 8, 8)
    with pytest.raises(SettingError, match="samples flow models.*meanflow objective.*use one of its samplers: meanflow"):
        run_sampler(meanflow, "euler", lambda x, t: x, noise, 2, {})
    with pytest.raises(SettingError, match="samples meanflow models.*flow objective"):
        run_sampler(flow, "meanflow", lambda x, t: x, noise, 2, {})
    folded = make_objective("meanflow", {"folded_guidance": [0.2, 0.92, 0.0, 0.75]})
    with pytest.raises(SettingError, match="effective scale 2.5.*pass .*cfg scale.* 1"):
        folded.check_cfg_scale(4.0)
    folded.check_cfg_scale(1.0)
    make_objective("meanflow").check_cfg_scale(4.0)  # trained without guidance: sampling may guide


def test_the_interval_embedder_exists_only_when_the_config_asks():
    plain = ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="flow")
    assert not any(k.startswith("h_embedder") for k in plain.build().state_dict())
    assert {k for k in _config().build().state_dict() if k.startswith("h_embedder")} == {
        "h_embedder.mlp.0.weight", "h_embedder.mlp.0.bias", "h_embedder.mlp.2.weight", "h_embedder.mlp.2.bias"}
    with pytest.raises(SettingError, match="interval time embedder"):
        ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="meanflow")
    with pytest.raises(SettingError, match="DiT\\^DH head"):
        ModelConfig(model="DiTDH-T", input_size=8, in_channels=4, num_classes=3, objective="meanflow",
                    interval_time=True, learn_sigma=False)


# ----------------------------------------------------------------------------------------------------------
# --init-from a flow model
# ----------------------------------------------------------------------------------------------------------

def test_a_flow_network_loaded_into_meanflow_gives_its_velocity_exactly():
    from train.init_from import InitWeights, apply_init

    flow = random_dit(ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="flow"), 5).eval()
    meanflow = _config().build().eval()
    ema = _config().build().eval()
    apply_init(meanflow, ema, InitWeights(flow.state_dict(), {"from": "test"}))
    x, y = torch.randn(4, 4, 8, 8), torch.tensor([0, 1, 2, 3])
    tau = torch.tensor([0.0, 0.3, 0.6, 0.95])
    with torch.no_grad():
        velocity = flow(x, tau, y)
        for h in (torch.zeros(4), torch.tensor([1.0, 0.7, 0.2, 0.05])):  # r = t, and any interval
            assert torch.equal(meanflow(x, torch.stack([tau, h], 1), y), velocity)
            assert torch.equal(ema(x, torch.stack([tau, h], 1), y), velocity)


def test_a_2c_flow_release_gives_its_velocity_to_a_c_channel_meanflow_network():
    """SiT's release layout (2C outputs, the velocity in the first C) into a MeanFlow run's C-channel network."""
    import dataclasses

    from train.init_from import InitWeights, apply_init, velocity_outputs

    source = ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="flow", learn_sigma=True)
    flow = random_dit(source, 6).eval()
    target = dataclasses.replace(_config(), learn_sigma=False)
    meanflow, ema = target.build().eval(), target.build().eval()
    apply_init(meanflow, ema, InitWeights(velocity_outputs(flow.state_dict(), source), {"from": "test"}))
    x, y, tau = torch.randn(3, 4, 8, 8), torch.tensor([0, 1, 2]), torch.tensor([0.1, 0.5, 0.9])
    with torch.no_grad():
        velocity = flow(x, tau, y)[:, :4]  # (N, C, H, W): the first C of 2C
        # equal up to the matrix product's blocking over C rows instead of 2C (bitwise on this CPU's BLAS)
        torch.testing.assert_close(meanflow(x, torch.stack([tau, torch.zeros(3)], 1), y), velocity, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def runs(latents, tmp_path_factory):
    """A 2-step flow run and a 2-step DDPM run on the shared tiny latents."""
    root = tmp_path_factory.mktemp("sources")
    flow = run_inprocess(latents, root / "flow", "--recipe", "sit", "--max-steps", "2", "--ckpt-every", "2")
    ddpm = run_inprocess(latents, root / "ddpm", "--max-steps", "1", "--ckpt-every", "1")
    return flow, ddpm


def test_init_from_a_flow_run_fine_tunes_and_records_where_it_started(latents, runs, tmp_path):
    flow, _ = runs
    run = run_inprocess(latents, tmp_path / "mf", "--recipe", "meanflow", "--init-from", str(flow),
                        "--max-steps", "1", "--ckpt-every", "1")
    init = json.loads((run / "config.json").read_text())["init"]
    assert init["objective"] == "flow" and init["step"] == 2 and init["from"] == str(flow)
    assert init["file"].endswith("ema-step-0000002.safetensors") and init["convention"] == "sit"
    assert math.isfinite(metrics(run)[-1]["loss"])
    run_inprocess(latents, run, "--recipe", "meanflow", "--init-from", str(flow), "--max-steps", "2",
                  "--ckpt-every", "1")  # the rerun resumes its own checkpoint and keeps the record
    log = (run / "log.txt").read_text()
    assert "resumed from" in log and "init:" not in log
    assert json.loads((run / "config.json").read_text())["init"] == init


def test_init_from_refusals_write_nothing(latents, runs, tmp_path, capsys):
    flow, ddpm = runs
    target = tmp_path / "mf"
    message = expect_user_error(capsys, train_args(latents, target, "--recipe", "meanflow", "--init-from", str(ddpm)))
    assert "DDPM (epsilon-prediction) model" in message and "Start from a flow model" in message
    other = make_latents(tmp_path / "other", shape=(4, 8, 8), image_size=16)
    message = expect_user_error(capsys, train_args(other, target, "--recipe", "meanflow", "--init-from", str(flow)))
    assert "another latent space" in message and "(4, 4, 4)" in message
    message = expect_user_error(capsys, train_args(latents, target, "--init-from", str(flow)))
    assert "this run trains the ddpm objective" in message
    message = expect_user_error(capsys, train_args(latents, target, "--recipe", "meanflow", "--model", "DiTDH-T"))
    assert "DiT^DH head" in message
    message = expect_user_error(capsys, train_args(latents, target, "--recipe", "meanflow", "--compile"))
    assert "--compile cannot train the meanflow objective" in message
    assert not list(target.glob("*.json")) and not (target / "checkpoints").exists()


def test_init_from_release_layouts_keeps_their_convention(latents, tmp_path, capsys):
    """Bare state dicts as the releases ship them: SiT's by its file name (flow, time 0 = noise), REPA's by its
    projector tensors (flow in REPA's time, kept by the MeanFlow model); an unknown bare file reads as DDPM."""
    from shared.network.repa import REPA_PROJECTOR_PREFIX

    flow = random_dit(ModelConfig(model="DiT-T/2", input_size=4, num_classes=4, objective="flow"), 7).state_dict()
    sit = tmp_path / "SiT-XL-2-256x256.pt"
    torch.save(flow, sit)
    repa = tmp_path / "repa-last.pt"
    torch.save({**flow, f"{REPA_PROJECTOR_PREFIX}0.0.weight": torch.zeros(2, 2)}, repa)
    for path, convention in ((sit, "sit"), (repa, "repa")):
        run = run_inprocess(latents, tmp_path / f"mf-{convention}", "--recipe", "meanflow", "--init-from", str(path),
                            "--max-steps", "1", "--ckpt-every", "1")
        init = json.loads((run / "config.json").read_text())["init"]
        assert (init["kind"], init["objective"], init["convention"]) == ("official", "flow", convention)
        from shared.weights.export import read_config
        from shared.runtime import rundir

        assert read_config(rundir.list_exports(run)[-1]).objective_args["convention"] == convention
    unknown = tmp_path / "mine.pt"
    torch.save(flow, unknown)
    message = expect_user_error(capsys, train_args(latents, tmp_path / "mf-x", "--recipe", "meanflow", "--init-from",
                                                   str(unknown)))
    assert "records no objective and is no known release" in message


def test_init_from_a_dit_dh_model_is_refused():
    from train.init_from import _check_objective

    head = ModelConfig(model="DiTDH-T", input_size=8, in_channels=4, num_classes=3, objective="flow", learn_sigma=False)
    with pytest.raises(Exception, match="DiT\\^DH model"):
        _check_objective("RUN", head)


# ----------------------------------------------------------------------------------------------------------
# Real processes: kill -9 and resume, bitwise
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_meanflow_run_resumes_bitwise(latents, tmp_path):
    flags = ["--recipe", "meanflow", "--max-steps", "4", "--ckpt-every", "2", "--keep-last", "1",
             "--num-workers", "1", "--class-dropout-prob", "0.5", "--interval-fraction", "0.5"]
    ref, resumed = killed_and_resumed(latents, tmp_path, flags)
    assert ref.keys() == resumed.keys() and "model.h_embedder.mlp.0.weight" in ref
    for key in ref:
        assert torch.equal(ref[key], resumed[key]), key


# ----------------------------------------------------------------------------------------------------------
# python -m sample and python -m evaluate run on a MeanFlow export: 1 call per image, refusals before drawing
# ----------------------------------------------------------------------------------------------------------

def _export(run, vae, folded):
    """RUN/exports/ema-step-0000010 of a random MeanFlow DiT-T/2 (16x16x4 latents, 32x32 images via the tiny VAE)."""
    from shared.runtime import rundir
    from shared.weights.export import save_weights

    args = {"folded_guidance": [0.2, 0.92, 0.0, 0.75]} if folded else {}
    config = ModelConfig("DiT-T/2", input_size=16, in_channels=4, num_classes=10, objective="meanflow",
                         interval_time=True, objective_args=args, sampling={"sampler": "meanflow"})
    meta = {"image_size": 32, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 16, 16],
            "vae": vae.identity, "class_names": [str(c) for c in range(10)]}
    save_weights(rundir.export_path(run, 10), random_dit(config, 1).state_dict(), config, space_of(meta), 10)


@pytest.mark.usefixtures("private_digits_cache")
def test_sample_and_evaluate_run_draw_meanflow_exports_in_one_call(tiny_vae_dir, tmp_path, capsys):
    from evaluate.__main__ import main as evaluate_main
    from shared.runtime import rundir
    from shared.tokenizers.locate import load_tokenizer
    from tests.helpers import run_main, run_sample

    vae = load_tokenizer(tiny_vae_dir)
    run = tmp_path / "run"
    _export(run, vae, folded=True)
    out = tmp_path / "one"
    common = ["--ckpt", run, "--vae", tiny_vae_dir, "--num-samples", 3, "--cpu"]
    code, err = run_sample([*common, "--num-sampling-steps", 1, "--out", out], capsys)  # the default cfg scale 4
    assert code == 2 and "learned the guided field" in err and "pass --cfg-scale 1" in err and not out.exists()
    code, err = run_sample([*common, "--num-sampling-steps", 1, "--cfg-scale", 1, "--sampler", "euler",
                            "--out", out], capsys)
    assert code == 2 and "--sampler euler samples flow models" in err and not out.exists()
    code, err = run_sample([*common, "--num-sampling-steps", 1, "--cfg-scale", 1, "--out", out], capsys)
    assert code == 0, err
    settings = json.loads((out / "settings.json").read_text())["identity"]
    assert settings["sampler"] == "meanflow" and settings["num_sampling_steps"] == 1
    assert len(list(out.glob("0*.png"))) == 3

    code, _, err = run_main(evaluate_main, ["run", run, "--vae", tiny_vae_dir, "--features", "digits",
                                            "--num-samples", 4, "--num-sampling-steps", 2, "--cfg-scale", 1,
                                            "--batch-size", 4, "--cpu"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in rundir.eval_path(run).read_text().splitlines()]
    assert rows[0]["sampler"] == "meanflow" and rows[0]["num_sampling_steps"] == 2 and rows[0]["fid"] > 0


def test_a_guided_sampler_call_counts_one_network_call_per_step():
    from shared.generative.guidance import GuidedModelFn

    model = random_dit(_config(), 2).eval()
    objective = make_objective("meanflow")
    for scale, rows in ((1.0, 4), (3.0, 8)):  # a model trained without folded guidance may still be guided
        fn = GuidedModelFn(model, scale, interval=(0.0, 1.0), noise_level=objective.noise_level)
        run_sampler(objective, "meanflow", fn, torch.randn(4, 4, 8, 8), 1, {}, model_kwargs={"y": torch.arange(4) % 3})
        assert fn.rows == rows  # one step: 4 rows, or 8 with sampling-time guidance


@pytest.mark.slow
def test_two_processes_match_one(latents, tmp_path):
    """The JVP and the guidance forwards go through the DDP wrapper without autograd; the step equals one process's."""
    from tests.helpers import CPU_DIST, TORCHRUN

    flags = ["--recipe", "meanflow", "--max-steps", "2", "--micro-batch-size", "2", "--lr", "1e-3",
             "--interval-fraction", "0.5"]
    one = run_inprocess(latents, tmp_path / "one", *flags)
    finish(cli(TORCHRUN + train_args(latents, tmp_path / "two", *flags), CPU_DIST))
    a, b = final_tensors(one), final_tensors(tmp_path / "two")
    for key in a:  # the same samples and draws (keyed by stream position); only float summation order differs
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=1e-5, msg=key)


def test_meanflow_trains_with_repa_and_token_routing(tmp_path):
    """REPA's tokens come from the forward the gradient flows through (the last of the step's network calls), and
    routed rows are duplicated with the guidance batch; both options train and log their parts."""
    from tests.test_repa import make_feature_latents
    from train.__main__ import main

    latents = make_feature_latents(tmp_path / "lat")
    run = tmp_path / "run"
    assert main(["--model", "DiT-T/2", "--latents", str(latents), "--results-dir", str(run), "--global-batch-size",
                 "4", "--num-workers", "0", "--sample-every", "0", "--log-every", "1", "--report-to", "none",
                 "--recipe", "meanflow", "--interval-fraction", "0.5", "--repa-weight", "0.5", "--repa-depth", "1",
                 "--repa-projector-dim", "32", "--route-ratio", "0.5", "--route-start", "1", "--route-end", "2",
                 "--max-steps", "2", "--ckpt-every", "2"]) == 0
    rows = metrics(run)
    assert len(rows) == 2 and all(math.isfinite(r["repa_loss"]) and math.isfinite(r["diffusion_loss"]) for r in rows)
