"""shared/generative/diffusion.py against float64 references written here, independently of the module's algebra."""
import math

import numpy as np
import pytest
import torch

from shared.generative.diffusion import (NUM_TIMESTEPS, GaussianDiffusion, approx_std_normal_cdf, create_diffusion, ddim_sample,
                              ddim_timesteps, ddpm_sample, discretized_gaussian_log_likelihood, normal_kl,
                              space_timesteps)
from shared.runtime.errors import ChoiceError, SettingError, UserError
from shared.generative.samplers import SAMPLERS, get_sampler, sampler_names

BETAS = np.linspace(1e-4, 0.02, 1000)  # the DiT schedule, written out independently
ABAR = np.cumprod(1 - BETAS)


def abar_prev(abar, t):
    """abar_{t-1} with abar_{-1} = 1."""
    return 1.0 if t == 0 else abar[t - 1]


def kept_steps(k, size=NUM_TIMESTEPS):
    """ADM's one-section spacing: a running float sum of the stride (size - 1) / (k - 1), each sum rounded."""
    stride, total, kept = ((size - 1) / (k - 1) if k > 1 else 1), 0.0, []
    for _ in range(k):
        kept.append(round(total))  # Python's round: half to even, of the accumulated (inexact) sum
        total += stride
    return sorted(set(kept))


# --------------------------------------------------------------------------------------------------
# Schedule and closed forms
# --------------------------------------------------------------------------------------------------

def test_schedule_is_the_dit_linear_schedule():
    d = create_diffusion()
    assert d.num_timesteps == NUM_TIMESTEPS == 1000
    assert d.betas.dtype == np.float64
    np.testing.assert_allclose(d.betas, BETAS, rtol=1e-12)
    np.testing.assert_allclose(d.alphas_cumprod, ABAR, rtol=1e-12)
    np.testing.assert_array_equal(d.timestep_map, np.arange(1000))


def test_q_sample_matches_eq4():
    d = create_diffusion()
    x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    t = torch.tensor([0, 500, 999])
    ab = torch.tensor(ABAR[[0, 500, 999]], dtype=torch.float32).view(3, 1, 1, 1)
    torch.testing.assert_close(d.q_sample(x0, t, noise), ab.sqrt() * x0 + (1 - ab).sqrt() * noise)


def test_q_posterior_matches_bayes_rule():
    """q(x_{t-1}|x_t,x_0) ∝ q(x_t|x_{t-1}) q(x_{t-1}|x_0): the product of two Gaussians, in float64."""
    d = create_diffusion()
    g = torch.Generator().manual_seed(0)
    ts = [1, 2, 10, 400, 999]
    x0, xt = torch.randn(len(ts), 3, generator=g), torch.randn(len(ts), 3, generator=g)
    mean, var, log_var = d.q_posterior_mean_variance(x0, xt, torch.tensor(ts))
    for row, t in enumerate(ts):
        a, ap = 1 - BETAS[t], ABAR[t - 1]
        precision = 1 / (1 - ap) + a / BETAS[t]
        weighted = math.sqrt(ap) * x0[row].double() / (1 - ap) + math.sqrt(a) * xt[row].double() / BETAS[t]
        ref_mean = weighted / precision
        torch.testing.assert_close(mean[row].double(), ref_mean, rtol=1e-5, atol=1e-5)
        assert var[row].item() == pytest.approx(1 / precision, rel=1e-5)
        assert log_var[row].item() == pytest.approx(math.log(1 / precision), rel=1e-5)
    # At t = 0 the posterior collapses onto x_0; its log-variance is clipped to that of t = 1.
    mean0, var0, log_var0 = d.q_posterior_mean_variance(x0, xt, torch.zeros(len(ts), dtype=torch.long))
    torch.testing.assert_close(mean0, x0)
    assert var0.abs().max().item() == 0.0
    assert log_var0[0].item() == pytest.approx(math.log(BETAS[1] * (1 - ABAR[0]) / (1 - ABAR[1])), rel=1e-5)


