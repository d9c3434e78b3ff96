"""Improved MeanFlow (--objective imf): its loss against an independent float64 computation, its limits, the guidance
chosen at sampling, --init-from a flow model, and the refusals."""
import json
import math

import pytest
import torch

from shared.generative.imf import imf_losses
from shared.generative.objectives import make_objective, run_sampler
from shared.network.models import ModelConfig
from shared.runtime.errors import SettingError
from tests.helpers import expect_user_error, metrics, random_dit, run_inprocess, space_of, train_args


def _config(**kw) -> ModelConfig:
    """DiT-T/2 on 4x8x8 latents with the interval and guidance embedders."""
    return ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="imf", interval_time=True, learn_sigma=False,
                       guidance_inputs=True, **kw)


def _batch(n=6, seed=0):
    """Clean latents, noise, labels, label-drop coins and (N, 5) draws [tau, h, 1 - 1/w, t_min, t_max], float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 8, 8, generator=g, dtype=torch.float64)
    eps = torch.randn(n, 4, 8, 8, generator=g, dtype=torch.float64)
    y = torch.arange(n) % 3
    drop = torch.tensor([False] * (n - 1) + [True])
    tau = torch.rand(n, generator=g, dtype=torch.float64) * 0.8 + 0.1
    h = torch.where(torch.arange(n) % 3 == 0, torch.zeros(n, dtype=torch.float64), (1 - tau) * 0.7)
    w = 1 + 6 * torch.rand(n, generator=g, dtype=torch.float64)
    lo = torch.rand(n, generator=g, dtype=torch.float64) * 0.5
    hi = 0.5 + torch.rand(n, generator=g, dtype=torch.float64) * 0.5
    return x, eps, y, drop, torch.stack([tau, h, 1 - 1 / w, lo, hi], 1)


def _paper_sq(model, x, eps, y, drop, t, delta=1e-6):
    """Eq. 12 and the release's guidance_fn in the paper's own time and sign, du/dt by a central difference along
    (dz, dr, dt) = (v_c, 0, 1): ||V - v_g||^2 per sample (N,)."""
    tau, h, g, lo, hi = t.unbind(1)
    tt, r = 1 - tau, 1 - tau - h  # the paper's times, r <= t
    n = len(x)

    def u(z, r_, t_, cond, dropped):
        out = model(z, torch.stack([1 - t_, t_ - r_, *cond], 1), y, force_drop_ids=dropped)
        return -out  # SiT's sign -> the paper's (v = eps - x)

    b = tt.view(-1, 1, 1, 1)
    z = (1 - b) * x + b * eps
    v = eps - x
    g_in = torch.where((tt >= lo) & (tt <= hi), g, torch.zeros_like(g))
    zeros, ones = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    v_c = u(z, tt, tt, (g_in, zeros, ones), torch.zeros(n, dtype=torch.bool))
    v_u = u(z, tt, tt, (zeros, zeros, ones), torch.ones(n, dtype=torch.bool))
    v_g = torch.where(drop.view(-1, 1, 1, 1), v, v + g_in.view(-1, 1, 1, 1) * (v_c - v_u))
    cond = (g, lo, hi)
    du_dt = (u(z + delta * v_c, r, tt + delta, cond, drop) - u(z - delta * v_c, r, tt - delta, cond, drop)) / (2 * delta)
    big_v = u(z, r, tt, cond, drop) + (tt - r).view(-1, 1, 1, 1) * du_dt
    return ((big_v - v_g) ** 2).flatten(1).sum(1)


def test_the_loss_matches_an_independent_float64_computation(monkeypatch):
    from shared.network.dit import TimestepEmbedder
    from tests.test_meanflow import _float64_features

    monkeypatch.setattr(TimestepEmbedder, "timestep_embedding", staticmethod(_float64_features))
    model = random_dit(_config(), 3).double().train()
    objective = make_objective("imf")
    x, eps, y, drop, t = _batch()
    out = imf_losses(objective.path, model, x, t, eps, {"y": y, "force_drop_ids": drop}, p=0.0, c=0.01)
    expected = _paper_sq(model, x, eps, y, drop, t)
    torch.testing.assert_close(out["sq"], expected, rtol=1e-6, atol=1e-8)
    weighted = imf_losses(objective.path, model, x, t, eps, {"y": y, "force_drop_ids": drop}, p=1.0, c=0.01)
    torch.testing.assert_close(weighted["loss"], expected / (expected + 0.01), rtol=1e-6, atol=1e-8)


def test_at_r_equal_t_and_the_null_scale_it_is_flow_matching():
    """h = 0: no derivative term; 1 - 1/w = 0 (w = 1): the unguided target v, whatever the interval."""
    model = random_dit(_config(), 4).double().train()
    x, eps, y, drop, t = _batch()
    t[:, 1] = 0.0
    t[:, 2] = 0.0
    out = imf_losses(make_objective("imf").path, model, x, t, eps, {"y": y, "force_drop_ids": drop}, p=0.0, c=0.01)
    s = t[:, 0].view(-1, 1, 1, 1)
    with torch.no_grad():
        velocity = model(s * x + (1 - s) * eps, t.float().double(), y, force_drop_ids=drop)
    flow_matching = ((velocity - (x - eps)) ** 2).flatten(1).sum(1)  # SiT's loss: ||v_theta - (x1 - eps)||^2
    torch.testing.assert_close(out["sq"], flow_matching, rtol=1e-9, atol=1e-12)


def test_the_guidance_inputs_start_as_none_and_sampling_at_the_null_scale_feeds_none():
    model = _config().build().eval()
    x, y = torch.randn(3, 4, 8, 8), torch.tensor([0, 1, 2])
    times = torch.tensor([[0.3, 0.5], [0.6, 0.0], [0.9, 0.1]])
    with torch.no_grad():
        outs = [model(x, torch.cat([times, torch.tensor([[g, lo, hi]] * 3)], 1), y)
                for g, lo, hi in ((0.0, 0.0, 1.0), (0.75, 0.2, 0.7), (0.5, 0.5, 0.5))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # zero-initialised last linears
    seen = []

    def spy(x_, t_, **kw):
        seen.append(t_.clone())
        return model(x_, t_, **kw)
    run_sampler(make_objective("imf"), "meanflow", spy, torch.randn(3, 4, 8, 8), 2, {}, model_kwargs={"y": y})
    assert len(seen) == 2 and all(s.shape == (3, 5) for s in seen)
    assert torch.equal(seen[0][:, 2:], torch.tensor([[0.0, 0.0, 1.0]] * 3))  # w = 1, every level


def test_training_draws_follow_the_release():
    objective = make_objective("imf", interval_fraction=0.5, cfg_max=8.0)
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([objective.draw_time(g) for _ in range(4000)])  # (N, 5)
    tau, h, g_in, lo, hi = draws.unbind(1)
    fm = h == 0
    assert abs(fm.float().mean().item() - 0.5) < 0.03  # half the samples r = t
    w = 1 / (1 - g_in)
    assert w.min() >= 1 and w.max() <= 8 + 1e-4
    assert abs(torch.log(w).mean().item() - math.log(8) / 2) < 0.05  # log-uniform in [1, 8]
    assert torch.all(lo[fm] == 0) and torch.all(hi[fm] == 1)  # r = t: guided at every level
    assert lo[~fm].max() <= 0.5 <= hi[~fm].min() and lo[~fm].mean() < 0.3 and hi[~fm].mean() > 0.7


def test_one_network_call_per_step_at_any_scale_in_range_and_refusals_outside():
    from shared.generative.guidance import GuidedModelFn

    model = random_dit(_config(), 2).eval()
    objective = make_objective("imf")
    noise, y = torch.randn(4, 4, 8, 8), torch.arange(4) % 3
    images = []
    for scale in (1.0, 3.0, 8.0):
        fn = GuidedModelFn(model, scale, interval=(0.2, 0.7), noise_level=objective.noise_level)
        images.append(run_sampler(objective, "meanflow", fn, noise, 1, {}, model_kwargs={"y": y}))
        assert fn.rows == 4  # one call of N rows: the scale is an input, not a second batch
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    with pytest.raises(SettingError, match="outside \\[1, 8\\]"):
        run_sampler(objective, "meanflow", GuidedModelFn(model, 9.0), noise, 1, {}, model_kwargs={"y": y})
    with pytest.raises(SettingError, match="not among the intervals"):
        fn = GuidedModelFn(model, 2.0, interval=(0.6, 0.9), noise_level=objective.noise_level)
        run_sampler(objective, "meanflow", fn, noise, 1, {}, model_kwargs={"y": y})


def test_a_flow_network_loaded_into_imf_gives_its_velocity_at_every_guidance():
    """The paper's parameterisation allows it at r = t (u(z, t, t) = v): the start is the flow model's velocity there,
    and, as MeanFlow's, at every interval (h_emb = 0) and every guidance input (g_emb = 0)."""
    from train.init_from import InitWeights, apply_init

    flow = random_dit(ModelConfig(model="DiT-T/2", input_size=8, num_classes=3, objective="flow", learn_sigma=False),
                      5).eval()
    imf, ema = _config().build().eval(), _config().build().eval()
    apply_init(imf, ema, InitWeights(flow.state_dict(), {"from": "test"}))
    x, y, tau = torch.randn(4, 4, 8, 8), torch.tensor([0, 1, 2, 3]), torch.tensor([0.0, 0.3, 0.6, 0.95])
    with torch.no_grad():
        velocity = flow(x, tau, y)
        for h, guidance in ((torch.zeros(4), (0.0, 0.0, 1.0)), (torch.tensor([1.0, 0.7, 0.2, 0.05]), (0.8, 0.3, 0.6))):
            times = torch.cat([torch.stack([tau, h], 1), torch.tensor([guidance] * 4)], 1)
            assert torch.equal(imf(x, times, y), velocity) and torch.equal(ema(x, times, y), velocity)


