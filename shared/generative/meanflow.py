"""MeanFlow (Geng, Deng, Bai, Kolter, He 2025, "Mean Flows for One-step Generative Modeling", arXiv 2505.13447):
the average velocity on the linear path, its training target by a Jacobian-vector product, and its sampler.

The paper (time 1 = noise) predicts u(z_t, r, t) = 1/(t - r) int_r^t v ds with target u_tgt = v - (t - r) du/dt under
stop-gradient and step z_r = z_t - (t - r) u (Alg. 2). Here in SiT's time (tau = 1 - t, v = x1 - eps, ubar = -u) an
interval (tau, h = t - r) gives ubar = v + h d ubar / d tau with tangents (dx, d tau, d h) = (v, 1, -1), and one step
x_{tau + h} = x_tau + h ubar. The network takes (its convention's time of tau, h) as an (N, 2) time input; at h = 0
it is a flow model.
"""
from __future__ import annotations

import torch
from torch.func import jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.generative.flow import FlowPath, FlowProcess, _points, _tau
from shared.generative.samplers import TIME_SHIFT, SamplerSpec, register_sampler

PAIR_SAMPLINGS = ("lognormal", "uniform")  # the paper's ablation: logit-normal (its choice) or uniform


def in_sit_sign(path: FlowPath, out: torch.Tensor, channels: int) -> torch.Tensor:
    """The first `channels` of a network output (N, C', h, w) in SiT's sign, fp32 at least (float64 stays)."""
    u = out[:, :channels].to(torch.promote_types(out.dtype, torch.float32))  # (N, C, h, w)
    return u if path.convention == "sit" else -u


def average_velocity(path: FlowPath, model_fn, x: torch.Tensor, tau: torch.Tensor, h: torch.Tensor,
                     model_kwargs: dict | None) -> torch.Tensor:
    """ubar(x, tau, h) in SiT's sign from one network call: x (N,C,h,w), tau and h (N,) -> (N,C,h,w), fp32 at least."""
    t = torch.stack([path.model_time(tau), h], dim=1)  # (N, 2): its convention's time of tau, and h = t - r
    return in_sit_sign(path, model_fn(x, t, **(model_kwargs or {})), x.shape[1])


def draw_pair(generator: torch.Generator, sampling: str, mu: float, sigma: float, fraction: float) -> torch.Tensor:
    """One training interval (1, 2) float32 [tau, h] from `generator`, as the paper's sample_tr."""
    # The official code sets r = t on a fixed share of each batch; here each sample tosses its own coin (keyed by its
    # stream position like every draw), so the share holds in expectation and resume stays bitwise.
    assert sampling in PAIR_SAMPLINGS, sampling  # the objectives refuse another with a ChoiceError
    pair = (torch.sigmoid(mu + sigma * torch.randn(2, generator=generator)) if sampling == "lognormal"
            else torch.rand(2, generator=generator))  # (2,) paper times
    t, r = pair.max(), pair.min()
    h = (t - r) if bool(torch.rand(1, generator=generator)[0] < fraction) else torch.zeros(())  # r != t for this sample
    return torch.stack([1 - t, h]).view(1, 2)  # (1, 2): SiT time of z, interval length


def rows_of(model_kwargs: dict, rows: torch.Tensor) -> dict:
    """model_kwargs for the batch rows `rows` (M,): every (N, ...) tensor indexed."""
    return {k: v[rows] if torch.is_tensor(v) else v for k, v in model_kwargs.items()}


def cond_and_null(model_kwargs: dict) -> dict:
    """model_kwargs for the batch [rows; rows]: every (N, ...) tensor repeated, the second copy's labels dropped."""
    dropped = model_kwargs["force_drop_ids"].to(torch.bool)  # (N,)
    both = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in model_kwargs.items()}
    return dict(both, force_drop_ids=torch.cat([torch.zeros_like(dropped), torch.ones_like(dropped)]))


@torch.no_grad()
def guided_velocity(path: FlowPath, model_fn, x, tau, v, model_kwargs: dict, omega: float, kappa: float,
                    levels: tuple[float, float]) -> torch.Tensor:
    """The paper's guided field (its CFG target with mixing scale kappa; the JAX code's guidance_fn), stop-gradient."""
    # v_g = omega v + kappa u(z, t, t | c) + (1 - omega - kappa) u(z, t, t | null) where lo <= t <= hi, else v (and
    # on rows whose label was dropped, as the official cond_drop); u(z, t, t) is the network at h = 0.
    dropped = model_kwargs["force_drop_ids"].to(torch.bool)  # (N,)
    level = 1 - tau  # (N,) the paper's t = the noise level
    inside = (level >= levels[0]) & (level <= levels[1]) & ~dropped  # (N,)
    if not bool(inside.any()):
        return v
    zero = torch.zeros_like(tau)
    if kappa == 0:
        null = dict(model_kwargs, force_drop_ids=torch.ones_like(dropped))
        guided = omega * v + (1 - omega) * average_velocity(path, model_fn, x, tau, zero, null)
    else:
        u_cond, u_null = average_velocity(path, model_fn, torch.cat([x, x]), torch.cat([tau, tau]),
                                          torch.cat([zero, zero]), cond_and_null(model_kwargs)).chunk(2)  # (N, C, h, w)
        guided = omega * v + (1 - omega - kappa) * u_null + kappa * u_cond
    return torch.where(inside.view(-1, *([1] * (v.ndim - 1))), guided, v)  # (N, C, h, w)