def test_normal_kl_closed_form_and_monte_carlo():
    m1, s1, m2, s2 = 0.3, 0.7, -0.4, 1.3
    ref = math.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5
    kl = normal_kl(*(torch.tensor(v, dtype=torch.float64) for v in (m1, 2 * math.log(s1), m2, 2 * math.log(s2))))
    assert kl.item() == pytest.approx(ref, rel=1e-12)
    # Monte Carlo: E_{x~p1}[log p1(x) - log p2(x)].
    x = m1 + s1 * torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    log_p = lambda m, s: -0.5 * ((x - m) / s) ** 2 - math.log(s)  # noqa: E731
    assert (log_p(m1, s1) - log_p(m2, s2)).mean().item() == pytest.approx(ref, abs=5e-3)
    assert normal_kl(torch.tensor(0.5), torch.tensor(0.1), torch.tensor(0.5), torch.tensor(0.1)).item() == 0.0


def _cdf(z):
    """Exact standard normal CDF in float64 via math.erf."""
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _approx_cdf(z):
    """ADM's tanh approximation of the standard normal CDF, in float64 numpy."""
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def _approx_pdf(z):
    """d/dz of _approx_cdf: 0.5 sech^2(g(z)) g'(z), g(z) = sqrt(2/pi) (z + 0.044715 z^3)."""
    z = np.asarray(z, dtype=np.float64)
    g = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
    return 0.5 / np.cosh(g) ** 2 * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)


def _bin_log_prob(x, mean, scale):
    """Float64 reference of ADM's decoder log-likelihood for one value: approximate-CDF bin, floored at 1e-12."""
    hi, lo = _approx_cdf((x + 1 / 255 - mean) / scale), _approx_cdf((x - 1 / 255 - mean) / scale)
    prob = hi if x < -0.999 else (1 - lo if x > 0.999 else hi - lo)  # edge bins reach -inf / +inf
    return math.log(max(prob, 1e-12))


def test_approx_cdf_is_the_tanh_formula_and_within_1_8e_4_of_phi():
    z = torch.linspace(-8, 8, 16001, dtype=torch.float64)
    approx = approx_std_normal_cdf(z)
    np.testing.assert_allclose(approx.numpy(), _approx_cdf(z.numpy()), rtol=1e-14, atol=1e-16)
    # Honest error vs the exact Phi: 1.79e-4 at most (near |z| = 2.6), but 2x too small at z = -4.
    exact = torch.special.ndtr(z)
    assert (approx - exact).abs().max().item() == pytest.approx(1.79e-4, abs=0.01e-4)
    assert approx_std_normal_cdf(torch.tensor(-4.0, dtype=torch.float64)).item() / _cdf(-4) == pytest.approx(
        0.5545, abs=1e-4)
    assert (approx.diff() >= 0).all() and approx[0].item() < 1e-20 and approx[-1].item() == 1.0  # still a CDF


@pytest.mark.parametrize("mean,log_scale", [(0.1, math.log(0.05)), (-0.97, math.log(0.02)), (0.6, math.log(0.3)),
                                            (0.0, math.log(0.008))])
