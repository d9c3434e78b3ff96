"""ODE solvers (DPM-Solver++(2M), UniPC): exact Gaussian flow, diffusers' schedulers, determinism, the CLI."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from shared.generative.diffusion import NUM_TIMESTEPS, kept_timesteps, space_timesteps
from shared.runtime.errors import SettingError, UserError
from shared.generative.diffusion import DDPMObjective
from shared.generative.samplers import SAMPLERS, sampler_options
from shared.weights.export import save_weights
from shared.network.models import ModelConfig
from shared.tokenizers.locate import load_tokenizer
from tests.conftest import ROOT
from sample.__main__ import main as sample_main
from tests.helpers import NUM_CLASSES, pngs, random_dit, run_main, run_sample, space_of

SOLVERS = ("dpmpp-2m", "unipc")


def create_sampling_diffusion(name, steps):
    """The respaced diffusion the DDPM objective builds for sampler `name` (its registry spacing)."""
    return DDPMObjective().process(name, steps, {})


def sampler_eta(name, eta):
    """DDIM's eta as the registry resolves it (None for samplers that take none)."""
    return sampler_options(name, {"ddim_eta": eta}).get("ddim_eta")
BETAS = np.linspace(1e-4, 0.02, NUM_TIMESTEPS)  # the DiT schedule, written out independently
ABAR = np.cumprod(1 - BETAS)
ABAR_F32 = torch.tensor(ABAR, dtype=torch.float32)
MU, S = 0.7, 0.5  # data x_0 ~ N(MU, S^2) in every coordinate


def oracle_eps(x, t):
    """E[eps | x_t] for N(MU, S^2) data at ORIGINAL timesteps t (N,): Cov(eps, x_t) / Var(x_t) (x_t - E x_t)."""
    ab = ABAR_F32[t].view(-1, *([1] * (x.ndim - 1)))
    return (1 - ab).sqrt() / (ab * S**2 + 1 - ab) * (x - ab.sqrt() * MU)


def oracle(x, t):
    """The oracle as a DiT: eps plus learned-variance channels (random values an ODE solver must ignore)."""
    return torch.cat([oracle_eps(x, t), torch.sin(7 * x)], dim=1)  # (N, 2C, ...)


def nonlinear_eps(x, t):
    """A nonlinear, time-dependent eps model, so multistep corrections are exercised beyond a linear map."""
    ab = ABAR_F32[t].view(-1, *([1] * (x.ndim - 1)))
    return (1 - ab).sqrt() * torch.tanh(1.5 * x) + 0.3 * ab * torch.cos(x)


def exact_flow(noise):
    """The probability-flow ODE's exact end point (clean data, abar = 1) for Gaussian data: affine per coordinate.

    Along the flow x_t = MU sqrt(abar_t) + sqrt(abar_t S^2 + 1 - abar_t) z with z fixed, so from x_T at t = 999
    the clean end is MU + S z, z = (x_T - MU sqrt(abar_T)) / sqrt(abar_T S^2 + 1 - abar_T).
    """
    ab = ABAR[-1]
    z = (noise.double() - MU * math.sqrt(ab)) / math.sqrt(ab * S**2 + 1 - ab)
    return MU + S * z


# --------------------------------------------------------------------------------------------------
# The solvers' time grid
# --------------------------------------------------------------------------------------------------

def test_linspace_spacing_is_diffusers_and_differs_from_dit_respacing_only_by_rounding():
    """K solver steps = round(linspace(0, 999, K + 1)) without 0; DiT's K + 1 respaced steps differ by rounding."""
    for k in (1, 2, 5, 10, 20, 25, 50, 250, 999):
        kept = kept_timesteps(f"linspace{k}")
        expected = np.linspace(0, NUM_TIMESTEPS - 1, k + 1).round()[1:].astype(int).tolist()
        assert kept == expected and len(kept) == k and 0 not in kept
        dit = space_timesteps(NUM_TIMESTEPS, k + 1)[1:]
        assert max(abs(a - b) for a, b in zip(kept, dit)) <= 1
    assert kept_timesteps("linspace20")[9] == 500 and space_timesteps(NUM_TIMESTEPS, 21)[10] == 499  # the stated case
    assert create_sampling_diffusion("unipc", 20).timestep_map.tolist() == kept_timesteps("linspace20")
    assert create_sampling_diffusion("ddim", 20).timestep_map.tolist() == space_timesteps(NUM_TIMESTEPS, 20)
    with pytest.raises(UserError, match="at most 999"):
        create_sampling_diffusion("dpmpp-2m", 1000)