@torch.no_grad()
def average_and_derivative(path: FlowPath, model_fn, x, tau, h, tangent, model_kwargs: dict):
    """(ubar, d ubar / d tau) at (x, tau, h): one forward-mode JVP with tangents (tangent, 1, -1), no autograd."""
    ones = torch.ones_like(tau)
    # SDPA's math kernel: torch 2.13's fused CPU kernel has no forward mode (CUDA's were not checked), nor has xformers.
    with sdpa_kernel([SDPBackend.MATH]):
        return jvp(lambda x_, tau_, h_: average_velocity(path, model_fn, x_, tau_, h_, model_kwargs), (x, tau, h),
                   (tangent, ones, -ones))


def adaptive_weight(sq: torch.Tensor, p: float, c: float) -> torch.Tensor:
    """The paper's adaptive loss weight w = 1 / (||Delta||^2 + c)^p, stop-gradient; sq (N,) float32."""
    return 1.0 / (sq.detach() + c) ** p


def meanflow_losses(path: FlowPath, model_fn, x1, t, noise, model_kwargs: dict, *, omega: float, kappa: float,
                    levels: tuple[float, float], p: float, c: float) -> dict:
    """{"loss", "sq", "v_sq"} (N,): sg(w) ||ubar - sg(u_tgt)||^2 summed over elements, ||Delta||^2, ||ubar - v||^2."""
    # The forward the gradient flows through runs last, so a wrapper keeping something from it (REPA) keeps its.
    tau, h = t[:, 0], t[:, 1]  # (N,) each
    s = tau.view(-1, *([1] * (x1.ndim - 1))).to(x1.dtype)  # (N, 1, 1, 1)
    x = s * x1 + (1 - s) * noise  # (N, C, h, w)
    v = x1 - noise  # (N, C, h, w): d x_tau / d tau
    if omega != 1.0 or kappa != 0.0:
        v = guided_velocity(path, model_fn, x, tau, v, model_kwargs, omega, kappa, levels)
    target = v.clone()  # (N, C, h, w): u_tgt = v_g where r = t (h = 0: no derivative term)
    rows = (h > 0).nonzero().flatten()  # (M,) the samples with r != t: only they need the JVP (the paper's 25%)
    if len(rows):
        _, derivative = average_and_derivative(path, model_fn, x[rows], tau[rows], h[rows], v[rows],
                                               rows_of(model_kwargs, rows))  # (M, C, h, w)
        target[rows] += h[rows].view(-1, *([1] * (x.ndim - 1))).to(v.dtype) * derivative.to(v.dtype)
    pred = average_velocity(path, model_fn, x, tau, h, model_kwargs)  # with autograd
    sq = ((pred - target.to(pred.dtype).detach()) ** 2).flatten(1).sum(1)  # (N,)
    v_sq = ((pred.detach() - (x1 - noise)) ** 2).flatten(1).sum(1)  # (N,)
    return {"loss": adaptive_weight(sq, p, c) * sq, "sq": sq.detach(), "v_sq": v_sq}


@torch.no_grad()
def meanflow_sample(process: FlowProcess, model_fn, noise, model_kwargs=None, generator=None, progress=False):
    """x_{tau'} = x_tau + (tau' - tau) ubar(x_tau, tau, tau' - tau) over the grid (Alg. 2); one call per step."""
    x = noise.to(torch.promote_types(noise.dtype, torch.float32))  # fp32 at least; float64 noise stays
    for i, t0, t1 in _points(process, progress, "meanflow"):
        start = _tau(process.model_times[i], x)  # (N,) float64, the convention's own time of the grid point
        h = _tau(t1 - t0, x)  # (N,) float64
        out = model_fn(x, torch.stack([start, h], dim=1), **(model_kwargs or {}))  # (N, C', h, w)
        x = x + (t1 - t0) * in_sit_sign(process.path, out, x.shape[1]).to(x.dtype)
    return x


register_sampler(SamplerSpec(
    "meanflow", meanflow_sample, "meanflow", "MeanFlow's average-velocity jumps over K uniform (or time-shifted) "
    "intervals, one call each: 1 step z0 = z1 - u(z1, 0, 1), 2 as the paper's 2-NFE; a model trained with "
    "--cfg-omega/--cfg-kappa has its guidance folded in: sample it with --cfg-scale 1, one call per step",
    options=(TIME_SHIFT,)))
