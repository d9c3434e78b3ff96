"""DiT's objective "ddpm": Gaussian diffusion with a linear schedule, eps + learned-range variance loss, respacing,
and its four samplers (DDPM, DDIM; DPM-Solver++ and UniPC from shared/generative/solvers.py), registered at the end.

Ho et al. 2020 (DDPM), Nichol & Dhariwal 2021 ("IDDPM"), Song et al. 2021 (DDIM). Numerically as the official DiT
`diffusion/` package (from ADM): its tanh normal CDF in the t = 0 decoder NLL, its accumulated-stride respacing, its
respaced betas even for all 1000 steps. Models see nothing of the schedule but the timestep.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from shared.generative.objectives import register_objective
from shared.generative.samplers import DDIM_ETA, SamplerSpec, check_ddim_eta, get_sampler, register_sampler
from shared.generative.solvers import dpmpp_2m_sample, refuse_eta, unipc_sample
from shared.runtime.errors import SettingError, UserError

NUM_TIMESTEPS = 1000


def linear_betas(num_timesteps: int = NUM_TIMESTEPS) -> np.ndarray:
    """Ho et al. 2020 linear schedule, 1e-4 -> 0.02 at 1000 steps (float64)."""
    scale = 1000 / num_timesteps  # keeps the total noise level when T differs from 1000
    return np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64)


def normal_kl(mean1, logvar1, mean2, logvar2):
    """Elementwise KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_std_normal_cdf(x):
    """Standard normal CDF by the tanh approximation ADM and DiT use: 0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    # Not Phi (error up to 1.8e-4, thinner tails), but still a CDF, so the 256 bins sum to 1.
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """Log-probability of data x in [-1, 1] on 256 levels under N(means, e^(2 log_scales)) (Ho et al. Eq. 13)."""
    inv_std = torch.exp(-log_scales)
    cdf_upper = approx_std_normal_cdf((x - means + 1.0 / 255.0) * inv_std)  # at the standardised bin edges
    cdf_lower = approx_std_normal_cdf((x - means - 1.0 / 255.0) * inv_std)
    prob = torch.where(x < -0.999, cdf_upper, torch.where(x > 0.999, 1.0 - cdf_lower, cdf_upper - cdf_lower))
    # Floor at 1e-12 (as ADM) so one far-off pixel costs at most ~27.6 nats and cannot swamp the loss.
    return torch.log(prob.clamp(min=1e-12))


def mean_flat(x):
    """Mean over all non-batch dimensions: (N, ...) -> (N,)."""
    return x.mean(dim=tuple(range(1, x.ndim)))


class GaussianDiffusion:
    """A discrete Gaussian diffusion over num_timesteps steps, possibly a respaced subset of 1000."""
    def __init__(self, betas: np.ndarray, timestep_map: np.ndarray | None = None):
        self.betas = betas = np.asarray(betas, dtype=np.float64)
        assert betas.ndim == 1 and ((betas > 0) & (betas <= 1)).all(), "betas: a 1-D array with values in (0, 1]"
        self.num_timesteps = len(betas)
        self.timestep_map = np.arange(len(betas)) if timestep_map is None else np.asarray(timestep_map)
        self.alphas_cumprod = np.cumprod(1.0 - betas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1.0)
        # Posterior q(x_{t-1} | x_t, x_0), Ho et al. Eq. 6-7.
        denom = 1.0 - self.alphas_cumprod
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / denom
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / denom
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(1.0 - betas) / denom
        # beta~_0 = 0, so its log is replaced by beta~_1 (ADM's clipping); beta_0 by beta~_1 ("fixed large").
        first = self.posterior_variance[1] if len(betas) > 1 else betas[0]
        self.posterior_log_variance_clipped = np.log(np.append(first, self.posterior_variance[1:]))
        self.fixed_large_log_variance = np.log(np.append(first, betas[1:]))
        self.log_betas = np.log(betas)
        self._device_buffers = {}  # (name, device) -> tensor, so each step gathers without host copies

    def buffer(self, name: str, device) -> torch.Tensor:
        """The float64 schedule array `name` as a float32 tensor on device (timestep_map stays int64), cached."""
        key = (name, torch.device(device))
        if key not in self._device_buffers:
            arr = torch.from_numpy(getattr(self, name))
            # Cast on the host: the float64 buffers stay exact there, and some devices lack float64.
            self._device_buffers[key] = (arr.long() if name == "timestep_map" else arr.float()).to(device)
        return self._device_buffers[key]

    def at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Schedule array `name` at indices t (N,), shaped (N, 1, ..., 1) on like's device to broadcast."""
        return self.buffer(name, t.device)[t].to(like.device).view(-1, *([1] * (like.ndim - 1)))

    def q_sample(self, x0, t, noise):
        """Draw x_t ~ q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I) (Ho et al. Eq. 4)."""
        return self.at("sqrt_alphas_cumprod", t, x0) * x0 + self.at("sqrt_one_minus_alphas_cumprod", t, x0) * noise

    def q_posterior_mean_variance(self, x0, xt, t):
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x_0) (Ho et al. Eq. 6-7)."""
        mean = self.at("posterior_mean_coef1", t, xt) * x0 + self.at("posterior_mean_coef2", t, xt) * xt
        return mean, self.at("posterior_variance", t, xt), self.at("posterior_log_variance_clipped", t, xt)

    def model_timesteps(self, t):
        """Map indices into this (respaced) process to the original timesteps the model was trained on."""
        return self.buffer("timestep_map", t.device)[t]

    def split_output(self, out, x, t):
        """(eps, log_variance) from a model output of 2C channels (learned range) or C channels (fixed large)."""
        channels = x.shape[1]
        out = out.float()  # losses and sampling steps in fp32 even when the model ran under autocast
        if out.shape[1] == channels:
            return out, self.at("fixed_large_log_variance", t, x).expand_as(x)
        if out.shape[1] != 2 * channels:
            raise ValueError(f"model returned {out.shape[1]} channels for {channels}-channel x; expected C or 2C")
        eps, v = out.split(channels, dim=1)  # (N, C, H, W) each
        # IDDPM Eq. 15: log Sigma = f log beta_t + (1 - f) log beta~_t, with f = (v + 1) / 2 in [0, 1].
        frac = (v + 1) / 2
        return eps, frac * self.at("log_betas", t, x) + (1 - frac) * self.at("posterior_log_variance_clipped", t, x)

    def p_mean_variance(self, model_fn, x, t, model_kwargs=None):
        """p(x_{t-1} | x_t): mean, variance, log_variance, pred_xstart (and eps) from one model call."""
        return self._p_from_output(model_fn(x, self.model_timesteps(t), **(model_kwargs or {})), x, t)

    def _p_from_output(self, out, x, t):
        """p(x_{t-1} | x_t) from a model output; the mean is the posterior mean at pred_xstart (= Ho Eq. 11)."""
        eps, log_var = self.split_output(out, x, t)
        # x_0 from x_t and eps by inverting Ho et al. Eq. 4 (no clipping of x_0, as DiT).
        pred_xstart = (self.at("sqrt_recip_alphas_cumprod", t, x) * x
                       - self.at("sqrt_recipm1_alphas_cumprod", t, x) * eps)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {"mean": mean, "variance": log_var.exp(), "log_variance": log_var,
                "pred_xstart": pred_xstart, "eps": eps}

    def training_losses(self, model_fn, x0, t, model_kwargs=None, noise=None) -> dict:
        """L_hybrid (IDDPM Eq. 16): MSE on eps plus the VLB term that trains only the variance; each (N,)."""
        noise = torch.randn_like(x0) if noise is None else noise
        xt = self.q_sample(x0, t, noise)
        out = model_fn(xt, self.model_timesteps(t), **(model_kwargs or {}))
        channels = x0.shape[1]
        mse = mean_flat((noise - out[:, :channels].float()) ** 2)  # L_simple, Ho et al. Eq. 14
        if out.shape[1] == channels:
            return {"loss": mse, "mse": mse, "vb": torch.zeros_like(mse)}
        # Stop-gradient on the mean: L_vlb trains Sigma only, L_simple trains the mean (IDDPM Sec. 3.1).
        frozen = torch.cat([out[:, :channels].detach(), out[:, channels:]], dim=1)  # (N, 2C, H, W)
        # Per-sample L_{t-1} (KL to the true posterior) or, at t = 0, the decoder NLL L_0, in bits (Ho Eq. 5); the
        # unscaled per-step vb equals IDDPM's lambda = 0.001 times the T = 1000 sum L_vlb.
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x0, xt, t)
        p = self._p_from_output(frozen, xt, t)
        kl = mean_flat(normal_kl(true_mean, true_log_var, p["mean"], p["log_variance"])) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, p["mean"], 0.5 * p["log_variance"])
        vb = torch.where(t == 0, mean_flat(nll) / math.log(2.0), kl)
        return {"loss": mse + vb, "mse": mse, "vb": vb}


def space_timesteps(num_timesteps: int, count: int) -> list[int]:
    """`count` evenly spaced steps of range(num_timesteps), first and last included (ADM, one section)."""
    # As ADM: the float stride is summed step by step, each sum rounded half to even (21 steps keep 499, not 500).
    stride = (num_timesteps - 1) / (count - 1) if count > 1 else 1
    return sorted({round(position) for position in accumulate([stride] * (count - 1), initial=0.0)})


def ddim_timesteps(num_timesteps: int, count: int) -> list[int]:
    """range(0, T, s) with the smallest integer stride s in [1, T) that yields exactly `count` steps (DDIM paper)."""
    # ADM's "ddimN": the last step is T - s, and only some counts exist. Attainable count -> smallest stride (the
    # strides run down, so a smaller one overwrites a larger).
    counts = {len(range(0, num_timesteps, stride)): stride for stride in range(num_timesteps - 1, 0, -1)}
    if count not in counts:
        below = max((c for c in counts if c < count), default=None)
        above = min((c for c in counts if c > count), default=None)
        near = " or ".join(str(c) for c in (below, above) if c is not None)
        raise UserError(f"No integer stride takes exactly {count} of {num_timesteps} diffusion steps (DDIM "
                        f"striding); the nearest step counts that have one are {near}.")
    return list(range(0, num_timesteps, counts[count]))


def linspace_timesteps(num_timesteps: int, count: int) -> list[int]:
    """diffusers' "linspace" spacing: round(linspace(0, T - 1, count + 1)) without its 0, i.e. `count` steps."""
    # The ODE solvers step from the smallest kept timestep straight to clean data: no model call at t = 0.
    if count > num_timesteps - 1:
        raise UserError(f"The linspace spacing of the ODE solvers has at most {num_timesteps - 1} distinct steps "
                        f"above t = 0; take at most {num_timesteps - 1} sampling steps with them (20-25 are "
                        f"typical).")
    points = np.linspace(0, num_timesteps - 1, count + 1).round().astype(np.int64)  # (count + 1,), numpy's rounding
    return points[1:].tolist()