def test_discretized_gaussian_matches_the_approximate_cdf_bins(mean, log_scale):
    levels = torch.arange(256, dtype=torch.float64) / 127.5 - 1  # the 256 pixel levels in [-1, 1]
    means, log_scales = torch.full_like(levels, mean), torch.full_like(levels, log_scale)
    logp = discretized_gaussian_log_likelihood(levels, means, log_scales)
    scale = math.exp(log_scale)
    ref = np.array([_bin_log_prob(x, mean, scale) for x in levels.tolist()])
    # Tiny far-tail bins are differences of two CDF values near 1 (cancellation), so compare probabilities there.
    np.testing.assert_allclose(logp.exp().numpy(), np.exp(ref), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(logp.numpy()[ref > math.log(1e-6)], ref[ref > math.log(1e-6)], rtol=1e-9)
    assert logp.exp().sum().item() == pytest.approx(1.0, abs=1e-9)  # the approximation is a CDF: bins sum to 1
    # Against the exact CDF each bin's probability is off by at most twice the CDF error (2 x 1.79e-4).
    exact = [(1.0 if i == 255 else _cdf((x + 1 / 255 - mean) / scale)) - (0.0 if i == 0 else _cdf((x - 1 / 255 - mean)
             / scale)) for i, x in enumerate(levels.tolist())]
    assert np.abs(logp.exp().numpy() - np.array(exact)).max() < 3.6e-4
    # float32, as training runs it: same values to float32 round-off where the bin is not tiny.
    logp32 = discretized_gaussian_log_likelihood(levels.float(), means.float(), log_scales.float())
    big = ref > math.log(1e-4)
    np.testing.assert_allclose(logp32.numpy()[big], ref[big], rtol=1e-3, atol=1e-4)


def test_discretized_gaussian_gradients_match_the_closed_form():
    """d log P / d mean and d log P / d log_scale of the approximate-CDF bin, against their closed forms."""
    x = torch.tensor([-1.0, -0.3, 0.0, 0.2, 1.0], dtype=torch.float64)
    means = torch.tensor([-0.99, -0.31, 0.004, 0.19, 0.995], dtype=torch.float64, requires_grad=True)
    log_scales = torch.tensor([-4.5, -4.0, -5.0, -3.5, -4.2], dtype=torch.float64, requires_grad=True)
    discretized_gaussian_log_likelihood(x, means, log_scales).sum().backward()
    for i, xi in enumerate(x.tolist()):
        m, s = means[i].item(), math.exp(log_scales[i].item())
        u, l = (xi + 1 / 255 - m) / s, (xi - 1 / 255 - m) / s  # du/dm = -1/s, du/dlog_s = -u (same for l)
        fu = 0.0 if xi > 0.999 else _approx_pdf(u)  # an infinite edge contributes no derivative
        fl = 0.0 if xi < -0.999 else _approx_pdf(l)
        cu = 1.0 if xi > 0.999 else _approx_cdf(u)
        cl = 0.0 if xi < -0.999 else _approx_cdf(l)
        prob = cu - cl
        assert means.grad[i].item() == pytest.approx(-(fu - fl) / s / prob, rel=1e-8), f"x={xi}"
        assert log_scales.grad[i].item() == pytest.approx(-(fu * u - fl * l) / prob, rel=1e-8), f"x={xi}"


def test_discretized_gaussian_far_tails_are_floored():
    x = torch.tensor([-1.0, 1.0, 0.0, 1.0])
    means = torch.tensor([0.9, -0.9, 0.9, 1.2])  # three points far in the tail of the decoder, one not
    logp = discretized_gaussian_log_likelihood(x, means, torch.full_like(x, math.log(0.01)))
    torch.testing.assert_close(logp[:3], torch.full((3,), math.log(1e-12)))
    assert logp[3].item() == pytest.approx(_bin_log_prob(1.0, 1.2, 0.01), abs=1e-6)


# --------------------------------------------------------------------------------------------------
# Respacing
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [250, 50, 10, 1])
def test_respacing_keeps_alphas_cumprod_and_map(k):
    d = create_diffusion(k)
    kept = kept_steps(k) if k > 1 else [0]
    assert d.num_timesteps == k
    np.testing.assert_array_equal(d.timestep_map, kept)
    np.testing.assert_allclose(d.alphas_cumprod, ABAR[kept], rtol=1e-12)
    assert d.timestep_map[0] == 0 and (k == 1 or d.timestep_map[-1] == NUM_TIMESTEPS - 1)


def test_space_timesteps_is_the_accumulated_float_stride_for_every_count():
    for k in range(1, NUM_TIMESTEPS + 1):
        assert space_timesteps(NUM_TIMESTEPS, k) == kept_steps(k), f"k={k}"
    # Not round(i * stride): that rule keeps other steps for 278 of the 1000 counts.
    naive = lambda k: sorted({round(i * (999 / (k - 1))) for i in range(k)}) if k > 1 else [0]  # noqa: E731
    assert sum(naive(k) != kept_steps(k) for k in range(1, 1001)) == 278


def test_space_timesteps_hand_checked_values():
    k21 = space_timesteps(1000, 21)  # stride 49.95: ten additions sum to 499.49999999999994, not 499.5
    assert 499 in k21 and 500 not in k21 and len(k21) == 21
    assert space_timesteps(1000, 1000) == list(range(1000))
    k250 = space_timesteps(1000, 250)  # stride 999 / 249 = 4.012...
    assert k250[:6] == [0, 4, 8, 12, 16, 20] and k250[-1] == 999 and len(k250) == 250
    assert space_timesteps(1000, 1) == [0] and space_timesteps(1000, 2) == [0, 999]


