"""Every sampler ends at the data, images do not depend on their batch, and guidance edges fall as REPA's (issue 29).

The fields here are exact, so what a sampler must return is known: for Gaussian data N(MU, S^2) the exact
velocity is affine in the data mean, and moving the mean by delta moves every flow sampler's end point by
T delta, where T is the time it really reached (1 = the data). For point-mass data the exact eps of a DDPM
model makes each DDPM sampler's last step land on the point itself.
"""
import numpy as np
import pytest
import torch
from torchdiffeq import odeint

from shared.generative.diffusion import NUM_TIMESTEPS
from shared.generative.guidance import GuidedModelFn
from shared.generative.objectives import make_objective, run_sampler
from shared.generative.samplers import samplers_for

MU, S = 0.7, 0.5
SHIFTS = (0.3, 1.0, 3.0)


def gaussian_velocity(x, tau, mu=MU):
    """E[x1 - eps | x_tau] for x1 ~ N(mu, S^2) on SiT's linear path (float64 algebra)."""
    t = tau.view(-1, *([1] * (x.ndim - 1))).double()
    var = t ** 2 * S ** 2 + (1 - t) ** 2
    return (mu + (t * S ** 2 - (1 - t)) / var * (x.double() - t * mu)).float()


def flow_model(mu=MU, convention="sit", seen=None):
    """A DiT-shaped network answering with the exact velocity in `convention` (2C channels; the second half junk)."""
    def model_fn(x, t):
        if seen is not None:
            seen.append(t.clone())
        tau = t if convention == "sit" else 1 - t
        v = gaussian_velocity(x, tau, mu)
        return torch.cat([v if convention == "sit" else -v, torch.full_like(v, 9.0)], dim=1)
    return model_fn


def _sample(sampler, mu, steps, options, convention="sit", noise=None):
    """A flow sampler's end point from fixed noise and fixed SDE increments."""
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0)) if noise is None else noise
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(noise))]
    objective = make_objective("flow", {"convention": convention})
    return run_sampler(objective, sampler, flow_model(mu, convention), noise, steps, options, generator=gens)


@pytest.mark.parametrize("steps", [2, 5, 16])
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("sampler,last_step", [("euler", None), ("heun", None), ("sde", 0.04), ("sde", 0.25)])
def test_flow_samplers_end_at_the_data_for_every_shift_steps_and_last_step(sampler, last_step, shift, steps):
    """x_end(mu + delta) - x_end(mu) = T delta exactly: the walk reaches T = 1 (the old SDE grid with shift 0.3 stopped at 0.918)."""
    options = {"time_shift": shift} if last_step is None else {"time_shift": shift, "last_step_size": last_step}
    delta = 1.0
    moved = _sample(sampler, MU + delta, steps, options) - _sample(sampler, MU, steps, options)
    torch.testing.assert_close(moved, torch.full_like(moved, delta), rtol=0, atol=2e-5)


@pytest.mark.parametrize("shift", SHIFTS)
def test_sde_grid_reaches_one_and_keeps_its_last_step(shift):
    """The SDE's N grid points end at 1 - h and its Mean step of size h ends at tau = 1, for any shift."""
    for steps in (2, 3, 250):
        for h in (0.04, 0.1, 0.5):
            process = make_objective("flow").process("sde", steps, {"time_shift": shift, "last_step_size": h})
            assert len(process.times) == steps and float(process.times[0]) == 0.0
            assert float(process.times[-1]) == 1.0 - h and process.last_step == h
            assert bool((process.times[1:] > process.times[:-1]).all())


