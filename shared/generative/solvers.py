"""Multistep ODE solvers for DiT's discrete schedule: DPM-Solver++(2M) and UniPC (B(h) = e^h - 1, order 2).

Lu et al. 2022 (DPM-Solver++, Alg. 2, data prediction); Zhao et al. 2023 (UniPC: UniP-p / UniC-p, "bh2"). Both
integrate the VP probability-flow ODE in log-SNR time lambda = log(alpha / sigma) from the data prediction
x0_hat = (x_t - sigma eps_hat) / alpha (eps half only, nothing random). One model call at each of the diffusion's K
steps, the last step landing on clean data (diffusers' final_sigmas_type="zero"). Schedule scalars are float64 numpy
values; tensors stay float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from shared.runtime.errors import SettingError


@dataclass(frozen=True)
class SolverGrid:
    """alpha, sigma and lambda at the K model-call points (noisiest first) plus the clean end point (K + 1 each)."""
    alpha: np.ndarray
    sigma: np.ndarray
    lam: np.ndarray

    @property
    def calls(self) -> int:
        """Number of model calls K (the grid has K + 1 points; the last is clean data)."""
        return len(self.alpha) - 1


def solver_grid(diffusion) -> SolverGrid:
    """The diffusion's K steps as (alpha, sigma, lambda), noisiest first, then clean data (1, 0, +inf)."""
    abar = diffusion.alphas_cumprod[::-1]  # (K,) float64, step K-1 (noisiest) first
    alpha = np.append(np.sqrt(abar), 1.0)
    sigma = np.append(np.sqrt(1.0 - abar), 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf at the clean end: lambda = +inf there
        lam = np.log(alpha) - np.log(sigma)
    return SolverGrid(alpha, sigma, lam)


def refuse_eta(eta, name: str, why: str = "is a deterministic ODE solver with no noise to scale") -> None:
    """SettingError for a DDIM eta given to sampler `name`: a flag that cannot apply is refused, never ignored."""
    if eta is not None:
        raise SettingError(f"{{ddim eta}} {eta:g} is DDIM's noise scale and applies only to the ddim sampler "
                           f"({{sampler}} ddim); the {name} sampler {why}. Drop {{ddim eta}}, or sample with "
                           f"{{sampler}} ddim.")


def data_prediction(diffusion, model_fn, x, j: int, grid: SolverGrid, model_kwargs=None) -> torch.Tensor:
    """x0_hat = (x - sigma eps_hat) / alpha at grid point j (diffusion step K-1-j); eps only, float32 (N,C,H,W)."""
    t = torch.full((x.shape[0],), grid.calls - 1 - j, device=x.device, dtype=torch.long)  # diffusion step K-1-j
    out = model_fn(x, diffusion.model_timesteps(t), **(model_kwargs or {}))  # (N, C or 2C, H, W)
    eps, _ = diffusion.split_output(out, x, t)  # the learned variance half is unused by an ODE solver
    return (x - float(grid.sigma[j]) * eps) / float(grid.alpha[j])


def multistep_predict(x, m_now, m_prev, j: int, grid: SolverGrid) -> torch.Tensor:
    """One step from grid point j to j+1 given the data predictions at j (m_now) and j-1 (m_prev or None)."""
    # DPM-Solver++ Alg. 2: x_{j+1} = (sigma_{j+1} / sigma_j) x_j + alpha_{j+1} (1 - e^{-h}) D, D = m_now (first order)
    # or m_now + (m_now - m_prev) / (2 r), r = h_prev / h; UniP-2 with a_1 = 1/2 is the same. Into clean data: m_now.
    h = grid.lam[j + 1] - grid.lam[j]
    d = m_now
    if m_prev is not None and j + 1 < grid.calls:
        r = (grid.lam[j] - grid.lam[j - 1]) / h
        d = m_now + (m_now - m_prev) * float(1.0 / (2.0 * r))
    phi = float(-np.expm1(-h))  # 1 - e^{-h}, = 1 at the clean end
    return float(grid.sigma[j + 1] / grid.sigma[j]) * x + float(grid.alpha[j + 1]) * phi * d


@torch.no_grad()
def dpmpp_2m_sample(diffusion, model_fn, noise, model_kwargs=None, generator=None, progress=False, eta=None):
    """DPM-Solver++(2M) (Lu et al. 2022, Alg. 2) from x_T = noise over the diffusion's K steps; returns x_0."""
    refuse_eta(eta, "dpmpp-2m")
    grid = solver_grid(diffusion)
    x, m_prev = noise.float(), None
    for j in tqdm(range(grid.calls), desc="dpmpp-2m", disable=not progress, leave=False):  # noisiest first
        m_now = data_prediction(diffusion, model_fn, x, j, grid, model_kwargs)
        x = multistep_predict(x, m_now, m_prev, j, grid)
        m_prev = m_now
    return x


def unipc_correct(x_prev, m_prev, m_now, m_older, j: int, grid: SolverGrid) -> torch.Tensor:
    """UniC: recompute the step j-1 -> j from x_prev with the new data prediction m_now (no extra model call)."""
    # x_j^c = (sigma_j / sigma_{j-1}) x_{j-1} - alpha_j B(h) (m_{j-1} + sum_k a_k D_k), D_t = m_now - m_{j-1},
    # D_1 = (m_older - m_{j-1}) / r (UniC-2 only, after a second-order predictor).
    h = grid.lam[j] - grid.lam[j - 1]
    b_h = float(np.expm1(-h))  # B(h) = e^{hh} - 1 < 0
    ratio, alpha = float(grid.sigma[j] / grid.sigma[j - 1]), float(grid.alpha[j])
    if m_older is None:  # UniC-1 takes a = 1/2, as the authors' code and diffusers
        correction = 0.5 * (m_now - m_prev)
    else:  # UniC-2's weights (a_1, a_t) in data-prediction form: R_p a = g_p / B(h), g_i = i! h phi_{i+1}(h), hh = -h
        r, hh = (grid.lam[j - 2] - grid.lam[j - 1]) / h, -h
        hphi2 = np.expm1(hh) / hh - 1.0
        b1, b2 = hphi2 / np.expm1(hh), 2.0 * (hphi2 / hh - 0.5) / np.expm1(hh)
        # [[1, 1], [r, 1]] (a_1, a_t) = (b1, b2); r < 0 (the older point is noisier), so 1 - r > 0.
        a_1 = float((b1 - b2) / (1.0 - r))
        correction = (a_1 / r) * (m_older - m_prev) + float(b1 - a_1) * (m_now - m_prev)
    return ratio * x_prev - alpha * b_h * (m_prev + correction)


@torch.no_grad()
def unipc_sample(diffusion, model_fn, noise, model_kwargs=None, generator=None, progress=False, eta=None):
    """UniPC-2 with B(h) = e^h - 1 (Zhao et al. 2023, "bh2") from x_T = noise over the K steps; returns x_0."""
    refuse_eta(eta, "unipc")
    grid = solver_grid(diffusion)
    x = noise.float()
    x_from, m_prev, m_older = None, None, None  # the sample the last predictor started at; data predictions j-1, j-2
    for j in tqdm(range(grid.calls), desc="unipc", disable=not progress, leave=False):
        m_now = data_prediction(diffusion, model_fn, x, j, grid, model_kwargs)
        if m_prev is not None and j + 1 < grid.calls:  # the last step returns m_now: no corrector there
            # UniC of the previous predictor's order: 1 after the first step (m_older None), else 2.
            x = unipc_correct(x_from, m_prev, m_now, m_older, j, grid)
        x_from = x
        x = multistep_predict(x, m_now, m_prev, j, grid)
        m_prev, m_older = m_now, m_prev
    return x