def test_respaced_betas_match_the_sequential_definition():
    """beta'_i = 1 - abar_{kept[i]} / abar_{kept[i-1]}, built step by step over the kept set, bit for bit."""
    for spacing in (None, 250, 21, "ddim50"):
        d = create_diffusion(spacing)
        kept = set(d.timestep_map.tolist())
        last, betas, ts = 1.0, [], []
        for t, abar in enumerate(np.cumprod(1.0 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))):
            if t in kept:
                betas.append(1.0 - abar / last)
                last = abar
                ts.append(t)
        np.testing.assert_array_equal(d.betas, np.array(betas))
        np.testing.assert_array_equal(d.timestep_map, ts)
    # All 1000 steps go through the same respacing: within 4e-13 of the linear betas, no float32 change.
    full = create_diffusion()
    np.testing.assert_allclose(full.betas, BETAS, rtol=4e-13)
    assert torch.equal(full.buffer("betas", "cpu"), torch.tensor(BETAS, dtype=torch.float32))


def test_ddim_spacing_uses_the_smallest_integer_stride():
    assert ddim_timesteps(1000, 50) == list(range(0, 1000, 20))
    assert ddim_timesteps(1000, 250) == list(range(0, 1000, 4))
    assert ddim_timesteps(1000, 1000) == list(range(1000))
    assert ddim_timesteps(1000, 3) == [0, 334, 668]  # ceil(1000 / s) = 3 first at s = 334
    d = create_diffusion("ddim50")
    assert d.num_timesteps == 50 and d.timestep_map[-1] == 980
    with pytest.raises(UserError, match="exactly 999 of 1000.*nearest step counts that have one are 500 or 1000"):
        ddim_timesteps(1000, 999)


def test_spacing_strings():
    assert create_diffusion("250").timestep_map.tolist() == kept_steps(250)
    assert create_diffusion("").num_timesteps == 1000
    with pytest.raises(UserError, match="neither a number of sampling steps"):
        create_diffusion("fast")


def test_respacing_rejects_bad_counts():
    for bad in (0, NUM_TIMESTEPS + 1, "ddim0"):
        with pytest.raises(UserError, match="number of sampling steps must be between 1 and 1000") as err:
            create_diffusion(bad)
        assert "--" not in str(err.value)  # shared/ names the setting, not a flag


@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_model_receives_original_timesteps(name):
    seen = []

    def model_fn(x, t):
        seen.append(t.clone())
        return torch.zeros_like(x)

    SAMPLERS[name].fn(create_diffusion(10), model_fn, torch.randn(2, 1, 2, 2))
    assert all(t.dtype == torch.long and t.shape == (2,) for t in seen)
    assert [int(t[0]) for t in seen] == kept_steps(10)[::-1]


# --------------------------------------------------------------------------------------------------
# Model variance and training loss
# --------------------------------------------------------------------------------------------------

def test_p_mean_variance_variance_range():
    d = create_diffusion()
    x, t = torch.randn(3, 2, 2, 2), torch.tensor([0, 1, 700])
    post_var = lambda i: BETAS[i] * (1 - abar_prev(ABAR, i)) / (1 - ABAR[i])  # noqa: E731
    clipped = [post_var(1), post_var(1), post_var(700)]
    large = [post_var(1), BETAS[1], BETAS[700]]
    for v, ref in ((1.0, BETAS[[0, 1, 700]]), (-1.0, clipped), (0.0, np.sqrt(np.array(clipped) * BETAS[[0, 1, 700]]))):
        out = d.p_mean_variance(lambda x, t: torch.cat([torch.zeros_like(x), torch.full_like(x, v)], 1), x, t)
        np.testing.assert_allclose(out["variance"][:, 0, 0, 0].numpy(), ref, rtol=1e-4)
    fixed = d.p_mean_variance(lambda x, t: torch.zeros_like(x), x, t)
    np.testing.assert_allclose(fixed["variance"][:, 0, 0, 0].numpy(), large, rtol=1e-4)
    sqrt_abar = torch.tensor(ABAR[[0, 1, 700]]).float().sqrt().view(3, 1, 1, 1)
    torch.testing.assert_close(fixed["pred_xstart"], x / sqrt_abar)


