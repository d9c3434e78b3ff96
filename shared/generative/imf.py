"""Improved MeanFlow (Geng et al. 2025, arXiv 2512.02012): the MeanFlow identity as a loss on the instantaneous
velocity, and classifier-free guidance as conditioning chosen at sampling time.

Paper's time (t = 1 noise): the network predicts u(z_t, r, t); V = u + (t - r) sg(du/dt) is regressed onto a target
free of its own derivative (the v-loss, the release's iMeanFlow.forward), du/dt the JVP along v(z_t, t) = u(z_t, t, t)
(no auxiliary v-head). Guided target v_g = v + (1 - 1/w)(v_c - v_u), v_c at scale w, v_u null-class at w = 1 (fixed
point: the CFG field w v(c) + (1 - w) v(null)); w log-uniform in [1, w_max], t_min ~ U(0, 1/2), t_max ~ U(1/2, 1)
(the release's sample_cfg_scale / sample_cfg_interval), fed beside (t, t - r): one call per step at any w.
In SiT's time (tau = 1 - t, v = x1 - eps, ubar = -u; as meanflow.py): V = ubar - h d ubar / d tau, tangents (v_c, 1,
-1); the network's time input (N, 5) is its convention's time of tau, h = t - r, then (1 - 1/w, t_min, t_max).
"""
from __future__ import annotations

import math

import torch

from shared.generative.flow import FlowPath
from shared.generative.meanflow import (adaptive_weight, average_and_derivative, average_velocity, cond_and_null,
                                        rows_of)

INTERVAL_SPLIT = 0.5  # t_min ~ U(0, split), t_max ~ U(split, 1): the release's sample_cfg_interval
NO_INTERVAL = (0.0, 1.0)  # every noise level: the interval of the r = t samples, and sampling's default


def draw_guidance(generator: torch.Generator, w_max: float, fm: bool) -> torch.Tensor:
    """One sample's guidance (3,) float32 [1 - 1/w, t_min, t_max]: w log-uniform in [1, w_max] (cfg_beta 1)."""
    w = math.exp(float(torch.rand(1, generator=generator)[0]) * math.log(w_max))
    lo, hi = (torch.rand(2, generator=generator) * INTERVAL_SPLIT + torch.tensor([0.0, INTERVAL_SPLIT])).tolist()
    if fm:  # the release: flow-matching samples (r = t) are guided at every level
        lo, hi = NO_INTERVAL
    return torch.tensor([1 - 1 / w, lo, hi], dtype=torch.float32)


def conditioned(model_fn, guidance: torch.Tensor):
    """model_fn taking (N, 2) times, with `guidance` (N, 3) appended as the network's time columns 3-5."""
    return lambda x, t, **kwargs: model_fn(x, torch.cat([t, guidance.to(t.dtype)], dim=1), **kwargs)


@torch.no_grad()
def guided_target(path: FlowPath, model_fn, x, tau, v, guidance, model_kwargs: dict):
    """(v_g, v_c) in SiT's sign, stop-gradient: the guided target and the predicted velocity of the JVP."""
    # The release's guidance_fn: outside [t_min, t_max] the scale is 1 (v_g = v); v_c is the network at r = t with
    # the row's label (before label dropout), scale w there and no interval; v_u the null class at w = 1.
    level = 1 - tau  # (N,) the paper's t
    g, lo, hi = guidance.unbind(1)  # (N,) each: 1 - 1/w, t_min, t_max
    g = torch.where((level >= lo) & (level <= hi), g, torch.zeros_like(g))
    zero, one = torch.zeros_like(g), torch.ones_like(g)
    cond = torch.stack([torch.cat([g, zero]), torch.cat([zero, zero]), torch.cat([one, one])], dim=1)  # (2N, 3)
    v_c, v_u = average_velocity(path, conditioned(model_fn, cond), torch.cat([x, x]), torch.cat([tau, tau]),
                                torch.cat([zero, zero]).to(tau.dtype), cond_and_null(model_kwargs)).chunk(2)
    shape = (-1, *([1] * (x.ndim - 1)))
    v_g = v + g.view(shape).to(v.dtype) * (v_c - v_u).to(v.dtype)
    dropped = model_kwargs["force_drop_ids"].to(torch.bool).view(shape)  # (N, 1, 1, 1)
    return torch.where(dropped, v, v_g), v_c.to(v.dtype)  # a dropped label: the unguided v (cond_drop)


def imf_losses(path: FlowPath, model_fn, x1, t, noise, model_kwargs: dict, *, p: float, c: float) -> dict:
    """{"loss", "sq", "v_sq"} (N,): sg(w) ||V - sg(v_g)||^2 summed over elements, that square, ||ubar - v||^2."""
    tau, h, guidance = t[:, 0], t[:, 1], t[:, 2:]  # (N,), (N,), (N, 3) of t (N, 5): [tau, h, 1 - 1/w, t_min, t_max]
    s = tau.view(-1, *([1] * (x1.ndim - 1))).to(x1.dtype)  # (N, 1, 1, 1)
    x = s * x1 + (1 - s) * noise  # (N, C, h, w)
    v = x1 - noise  # (N, C, h, w): d x_tau / d tau
    target, v_c = guided_target(path, model_fn, x, tau, v, guidance, model_kwargs)
    correction = torch.zeros_like(v)  # (N, C, h, w): h d ubar / d tau, 0 where r = t
    rows = (h > 0).nonzero().flatten()  # (M,) r != t: only they have a derivative term
    if len(rows):
        _, derivative = average_and_derivative(path, conditioned(model_fn, guidance[rows]), x[rows], tau[rows],
                                               h[rows], v_c[rows], rows_of(model_kwargs, rows))  # (M, C, h, w)
        correction[rows] = h[rows].view(-1, *([1] * (x.ndim - 1))).to(v.dtype) * derivative.to(v.dtype)
    # The forward the gradient flows through runs last, so a wrapper keeping something from it (REPA) keeps its.
    ubar = average_velocity(path, conditioned(model_fn, guidance), x, tau, h, model_kwargs)  # with autograd
    pred = ubar - correction.to(ubar.dtype)  # V = ubar - h sg(d ubar / d tau): the v-loss in SiT's sign
    sq = ((pred - target.to(pred.dtype).detach()) ** 2).flatten(1).sum(1)  # (N,)
    v_sq = ((ubar.detach() - v) ** 2).flatten(1).sum(1)  # (N,)
    return {"loss": adaptive_weight(sq, p, c) * sq, "sq": sq.detach(), "v_sq": v_sq}