def kept_timesteps(spacing: int | str | None, num_timesteps: int = NUM_TIMESTEPS) -> list[int]:
    """Original timesteps kept for `spacing`: None = all, a count K (int or "K"), "ddimK" or "linspaceK"."""
    if spacing is None or spacing == "":
        return list(range(num_timesteps))
    prefix = next((p for p in ("ddim", "linspace") if isinstance(spacing, str) and spacing.startswith(p)), "")
    text = spacing[len(prefix):] if prefix else spacing
    if not (isinstance(text, int) or (isinstance(text, str) and text.strip().isdigit())):
        raise UserError(f"Timestep spacing {spacing!r} is neither a number of sampling steps (e.g. 250) nor "
                        f"'ddim' or 'linspace' followed by one (e.g. ddim50, linspace20).")
    if not 1 <= int(text) <= num_timesteps:
        raise UserError(f"Cannot take {int(text)} sampling steps from a {num_timesteps}-step diffusion; the number "
                        f"of sampling steps must be between 1 and {num_timesteps} (DiT uses 250 for DDPM).")
    rule = {"ddim": ddim_timesteps, "linspace": linspace_timesteps, "": space_timesteps}[prefix]
    return rule(num_timesteps, int(text))


def create_diffusion(num_sampling_steps: int | str | None = None) -> GaussianDiffusion:
    """The DiT diffusion: linear betas over NUM_TIMESTEPS, respaced to num_sampling_steps (see kept_timesteps)."""
    kept = kept_timesteps(num_sampling_steps)  # as DiT, all 1000 steps are respaced too (betas differ < 4e-13)
    kept_acp = np.cumprod(1.0 - linear_betas(NUM_TIMESTEPS))[kept]
    # Betas whose products equal abar at the kept steps (IDDPM Sec. 4): 1 - abar_{kept[i]} / abar_{kept[i-1]}.
    return GaussianDiffusion(1.0 - kept_acp / np.append(1.0, kept_acp[:-1]), timestep_map=np.array(kept))