def _vb_reference(x0, xt, eps, v, t):
    """Float64 L_{t-1} in bits for one sample: KL of Gaussians via Eq. 11 mean, or the t = 0 decoder NLL."""
    x0, xt, eps, v = (a.double() for a in (x0, xt, eps, v))
    beta, ab, abp = BETAS[t], ABAR[t], abar_prev(ABAR, t)
    model_mean = (xt - beta / math.sqrt(1 - ab) * eps) / math.sqrt(1 - beta)  # Ho et al. Eq. 11
    post_var = beta * (1 - abp) / (1 - ab) if t > 0 else BETAS[1] * (1 - ABAR[0]) / (1 - ABAR[1])
    log_var = (v + 1) / 2 * math.log(beta) + (1 - v) / 2 * math.log(post_var)
    if t == 0:
        lo = torch.where(x0 < -0.999, -math.inf, (x0 - 1 / 255 - model_mean) * torch.exp(-0.5 * log_var))
        hi = torch.where(x0 > 0.999, math.inf, (x0 + 1 / 255 - model_mean) * torch.exp(-0.5 * log_var))
        cdf = lambda z: 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))  # noqa: E731 (ADM)
        prob = (cdf(hi) - cdf(lo)).clamp(min=1e-12)
        return -torch.log(prob).mean().item() / math.log(2)
    true_mean = (math.sqrt(abp) * beta * x0 + math.sqrt(1 - beta) * (1 - abp) * xt) / (1 - ab)
    var2 = torch.exp(log_var)
    kl = 0.5 * (torch.log(var2 / post_var) + (post_var + (true_mean - model_mean) ** 2) / var2 - 1)
    return kl.mean().item() / math.log(2)


def test_training_losses_values_for_a_known_model():
    d = create_diffusion()
    g = torch.Generator().manual_seed(1)
    x0 = torch.randint(0, 256, (3, 2, 4, 4), generator=g).float() / 127.5 - 1  # pixel-level data for L_0
    noise, t = torch.randn(3, 2, 4, 4, generator=g), torch.tensor([0, 3, 640])
    out = torch.cat([0.8 * noise + 0.1, torch.rand(3, 2, 4, 4, generator=g) * 2 - 1], 1)  # (3, 4, 4, 4)
    losses = d.training_losses(lambda x, t: out, x0, t, noise=noise)
    assert set(losses) == {"loss", "mse", "vb"} and all(v.shape == (3,) for v in losses.values())
    torch.testing.assert_close(losses["mse"], ((0.2 * noise - 0.1) ** 2).mean(dim=(1, 2, 3)))
    xt = d.q_sample(x0, t, noise)
    for row, step in enumerate(t.tolist()):
        ref = _vb_reference(x0[row], xt[row], out[row, :2], out[row, 2:], step)
        assert losses["vb"][row].item() == pytest.approx(ref, rel=2e-3, abs=1e-5), f"t={step}"
    torch.testing.assert_close(losses["loss"], losses["mse"] + losses["vb"])


def test_vb_gradient_reaches_only_the_variance_channels():
    d = create_diffusion()
    x0, t = torch.rand(4, 2, 3, 3) * 2 - 1, torch.tensor([0, 1, 250, 999])
    param = torch.nn.Parameter(torch.randn(4, 4, 3, 3) * 0.5)
    d.training_losses(lambda x, t: param * 1.0, x0, t)["vb"].sum().backward()
    assert param.grad[:, :2].abs().max().item() == 0.0
    assert (param.grad[:, 2:].abs().flatten(1).amax(1) > 0).all()
    param.grad = None
    d.training_losses(lambda x, t: param * 1.0, x0, t)["mse"].sum().backward()
    assert param.grad[:, 2:].abs().max().item() == 0.0 and param.grad[:, :2].abs().max().item() > 0


def test_fixed_variance_output_trains_on_mse_only():
    d = create_diffusion()
    x0, noise, t = torch.randn(2, 3, 2, 2), torch.randn(2, 3, 2, 2), torch.tensor([5, 900])
    losses = d.training_losses(lambda x, t: torch.zeros_like(x), x0, t, noise=noise)
    torch.testing.assert_close(losses["loss"], (noise**2).mean(dim=(1, 2, 3)))
    assert losses["vb"].abs().max().item() == 0.0


def test_model_kwargs_are_passed_through():
    d = create_diffusion()
    got = {}

    def model_fn(x, t, y, scale):
        got.update(y=y, scale=scale)
        return torch.zeros_like(x)

    d.training_losses(model_fn, torch.randn(2, 1, 2, 2), torch.tensor([1, 2]), model_kwargs={"y": 7, "scale": 2})
    assert got == {"y": 7, "scale": 2}


# --------------------------------------------------------------------------------------------------
# Samplers with an exact denoiser for Gaussian data
# --------------------------------------------------------------------------------------------------