# ----------------------------------------------------------------------------------------------------------
# End to end: python -m train --recipe imf, --init-from, python -m sample at several scales
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def imf_run(latents, tmp_path_factory):
    """A flow run (2 steps) and an imf run fine-tuned from it (2 steps) on the shared tiny latents."""
    root = tmp_path_factory.mktemp("imf")
    flow = run_inprocess(latents, root / "flow", "--recipe", "sit", "--max-steps", "2", "--ckpt-every", "2")
    run = run_inprocess(latents, root / "imf", "--recipe", "imf", "--init-from", str(flow), "--max-steps", "2",
                        "--ckpt-every", "2", "--cfg-max", "4")
    return run


def test_an_imf_run_records_its_guidance_range_and_its_start(imf_run):
    config = json.loads((imf_run / "config.json").read_text())
    assert config["objective"] == "imf" and config["init"]["objective"] == "flow"
    assert all(math.isfinite(row["loss"]) for row in metrics(imf_run))
    from shared.weights.export import load_weights
    _, model_config, _, step = load_weights(imf_run / "exports" / "ema-step-0000002.safetensors")
    assert step == 2 and model_config.guidance_inputs and model_config.objective_args["cfg_range"] == [1.0, 4.0]
    assert model_config.sampling == {"sampler": "meanflow", "num_sampling_steps": 1}