def randn_rows(like: torch.Tensor, generator=None) -> torch.Tensor:
    """Standard normal noise shaped like `like`; with a list of generators row i comes from generator i."""
    if generator is None:
        return torch.randn_like(like, dtype=torch.float32)
    if isinstance(generator, torch.Generator):
        return torch.randn(like.shape, generator=generator, device=generator.device).to(like.device)
    if len(generator) != like.shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {like.shape[0]} rows; pass one per row")
    rows = [torch.randn(like.shape[1:], generator=g, device=g.device) for g in generator]  # (C, H, W) each
    # One copy of the stacked rows, not one per row: CPU generators feed a GPU batch at every DDPM step.
    return torch.stack([row.to(rows[0].device) for row in rows]).to(like.device)  # (N, C, H, W)


@torch.no_grad()
def ddpm_sample(diffusion, model_fn, noise, model_kwargs=None, generator=None, progress=False, eta=None):
    """Ancestral sampling x_{t-1} = mean + sigma_t z (Ho et al. Alg. 2) from x_T = noise; returns x_0."""
    refuse_eta(eta, "ddpm", "draws its noise from the model's learned variance")
    x = noise.float()
    for i in tqdm(range(diffusion.num_timesteps - 1, -1, -1), desc="ddpm", disable=not progress, leave=False):
        t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)  # (N,), T-1 down to 0
        p = diffusion.p_mean_variance(model_fn, x, t, model_kwargs)
        x = p["mean"]
        if i > 0:  # the last step returns the mean, no noise
            x = x + torch.exp(0.5 * p["log_variance"]) * randn_rows(x, generator)
    return x