MU, S = 0.7, 0.5  # data x_0 ~ N(MU, S^2) in every coordinate
ABAR_F32 = torch.tensor(ABAR, dtype=torch.float32)


def oracle(v=None):
    """E[eps | x_t] for Gaussian data, at the ORIGINAL timestep t; v adds constant variance channels."""
    def model_fn(x, t):
        ab = ABAR_F32[t].view(-1, 1, 1, 1)
        eps = (1 - ab).sqrt() / (ab * S**2 + 1 - ab) * (x - ab.sqrt() * MU)  # Cov(eps, x_t) / Var(x_t)
        return eps if v is None else torch.cat([eps, torch.full_like(eps, v)], 1)
    return model_fn


def linear_gaussian_reference(k, sampler, v=None, eta=0.0):
    """Exact mean and std of the sampler's output for the oracle: each step is x' = a x + shift + sigma z."""
    ab_k = ABAR[kept_steps(k)]
    m, var = 0.0, 1.0  # x_T ~ N(0, 1)
    for i in reversed(range(k)):
        ab, abp = ab_k[i], (ab_k[i - 1] if i > 0 else 1.0)
        beta = 1 - ab / abp  # the respaced beta
        c = math.sqrt(1 - ab) / (ab * S**2 + 1 - ab)
        b = c * math.sqrt(ab) * MU  # the oracle is eps = c x - b
        if sampler == "ddim":  # x' = sqrt(abp) x0_hat + sqrt(1 - abp - sigma^2) eps + sigma z (Song et al. Eq. 12)
            sigma2 = eta**2 * (1 - abp) / (1 - ab) * (1 - ab / abp)
            d = math.sqrt(1 - abp - sigma2)
            a = math.sqrt(abp / ab) * (1 - math.sqrt(1 - ab) * c) + d * c
            shift = (math.sqrt(abp / ab) * math.sqrt(1 - ab) - d) * b
        else:  # x' = (x - beta / sqrt(1 - ab) eps) / sqrt(1 - beta) + sigma z (Ho et al. Eq. 11)
            a = (1 - beta / math.sqrt(1 - ab) * c) / math.sqrt(1 - beta)
            shift = beta / math.sqrt(1 - ab) * b / math.sqrt(1 - beta)
            f = 1.0 if v is None else (v + 1) / 2  # C channels: fixed large, beta_t for t > 0
            post = beta * (1 - abp) / (1 - ab)
            sigma2 = math.exp(f * math.log(beta) + (1 - f) * math.log(post)) if i > 0 else 0.0
        m, var = a * m + shift, a * a * var + sigma2
    return m, math.sqrt(var)


# Data-std tolerance: 100-250 DDPM steps are within 2%; 50 DDIM steps shrink the std (discretisation, as the
# exact reference shows): ~6% at eta 0, ~12% at eta 1 (the small posterior variance).
@pytest.mark.parametrize("sampler,k,v,eta,std_rel", [("ddpm", 250, None, None, 0.03), ("ddpm", 100, 0.0, None, 0.03),
                                                     ("ddim", 50, None, 0.0, 0.08), ("ddim", 50, 0.0, 1.0, 0.15)])
def test_oracle_sampling_recovers_the_data_distribution(sampler, k, v, eta, std_rel):
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(4000, 1, 2, 2, generator=g)  # 16,000 independent coordinates
    x = SAMPLERS[sampler].fn(create_diffusion(k), oracle(v), noise, generator=g, eta=eta)
    ref_mean, ref_std = linear_gaussian_reference(k, sampler, v, eta or 0.0)
    # Exact propagation: only Monte Carlo error (std/sqrt(n) = 0.004 on the mean, 0.003 on the std).
    assert x.mean().item() == pytest.approx(ref_mean, abs=0.015)
    assert x.std().item() == pytest.approx(ref_std, abs=0.012)
    assert x.mean().item() == pytest.approx(MU, abs=0.02)
    assert x.std().item() == pytest.approx(S, rel=std_rel)


# --------------------------------------------------------------------------------------------------
# Determinism and per-row generators
# --------------------------------------------------------------------------------------------------