# --------------------------------------------------------------------------------------------------
# Exact denoiser for Gaussian data
# --------------------------------------------------------------------------------------------------

def _flow_error(name, k, noise):
    """(sampler output, exact ODE x_0) for k model calls of sampler `name` with the oracle."""
    d = create_sampling_diffusion(name, k)
    return SAMPLERS[name].fn(d, oracle, noise, eta=sampler_eta(name, None)), exact_flow(noise).float()


@pytest.mark.parametrize("name", SOLVERS)
def test_solvers_land_on_the_gaussian_data_distribution(name):
    """~20 steps: mean within 0.01 and std within 5% of the data; 50 steps within 1%; error falls with steps."""
    noise = torch.randn(4000, 1, 2, 2, generator=torch.Generator().manual_seed(0))  # 16,000 coordinates
    errors = {}
    for k in (10, 20, 50):
        x, exact = _flow_error(name, k, noise)
        # Per-sample comparison with the exact flow of the same noise: no Monte Carlo error in the gap.
        errors[k] = (x - exact).abs().mean().item()
        assert x.mean().item() == pytest.approx(exact.mean().item(), abs=0.01)
        if k >= 20:
            assert x.std().item() == pytest.approx(exact.std().item(), rel=0.05 if k == 20 else 0.01)
    assert exact.mean().item() == pytest.approx(MU, abs=0.02) and exact.std().item() == pytest.approx(S, rel=0.02)
    assert errors[50] < errors[20] < errors[10]
    # Second order beats DDIM (first order, DiT's respacing) at the same 20 model calls.
    ddim, exact = _flow_error("ddim", 20, noise)
    assert errors[20] < 0.6 * (ddim - exact).abs().mean().item()


# --------------------------------------------------------------------------------------------------
# Agreement with diffusers' schedulers configured with the DiT betas
# --------------------------------------------------------------------------------------------------

def diffusers_scheduler(name):
    """diffusers' own scheduler for `name` with DiT's betas: defaults (order 2, linspace spacing, final sigma 0)."""
    from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

    cls = {"dpmpp-2m": DPMSolverMultistepScheduler, "unipc": UniPCMultistepScheduler}[name]
    scheduler = cls(num_train_timesteps=NUM_TIMESTEPS, trained_betas=BETAS)
    expected = {"dpmpp-2m": ("dpmpp-2m", "dpmsolver++", "midpoint"), "unipc": ("unipc", True, "bh2")}[name]
    got = (name, getattr(scheduler.config, "algorithm_type", None) or scheduler.config.predict_x0,
           scheduler.config.solver_type)
    assert got == expected and scheduler.config.solver_order == 2 and scheduler.config.final_sigmas_type == "zero"
    return scheduler


def run_diffusers(name, k, eps_fn, noise):
    """The textbook diffusers loop: eps at each scheduler timestep, then scheduler.step; returns (x, timesteps)."""
    scheduler = diffusers_scheduler(name)
    scheduler.set_timesteps(k)
    x = noise.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(eps_fn(x, torch.full((len(x),), int(t))), t, x).prev_sample
    return x, scheduler.timesteps.tolist()


@pytest.mark.parametrize("name", SOLVERS)
@pytest.mark.parametrize("k", [1, 2, 3, 7, 20])
def test_solvers_match_diffusers_schedulers(name, k):
    """Our solvers and diffusers' schedulers give the same x_0 and call the model at the same timesteps."""
    noise = torch.randn(6, 3, 4, 4, generator=torch.Generator().manual_seed(k))
    for eps_fn in (oracle_eps, nonlinear_eps):
        ref, their_steps = run_diffusers(name, k, eps_fn, noise)
        calls = []

        def model_fn(x, t):
            calls.append(int(t[0]))
            return torch.cat([eps_fn(x, t), torch.randn_like(x)], dim=1)  # the variance half is ignored

        ours = SAMPLERS[name].fn(create_sampling_diffusion(name, k), model_fn, noise)
        assert calls == their_steps and len(calls) == k
        # float32 both sides; diffusers' schedule is float32, ours float64 (x0 predictions amplify by 1/alpha).
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-5)


