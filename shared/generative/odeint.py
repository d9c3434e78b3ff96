"""Adaptive Dormand-Prince 5(4) with one step size per row: torchdiffeq's algorithm, run independently for each row.

torchdiffeq's dopri5 (SiT's ODE solver) takes one step size for the whole batch; here row i follows exactly the steps
torchdiffeq takes for row i alone, the rows still one network batch. As torchdiffeq (rk_common.py, misc.py, interp.py;
Hairer et al. II.4, II.6), float32 stage sums; tolerances weigh errors in float64 as SiT's list-valued atol/rtol.
"""
from __future__ import annotations

import torch

# Dormand & Prince (1980) stage nodes and weights; the 5th-order solution is the last stage (FSAL).
ALPHA = (1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0)
BETA = (
    (1 / 5,),
    (3 / 40, 9 / 40),
    (44 / 45, -56 / 15, 32 / 9),
    (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
    (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
    (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84),
)
C_ERROR = (35 / 384 - 1951 / 21600, 0.0, 500 / 1113 - 22642 / 50085, 125 / 192 - 451 / 720,
           -2187 / 6784 - -12231 / 42400, 11 / 84 - 649 / 6300, -1.0 / 60.0)  # 5th minus 4th order weights
C_MID = (6025192743 / 30085553152 / 2, 0.0, 51252292925 / 65400821598 / 2, -2691868925 / 45128329728 / 2,
         187940372067 / 1594534317056 / 2, -1776094331 / 19743644256 / 2, 11237099 / 235043384 / 2)  # Shampine
ORDER = 5
SAFETY, IFACTOR, DFACTOR = 0.9, 10.0, 0.2  # torchdiffeq's defaults
MAX_STEPS = 100_000  # per row; a field that needs more is broken (torchdiffeq's limit is 2**31 - 1)


def _rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row scalar (M,) viewed as (M, 1, ..., 1) to broadcast against `like` (M, ...)."""
    return t.view(-1, *([1] * (like.ndim - 1)))


def _rms(x: torch.Tensor) -> torch.Tensor:
    """(M,) root mean square of each row (torchdiffeq's default norm, taken per row)."""
    return x.abs().pow(2).flatten(1).mean(dim=1).sqrt()


def _weights(values) -> torch.Tensor:
    """A tableau row as float32 (torchdiffeq keeps its float64 tableau and casts it to the state's dtype)."""
    return torch.tensor(values, dtype=torch.float64).float()


def _combine(y0: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """y0 + sum_j k[..., j] (w_j dt): slopes k (M, ..., J) stacked last, dt (M,) float32."""
    # One reduction as torchdiffeq: the error estimate is a small difference of large terms, so the sum order matters.
    w = weights.to(k.device) * dt.view(-1, *([1] * (k.ndim - 1)))  # (M, 1, ..., J)
    return y0 + torch.sum(k[..., :weights.numel()] * w, dim=-1)


def initial_step(field, t0, y0, f0, rows, atol: float, rtol: float) -> torch.Tensor:
    """(M,) float64 first step sizes (Hairer et al. II.4; torchdiffeq's _select_initial_step, order 4)."""
    scale = atol + y0.abs().double() * rtol  # (M, ...) float64, as SiT's list-valued tolerances make it
    d0, d1 = _rms(y0 / scale), _rms(f0 / scale)  # (M,)
    h0 = torch.where((d0 < 1e-5) | (d1 < 1e-5), torch.full_like(d0, 1e-6), 0.01 * d0 / d1).abs()
    f1 = field(t0 + h0, y0 + _rows(h0, y0).to(y0.dtype) * f0, rows)
    d2 = (_rms((f1 - f0) / scale) / h0).abs()
    flat = (d1 <= 1e-15) & (d2 <= 1e-15)
    h1 = torch.where(flat, torch.clamp(h0 * 1e-3, min=1e-6), (0.01 / torch.maximum(d1, d2)) ** (1.0 / ORDER)).abs()
    return torch.minimum(100 * h0, h1)


def next_step(dt: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """(M,) step sizes after a step of size dt with error ratio `ratio` (torchdiffeq's _optimal_step_size)."""
    shrink = torch.where(ratio < 1, torch.ones_like(dt), torch.full_like(dt, DFACTOR))
    factor = torch.minimum(torch.full_like(dt, IFACTOR), torch.maximum(SAFETY / ratio ** (1.0 / ORDER), shrink))
    return torch.where(ratio == 0, dt * IFACTOR, dt * factor)


def rk_step(field, t0, dt, y0, f0, rows):
    """One Dormand-Prince trial step of every row: (y1, f1, error estimate, the 7 stage slopes (M, ..., 7))."""
    t32, dt32, end32 = t0.float(), dt.float(), (t0 + dt).float()  # torchdiffeq's stage times, sums in float32
    # Stages at the step's end are evaluated one float32 ulp before it (torchdiffeq's Perturb.PREV), as float64.
    before_end = torch.nextafter(end32, torch.full_like(end32, -float("inf"))).double()  # (M,)
    k = torch.empty(*f0.shape, len(ALPHA) + 1, dtype=y0.dtype, device=y0.device)  # (M, ..., 7)
    k[..., 0] = f0
    for i, (alpha, beta) in enumerate(zip(ALPHA, BETA)):
        t = before_end if alpha == 1.0 else (t32 + alpha * dt32).double()  # (M,)
        y = _combine(y0, k, _weights(beta), dt32)
        k[..., i + 1] = field(t, y, rows)
    error = torch.sum(k * (_weights(C_ERROR).to(k.device) * dt32.view(-1, *([1] * (k.ndim - 1)))), dim=-1)
    return y, k[..., -1], error, k


def interpolate_end(y0, y1, k, dt, t0, t1, t_end) -> torch.Tensor:
    """The step's quartic dense output (Shampine's mid-point) at t_end, t0 <= t_end <= t1 (torchdiffeq's interp)."""
    y_mid = _combine(y0, k, _weights(C_MID), dt.float())
    h = _rows(dt.float(), y0)
    f0, f1 = k[..., 0], k[..., -1]
    a = 2 * h * (f1 - f0) - 8 * (y1 + y0) + 16 * y_mid
    b = h * (5 * f0 - 3 * f1) + 18 * y0 + 14 * y1 - 32 * y_mid
    c = h * (f1 - 4 * f0) - 11 * y0 - 5 * y1 + 16 * y_mid
    x = _rows(((t_end - t0) / (t1 - t0)).to(y0.dtype), y0)  # (M, 1, ..., 1) in [0, 1]
    total, power = y0 + x * (h * f0), x
    for coefficient in (c, b, a):
        power = power * x
        total = total + power * coefficient
    return total


def dopri5_rows(field, y0: torch.Tensor, atol: float = 1e-6, rtol: float = 1e-3, t_end: float = 1.0) -> torch.Tensor:
    """Integrate dy/dt = field(t (M,), y (M, ...), rows (M,)) from t = 0 to t_end for each row of y0 (N, ...) alone."""
    out = torch.empty_like(y0)
    rows = torch.arange(len(y0), device=y0.device)
    t = torch.zeros(len(y0), dtype=torch.float64, device=y0.device)
    y, f = y0, field(t, y0, rows)
    dt = initial_step(field, t, y, f, rows, atol, rtol)
    for _ in range(MAX_STEPS):
        dt = torch.where(torch.isfinite(dt), dt, torch.zeros_like(dt))  # torchdiffeq: a non-finite step -> min_step 0
        if not bool((t + dt > t).all()):
            raise FloatingPointError(f"dopri5: the step size underflowed at t = {float(t.min()):g}")
        t1 = t + dt
        y1, f1, error, k = rk_step(field, t, dt, y, f, rows)
        tol = atol + rtol * torch.maximum(y.abs(), y1.abs()).double()  # float64, as in SiT's call
        ratio = _rms(error / tol)  # (M,) float64
        accept = ratio <= 1
        done = accept & (t1 >= t_end)
        if bool(done.any()):
            out[rows[done]] = interpolate_end(y[done], y1[done], k[done], dt[done], t[done], t1[done],
                                              torch.full_like(t[done], t_end))
        keep = ~done
        step = _rows(accept, y)
        y, f = torch.where(step, y1, y)[keep], torch.where(step, f1, f)[keep]
        t, dt, rows = torch.where(accept, t1, t)[keep], next_step(dt, ratio)[keep], rows[keep]
        if rows.numel() == 0:
            return out
    raise RuntimeError(f"dopri5: {rows.numel()} rows still unfinished after {MAX_STEPS} steps")