def _row_gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("sampler,eta", [(ddpm_sample, None), (ddim_sample, 1.0)])
def test_same_generators_give_same_samples(sampler, eta):
    d, noise = create_diffusion(20), torch.randn(3, 2, 2, 2)
    a = sampler(d, oracle(0.3), noise, generator=torch.Generator().manual_seed(5), eta=eta)
    b = sampler(d, oracle(0.3), noise, generator=torch.Generator().manual_seed(5), eta=eta)
    c = sampler(d, oracle(0.3), noise, generator=torch.Generator().manual_seed(6), eta=eta)
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize("sampler,eta", [(ddpm_sample, None), (ddim_sample, 1.0), (ddim_sample, 0.0)])
def test_per_row_generators_do_not_depend_on_batch_composition(sampler, eta):
    d = create_diffusion(20)
    noise = torch.stack([torch.randn(2, 2, 2, generator=g) for g in _row_gens([10, 11, 12, 13])])
    whole = sampler(d, oracle(), noise, generator=_row_gens([0, 1, 2, 3]), eta=eta)
    first = sampler(d, oracle(), noise[:2], generator=_row_gens([0, 1]), eta=eta)
    second = sampler(d, oracle(), noise[2:], generator=_row_gens([2, 3]), eta=eta)
    torch.testing.assert_close(whole, torch.cat([first, second]), rtol=0, atol=1e-6)
    assert not torch.allclose(whole[0], whole[1])


def test_last_ddpm_step_adds_no_noise():
    """With one step (t = 0 only) the output is the model's x_0, whatever the generator draws."""
    d, noise = create_diffusion(1), torch.randn(2, 1, 2, 2)
    a = ddpm_sample(d, oracle(), noise, generator=torch.Generator().manual_seed(0))
    b = ddpm_sample(d, oracle(), noise, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    ab0 = torch.tensor(ABAR[0])
    eps = (1 - ab0).sqrt() / (ab0 * S**2 + 1 - ab0) * (noise.double() - ab0.sqrt() * MU)
    torch.testing.assert_close(a.double(), (noise.double() - (1 - ab0).sqrt() * eps) / ab0.sqrt(), rtol=1e-4, atol=1e-4)


def test_sampler_argument_errors():
    d, noise = create_diffusion(5), torch.randn(2, 1, 2, 2)
    with pytest.raises(UserError, match="only to the ddim sampler") as err:
        ddpm_sample(d, oracle(), noise, eta=0.5)
    assert "--" not in str(err.value)
    with pytest.raises(UserError, match=r"eta must lie in \[0, 1\]") as err:
        ddim_sample(d, oracle(), noise, eta=1.5)
    assert "--" not in str(err.value)
    with pytest.raises(ValueError, match="one per row"):
        ddpm_sample(d, oracle(), noise, generator=_row_gens([0, 1, 2]))
    with pytest.raises(ValueError, match="expected C or 2C"):
        ddim_sample(d, lambda x, t: torch.cat([x, x, x], 1), noise)


def test_sampler_vocabulary():
    """One registry of records: each sampler's function and the objectives it serves; others refused by name."""
    assert sampler_names() == ("ddpm", "ddim", "dpmpp-2m", "unipc", "euler", "heun", "sde", "dopri5", "meanflow") == tuple(SAMPLERS)
    assert get_sampler("ddim").fn is ddim_sample and get_sampler("ddpm").fn is ddpm_sample
    assert [n for n in sampler_names() if SAMPLERS[n].family == "ddpm"] == ["ddpm", "ddim", "dpmpp-2m", "unipc"]
    with pytest.raises(ChoiceError) as err:
        get_sampler("bogus")
    assert (err.value.setting, err.value.value, err.value.choices) == ("sampler", "bogus", list(sampler_names()))
    assert "--" not in str(err.value) and "ddpm, ddim, dpmpp-2m, unipc, euler" in str(err.value)
    assert "--sampler 'bogus'" in str(err.value.advise("--sampler"))  # the CLI turns it into flag advice
    with pytest.raises(SettingError) as err:
        get_sampler("euler", "ddpm")  # a flow sampler for a DDPM model
    advice = err.value.phrase({"sampler": "--sampler"})
    assert "--sampler euler samples flow models" in advice and "ddpm, ddim, dpmpp-2m, unipc" in advice


def test_custom_schedule_runs():
    d = GaussianDiffusion(np.linspace(1e-3, 0.2, 20))
    x = ddpm_sample(d, lambda x, t: torch.zeros_like(x), torch.randn(2, 1, 2, 2))
    assert x.shape == (2, 1, 2, 2) and torch.isfinite(x).all()