def test_unipc_corrector_changes_the_result():
    """UniPC is not DPM-Solver++ under another name: with >= 3 steps the corrector moves the samples."""
    noise = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    a = SAMPLERS["unipc"].fn(create_sampling_diffusion("unipc", 6), lambda x, t: nonlinear_eps(x, t), noise)
    b = SAMPLERS["dpmpp-2m"].fn(create_sampling_diffusion("dpmpp-2m", 6), lambda x, t: nonlinear_eps(x, t), noise)
    assert (a - b).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------------
# Determinism and eta
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SOLVERS)
def test_rows_do_not_depend_on_the_batch(name):
    """Row i of a batch of 4 equals the same noise solved alone or in a batch of 2; no generator is consumed."""
    noise = torch.randn(4, 2, 2, 2, generator=torch.Generator().manual_seed(3))
    d = create_sampling_diffusion(name, 8)
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    whole = SAMPLERS[name].fn(d, oracle, noise, generator=gens)
    parts = torch.cat([SAMPLERS[name].fn(d, oracle, noise[i:i + 2]) for i in (0, 2)])
    torch.testing.assert_close(whole, parts, rtol=0, atol=1e-6)
    assert [g.initial_seed() for g in gens] == list(range(4))
    assert torch.equal(torch.randn(1, generator=gens[0]), torch.randn(1, generator=torch.Generator().manual_seed(0)))


def test_eta_is_ddim_only():
    """sampler_eta: DDIM's eta defaults to 0 and must lie in [0, 1]; every other sampler refuses one by name."""
    assert sampler_eta("ddim", None) == 0.0 and sampler_eta("ddim", 0.5) == 0.5
    assert all(sampler_eta(name, None) is None for name in ("ddpm", *SOLVERS))
    for name in ("ddpm", *SOLVERS):
        with pytest.raises(SettingError) as err:
            sampler_eta(name, 0.3)
        advice = err.value.phrase({"ddim eta": "--ddim-eta", "sampler": "--sampler"})
        assert f"the {name} sampler" in advice and "--sampler ddim" in advice and "--ddim-eta 0.3" in advice
        assert DDPMObjective().sample(name, oracle, torch.zeros(1, 1, 2, 2), 3, sampler_options(name, {})).shape
        with pytest.raises(SettingError):
            SAMPLERS[name].fn(create_sampling_diffusion(name, 3), oracle, torch.zeros(1, 1, 2, 2), eta=0.0)
    with pytest.raises(SettingError, match=r"must lie in \[0, 1\]"):
        sampler_eta("ddim", 1.5)


# --------------------------------------------------------------------------------------------------
# The CLI with a tiny DiT and VAE
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_vae_dir):
    """A run folder with one EMA export of a random DiT-T/2 (latent 4x8x8) whose latents name the tiny VAE."""
    root = tmp_path_factory.mktemp("solvers")
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=NUM_CLASSES)
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8],
            "vae": vae.identity, "class_names": [str(c) for c in range(NUM_CLASSES)]}
    save_weights(root / "run" / "exports" / "ema-step-0000010.safetensors", random_dit(config).state_dict(),
                 config, space_of(meta), 10)
    return root / "run"


def sample_argv(run_dir, out, *extra):
    """argv of `python -m sample` on the tiny run, 4 steps on the CPU."""
    return ["--ckpt", run_dir, "--out", out, "--num-sampling-steps", 4, "--cpu", *extra]


@pytest.mark.parametrize("name", SOLVERS)
def test_cli_solver_images_do_not_depend_on_batch_size(run_dir, tmp_path, capsys, name):
    """--sampler NAME: batch 1 and batch 3 give byte-identical PNGs; settings.json records the sampler, no eta."""
    for batch in (1, 3):
        code, err = run_sample(sample_argv(run_dir, tmp_path / f"b{batch}", "--sampler", name, "--num-samples", 4,
                                        "--batch-size", batch, "--random-labels", "--seed", 5), capsys)
        assert code == 0, err
    assert pngs(tmp_path / "b1") == pngs(tmp_path / "b3") and len(set(pngs(tmp_path / "b1").values())) == 4
    identity = json.loads((tmp_path / "b1" / "settings.json").read_text())["identity"]
    assert (identity["sampler"], identity["num_sampling_steps"], identity["ddim_eta"]) == (name, 4, None)