def test_sample_takes_any_scale_in_the_trained_range_in_one_step(imf_run, tiny_vae_dir, tmp_path, capsys):
    import dataclasses

    from shared.runtime import rundir
    from shared.tokenizers.locate import load_tokenizer
    from shared.weights.export import load_weights, save_weights
    from tests.helpers import run_sample

    # The run's weights on 16x16x4 latents of the tiny VAE (the shared latents have no VAE to decode them).
    state, config, _, _ = load_weights(imf_run / "exports" / "ema-step-0000002.safetensors")
    config = dataclasses.replace(config, input_size=16, num_classes=10)
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 32, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 16, 16],
            "vae": vae.identity, "class_names": [str(c) for c in range(10)]}
    run = tmp_path / "run"
    save_weights(rundir.export_path(run, 2), random_dit(config, 1).state_dict(), config, space_of(meta), 2)
    common = ["--ckpt", run, "--vae", tiny_vae_dir, "--num-samples", 2, "--cpu", "--num-sampling-steps", 1]
    for scale in (1, 2.5, 4):
        code, err = run_sample([*common, "--cfg-scale", scale, "--out", tmp_path / f"w{scale}"], capsys)
        assert code == 0, err
        assert len(list((tmp_path / f"w{scale}").glob("0*.png"))) == 2
        run = json.loads((tmp_path / f"w{scale}" / "settings.json").read_text())["run"]
        assert run["guidance"].startswith(f"guidance: cfg scale {scale:g} fed to the network"), run["guidance"]
    code, err = run_sample([*common, "--cfg-scale", 5, "--out", tmp_path / "w5"], capsys)
    assert code == 2 and "--cfg-scale 5 is outside [1, 4]" in err and "--cfg-max" in err, err
    assert not (tmp_path / "w5").exists()
    code, err = run_sample([*common, "--cfg-scale", 2, "--cfg-interval", 0.6, 0.9, "--out", tmp_path / "i"], capsys)
    assert code == 2 and "not among the intervals" in err and not (tmp_path / "i").exists()
    code, err = run_sample([*common, "--sampler", "euler", "--out", tmp_path / "e"], capsys)
    assert code == 2 and "--sampler euler samples flow models" in err and not (tmp_path / "e").exists()


def test_train_refuses_a_preview_scale_outside_the_range_and_compile(latents, tmp_path, capsys):
    message = expect_user_error(capsys, train_args(latents, tmp_path / "r", "--recipe", "imf", "--cfg-max", "3",
                                                   "--sample-cfg-scale", "4"))
    assert "--sample-cfg-scale 4 is outside [1, 3]" in message and not (tmp_path / "r").exists()
    message = expect_user_error(capsys, train_args(latents, tmp_path / "c", "--recipe", "imf", "--compile"))
    assert "--compile cannot train the imf objective" in message and not (tmp_path / "c").exists()