def test_point_mass_ends_exactly_on_the_point_and_the_sde_within_its_last_step():
    """Data at one point c: Euler's last step lands on c; the SDE's Mean step ends at c - h e, e ~ N(0, 1) when its
    250 steps are fine enough: an error of about h for every shift (the old shift-0.3 grid ended at tau 0.918)."""
    c = 0.3

    def point_mass(x, t):
        return torch.cat([(c - x) / (1 - t.view(-1, 1, 1, 1).float()), x], dim=1)  # v = (c - x) / (1 - tau)

    noise = torch.randn(64, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    for shift in SHIFTS:
        x = run_sampler(make_objective("flow"), "euler", point_mass, noise, 7, {"time_shift": shift})
        torch.testing.assert_close(x, torch.full_like(x, c), rtol=0, atol=1e-5)
        for h in (0.04, 0.2):
            gens = [torch.Generator().manual_seed(i) for i in range(len(noise))]
            x = run_sampler(make_objective("flow"), "sde", point_mass, noise, 250,
                            {"time_shift": shift, "last_step_size": h}, generator=gens)
            rms = (x - c).pow(2).mean().sqrt().item()
            assert 0.7 * h < rms < 1.3 * h, (shift, h, rms)


def test_dopri5_ends_at_the_data():
    """Data = noise + d (exact velocity d, solution x0 + d) is integrated to tau = 1 exactly; Gaussian data to tolerance."""
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    d = torch.linspace(-2, 2, 32).view(1, 2, 4, 4)
    x = run_sampler(make_objective("flow"), "dopri5", lambda x, t: torch.cat([d.expand_as(x), x], 1), noise, 1, {})
    torch.testing.assert_close(x, noise + d, rtol=0, atol=1e-5)
    x = _sample("dopri5", MU, 1, {}, noise=noise)
    assert (x - (MU + S * noise)).pow(2).mean().sqrt() < 0.02  # rtol 1e-3 on the state


# --- DDPM samplers: with the exact eps of point-mass data, the last step lands on the point ------------------

BETAS = np.linspace(1e-4, 0.02, NUM_TIMESTEPS)  # DiT's schedule, written out independently
ABAR = torch.tensor(np.cumprod(1 - BETAS), dtype=torch.float64)


@pytest.mark.parametrize("sampler", samplers_for("ddpm"))
@pytest.mark.parametrize("steps", [2, 10, 50])
def test_ddpm_samplers_end_on_point_mass_data(sampler, steps):
    """eps(x_t, t) = (x_t - sqrt(abar_t) c) / sqrt(1 - abar_t) exactly; every DDPM sampler must return c."""
    c = -0.4

    def model_fn(x, t):
        ab = ABAR[t].view(-1, 1, 1, 1)
        eps = ((x.double() - ab.sqrt() * c) / (1 - ab).sqrt()).float()
        return torch.cat([eps, torch.zeros_like(eps)], dim=1)  # eps + the learned-variance channels

    noise = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    x = run_sampler(make_objective("ddpm"), sampler, model_fn, noise, steps, {}, generator=gens)
    torch.testing.assert_close(x, torch.full_like(x, c), rtol=0, atol=1e-4)


# --- dopri5: image i depends only on its own noise (issue 29.4) ---------------------------------------------

def test_dopri5_row_does_not_depend_on_its_batch_and_is_torchdiffeq_alone():
    """Row 0 alone, and in a batch with rows that need other step sizes, gives the same image, equal to torchdiffeq on
    row 0 alone called as SiT calls it (list-valued tolerances)."""
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(4)) * torch.tensor([1.0, 4.0, 0.2]).view(3, 1, 1, 1)
    for convention in ("sit", "repa"):
        alone = _sample("dopri5", MU, 1, {}, convention, noise[:1])
        batch = _sample("dopri5", MU, 1, {}, convention, noise)
        assert torch.equal(alone[0], batch[0])
    ref = odeint(lambda t, x: gaussian_velocity(x, torch.full((1,), float(t.float()), dtype=torch.float64)),
                 noise[:1], torch.tensor([0.0, 1.0]), method="dopri5", atol=[1e-6], rtol=[1e-3])[-1]  # as SiT calls it
    torch.testing.assert_close(_sample("dopri5", MU, 1, {}, "sit", noise[:1]), ref, rtol=0, atol=1e-6)
    whole = odeint(lambda t, x: gaussian_velocity(x, torch.full((3,), float(t.float()), dtype=torch.float64)),
                   noise, torch.tensor([0.0, 1.0]), method="dopri5", atol=[1e-6], rtol=[1e-3])[-1]
    assert (whole[0] - ref[0]).abs().max() > 1e-4  # torchdiffeq's batch-wide step size: why rows run on their own