def test_cli_ddim_eta_is_recorded_and_guards_resume(run_dir, tmp_path, capsys, monkeypatch):
    """--ddim-eta changes the pixels, is recorded, names the default folder, and a resume with another is refused."""
    out = tmp_path / "eta"
    assert run_sample(sample_argv(run_dir, out, "--sampler", "ddim", "--ddim-eta", 1, "--num-samples", 2), capsys)[0] == 0
    assert run_sample(sample_argv(run_dir, tmp_path / "det", "--sampler", "ddim", "--num-samples", 2), capsys)[0] == 0
    assert json.loads((out / "settings.json").read_text())["identity"]["ddim_eta"] == 1.0
    assert json.loads((tmp_path / "det" / "settings.json").read_text())["identity"]["ddim_eta"] == 0.0
    assert pngs(out) != pngs(tmp_path / "det")
    code, err = run_sample(sample_argv(run_dir, out, "--sampler", "ddim", "--ddim-eta", 0.5, "--num-samples", 2), capsys)
    assert code == 2 and "ddim_eta: 1.0 -> 0.5" in err
    monkeypatch.chdir(tmp_path)
    argv = ["--ckpt", run_dir, "--num-sampling-steps", 3, "--cpu", "--sampler", "ddim", "--num-samples", 1]
    assert run_sample([*argv, "--ddim-eta", 0.5], capsys)[0] == 0
    assert run_sample(argv, capsys)[0] == 0
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "run-ema-step-0000010-cfg4-ddim3-eta0.5-seed0", "run-ema-step-0000010-cfg4-ddim3-seed0"]


def test_cli_refuses_to_resume_a_folder_whose_settings_lack_a_setting(run_dir, tmp_path, capsys):
    """A settings.json without one of this version's settings cannot be resumed: refused, nothing added."""
    out = tmp_path / "old"
    assert run_sample(sample_argv(run_dir, out, "--sampler", "ddim", "--num-samples", 1), capsys)[0] == 0
    settings = json.loads((out / "settings.json").read_text())
    del settings["identity"]["ddim_eta"]
    (out / "settings.json").write_text(json.dumps(settings))
    code, err = run_sample(sample_argv(run_dir, out, "--sampler", "ddim", "--num-samples", 2), capsys)
    assert code == 2 and "ddim_eta" in err, err
    assert len(pngs(out)) == 1


@pytest.mark.parametrize("extra,message", [
    (("--sampler", "unipc", "--ddim-eta", 0), "--ddim-eta 0 sets DDIM's eta in [0, 1] (0 = deterministic), which "
                                               "the unipc sampler does not take (only ddim); drop it, or pass "
                                               "--sampler ddim"),
    (("--ddim-eta", 0.2), "which the ddpm sampler does not take"),
    (("--sampler", "ddim", "--ddim-eta", 1.5), "--ddim-eta 1.5 is outside [0, 1]"),
    (("--sampler", "dpmpp-2m", "--num-sampling-steps", 1000), "at most 999 sampling steps"),
])
def test_cli_refuses_eta_elsewhere_and_solver_step_counts(run_dir, tmp_path, capsys, extra, message):
    """One paragraph, exit status 2, nothing written."""
    code, err = run_sample(sample_argv(run_dir, tmp_path / "o", *extra), capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cli_unipc_end_to_end_subprocess(run_dir, tmp_path, capsys):
    """`python -m sample --sampler unipc` as a user runs it: guided, PNGs + grid + npz, sampler in -h."""
    out = tmp_path / "u"
    cmd = [sys.executable, "-m", "sample", *map(str, sample_argv(run_dir, out, "--sampler", "unipc", "--num-samples",
                                                                 3, "--cfg-scale", 4, "--npz"))]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with np.load(out / "samples.npz") as npz:
        assert npz["arr_0"].shape == (3, 16, 16, 3) and npz["arr_0"].std() > 0
    assert (out / "grid.png").exists() and len(pngs(out)) == 3
    code, help_text, _ = run_main(sample_main, ["-h"], capsys)  # the same parser in-process
    assert code == 0
    assert "dpmpp-2m" in help_text and "unipc" in help_text and "--ddim-eta" in help_text
    assert "linspace" in help_text