@torch.no_grad()
def ddim_sample(diffusion, model_fn, noise, model_kwargs=None, generator=None, progress=False, eta=0.0):
    """DDIM (Song et al. Eq. 12) from x_T = noise; eta = 0 deterministic, eta = 1 DDPM-like; returns x_0."""
    eta = check_ddim_eta(0.0 if eta is None else eta)
    # Song et al. Eq. 16: sigma_t(eta) = eta * sqrt(beta~_t), the posterior std; float64 per-step scalars.
    sigmas = eta * np.sqrt(diffusion.posterior_variance)
    abar_prev = diffusion.alphas_cumprod_prev
    x = noise.float()
    for i in tqdm(range(diffusion.num_timesteps - 1, -1, -1), desc="ddim", disable=not progress, leave=False):
        t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)  # (N,), T-1 down to 0
        p = diffusion.p_mean_variance(model_fn, x, t, model_kwargs)
        # Eq. 12: x_{t-1} = sqrt(abar_{t-1}) x0 + sqrt(1 - abar_{t-1} - sigma_t^2) eps + sigma_t z.
        direction = math.sqrt(max(1.0 - abar_prev[i] - sigmas[i] ** 2, 0.0))
        x = math.sqrt(abar_prev[i]) * p["pred_xstart"] + direction * p["eps"]
        if sigmas[i] > 0:
            x = x + float(sigmas[i]) * randn_rows(x, generator)
    return x