def test_dopri5_passes_each_row_its_own_labels():
    """Rows evaluated at different times get their own model kwargs (the class labels)."""
    seen = []

    def model_fn(x, t, y):
        seen.append((t.clone(), y.clone()))
        v = gaussian_velocity(x, t) * (1 + 0.1 * y.view(-1, 1, 1, 1).float())
        return torch.cat([v, v], dim=1)

    noise = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(5)) * torch.tensor([1.0, 5.0, 0.1]).view(3, 1, 1, 1)
    y = torch.tensor([0, 1, 2])
    batch = run_sampler(make_objective("flow"), "dopri5", model_fn, noise, 1, {}, model_kwargs={"y": y})
    for i in range(3):
        alone = run_sampler(make_objective("flow"), "dopri5", model_fn, noise[i:i + 1], 1, {},
                            model_kwargs={"y": y[i:i + 1]})
        assert torch.equal(alone[0], batch[i])
    assert any(len(labels) < 3 for _, labels in seen)  # rows did finish at different steps


# --- guidance-interval edges on the float64 grid (issue 29.5) ------------------------------------------------

class _Net(torch.nn.Module):
    """A DiT stand-in with a null class; records the network times."""

    in_channels, null_label = 2, 1

    def __init__(self):
        super().__init__()
        self.y_embedder = type("E", (), {"has_null": True})()
        self.times = []

    def forward(self, x, t, y):
        self.times.append(t.clone())
        return torch.cat([x, x], dim=1)


def repa_guided_steps(sampler: str, steps: int, lo: float, hi: float) -> int:
    """How many steps REPA's samplers.py guides: its float64 grid (time 0 = data) compared with the interval."""
    grid = (torch.linspace(1.0, 0.04, steps, dtype=torch.float64) if sampler == "sde"
            else torch.linspace(1, 0, steps + 1, dtype=torch.float64)[:-1])
    return sum(1 for t in grid.tolist() if lo <= t <= hi)


@pytest.mark.parametrize("sampler,steps", [("euler", 110), ("euler", 220), ("sde", 145), ("sde", 177), ("sde", 209),
                                           ("euler", 50), ("sde", 250)])
def test_guidance_interval_edges_as_repa_decides_them(sampler, steps):
    """REPA-convention models: guided steps exactly REPA's at the listed edge cases, and its float32 times."""
    net = _Net()
    objective = make_objective("flow", {"convention": "repa"})
    fn = GuidedModelFn(net, 1.8, None, "fp32", (0.0, 0.7), objective.noise_level)
    gens = [torch.Generator().manual_seed(0)]
    run_sampler(objective, sampler, fn, torch.ones(1, 2, 1, 1), steps, {}, model_kwargs={"y": torch.tensor([0])},
                generator=gens)
    assert fn.calls["guided"] == repa_guided_steps(sampler, steps, 0.0, 0.7)
    grid = (torch.linspace(1.0, 0.04, steps, dtype=torch.float64) if sampler == "sde"
            else torch.linspace(1, 0, steps + 1, dtype=torch.float64)[:-1])
    assert torch.equal(torch.stack([t[0] for t in net.times]), grid.float())  # REPA: float64 grid, rounded once
    assert all(t.dtype == torch.float32 for t in net.times)


def test_sit_convention_decides_on_its_own_float64_grid():
    """SiT-convention models: the level 1 - tau of SiT's float64 grid, edges included (110 steps: 0.7 exactly)."""
    fn = GuidedModelFn(_Net(), 1.8, None, "fp32", (0.0, 0.7), make_objective("flow").noise_level)
    run_sampler(make_objective("flow"), "euler", fn, torch.ones(1, 2, 1, 1), 110, {}, model_kwargs={"y": torch.tensor([0])})
    levels = 1 - torch.linspace(0, 1, 111, dtype=torch.float64)[:-1]
    assert fn.calls["guided"] == int(((levels >= 0) & (levels <= 0.7)).sum())
    assert float(levels[33]) == 0.7  # on the edge in float64, guided (a float32 time said 0.70000005)