for _spec in (
    SamplerSpec("ddpm", ddpm_sample, "ddpm", "ancestral DDPM, DiT's respacing (250 steps as the paper)",
                deterministic=False),
    SamplerSpec("ddim", ddim_sample, "ddpm", "DDIM (eta 0 deterministic), DiT's respacing", options=(DDIM_ETA,)),
    SamplerSpec("dpmpp-2m", dpmpp_2m_sample, "ddpm", "DPM-Solver++(2M) ODE solver, linspace spacing (10-25 steps)",
                spacing="linspace"),
    SamplerSpec("unipc", unipc_sample, "ddpm", "UniPC-2 (bh2) ODE solver, linspace spacing (10-25 steps)",
                spacing="linspace"),
):
    register_sampler(_spec)


@register_objective
@dataclass
class DDPMObjective:
    """DiT's diffusion: eps + learned-range variance, L_hybrid, t uniform in {0..999} (IDDPM Eq. 16)."""
    name: ClassVar[str] = "ddpm"
    help: ClassVar[str] = "DiT: DDPM, eps + learned variance, 1000 steps"
    family: ClassVar[str] = "ddpm"
    default_sampler: ClassVar[str] = "ddpm"
    fast_sampler: ClassVar[str] = "ddim"  # deterministic, so previews of successive checkpoints are comparable
    level_range: ClassVar[tuple[float, float]] = (0.0, float(NUM_TIMESTEPS))  # DiT timesteps (0 = data)
    level_unit: ClassVar[str] = f"DiT timesteps (0 = data, {NUM_TIMESTEPS} = noise)"
    learns_sigma: ClassVar[bool] = True  # the VLB term trains the variance (Nichol & Dhariwal 2021, Eq. 15)

    @cached_property
    def diffusion(self) -> GaussianDiffusion:
        """DiT's 1000-step diffusion (built on first use: a model config builds objectives only to check them)."""
        return create_diffusion()

    def draw_time(self, generator: torch.Generator) -> torch.Tensor:
        """One training timestep (1,) int64, uniform over all NUM_TIMESTEPS (the first draw of a sample)."""
        return torch.randint(0, NUM_TIMESTEPS, (1,), generator=generator)

    def training_losses(self, model_fn, x0, t, noise, model_kwargs=None) -> dict:
        """{"loss", "mse", "vb"}, each (N,): x0 (N,C,h,w) clean latents, t (N,) int64, noise like x0."""
        return self.diffusion.training_losses(model_fn, x0, t, model_kwargs=model_kwargs, noise=noise)

    def noise_level(self, model_t: torch.Tensor) -> torch.Tensor:
        """The guidance-interval level of a network input: the DiT timestep itself."""
        return model_t.float()

    def process(self, sampler: str, steps: int, options: dict) -> GaussianDiffusion:
        """The respaced diffusion `sampler` walks with `steps` model calls (its spacing from the registry)."""
        spec = get_sampler(sampler, self)
        if not 1 <= steps <= NUM_TIMESTEPS:
            raise SettingError(f"{{sampling steps}} {steps} must lie in [1, {NUM_TIMESTEPS}] for a DDPM model (250 "
                               f"as the DiT paper; DDIM often uses 50).")
        return create_diffusion(f"{spec.spacing}{steps}")  # UserError for a count its spacing cannot take

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Draw data latents from `noise` (N,C,h,w) with sampler `sampler` (a registry name) and its options."""
        spec = get_sampler(sampler, self)
        extra = {"eta": options["ddim_eta"]} if "ddim_eta" in options else {}
        return spec.fn(self.process(sampler, steps, options), model_fn, noise, model_kwargs, generator, progress,
                       **extra)
