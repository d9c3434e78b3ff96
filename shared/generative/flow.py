"""Flow matching on the linear path, as SiT defines it: the path, the loss, time draws, and its samplers.

Ma et al. 2024 (SiT: linear interpolant, velocity prediction, Euler-Maruyama with w_t = sigma_t and its "Mean" last
step); Lipman et al. 2023; Esser et al. 2024 (SD3: logit-normal times); Yao et al. 2025 (LightningDiT: timestep shift,
cosine velocity loss). Time is SiT's: x_tau = tau x1 + (1 - tau) eps, v = x1 - eps (tau = 0 noise, 1 data); REPA's
network runs t = 1 - tau and predicts -v. Everything works in SiT time and converts only at the model call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from shared.generative.diffusion import mean_flat, randn_rows
from shared.generative.samplers import LAST_STEP_SIZE, SDE_LAST_STEP, TIME_SHIFT, SamplerSpec, register_sampler
from shared.runtime.errors import ChoiceError, SettingError

# "sit": the network gets tau (0 = noise) and predicts x1 - eps; "repa": it gets 1 - tau and predicts eps - x1.
FLOW_CONVENTIONS = ("sit", "repa")
TIME_SAMPLINGS = ("uniform", "lognormal")  # training-time tau draws (SiT: uniform; SD3/LightningDiT: logit-normal)


def shift_time(tau: torch.Tensor, shift: float) -> torch.Tensor:
    """LightningDiT's timestep shift tau' = s tau / (1 + (s - 1) tau); s < 1 spends more steps near noise, 1 = none."""
    return shift * tau / (1 + (shift - 1) * tau)


# RAE's dimension-dependent shift (Zheng et al. 2025, Sec. 4.2; bytetriper/RAE transport.py and its stage-2
# configs' time_dist_shift_dim / time_dist_shift_base): s = sqrt(C H W / 4096), applied in RAE's time t (1 =
# noise) as t' = s t / (1 + (s - 1) t) to every training time and to the sampling grid. Both shifts scale the
# odds of their time, so in SiT time (tau = 1 - t) RAE's s is shift_time(tau, 1 / s); and two shifts compose by
# multiplying: shift_time(shift_time(tau, a), b) = shift_time(tau, a b).
SHIFT_BASE_DIM = 4096  # RAE's time_dist_shift_base: the dimension at which no shift is needed (64x64x1)


def auto_shift(latent_shape) -> float:
    """RAE's s = sqrt(C H W / 4096) of a latent (C, H, W) to 6 digits, as recorded: 6.928203 for 768x16x16."""
    return round(math.sqrt(math.prod(int(n) for n in latent_shape) / SHIFT_BASE_DIM), 6)


def check_shift(shift: float) -> float:
    """SettingError unless the recorded time distribution shift is a positive finite number."""
    if not (isinstance(shift, (int, float)) and not isinstance(shift, bool) and math.isfinite(shift) and shift > 0):
        raise SettingError(f"{{time dist shift}} {shift!r} must be a positive number (1 = none; RAE's auto = sqrt(C H "
                           f"W / {SHIFT_BASE_DIM}), 6.93 for 768x16x16 tokens).")
    return float(shift)


def rae_shift(tau: torch.Tensor, shift: float) -> torch.Tensor:
    """RAE's shift s (towards noise for s > 1) of SiT times tau (0 = noise): tau / (s - (s - 1) tau)."""
    return tau if shift == 1.0 else shift_time(tau, 1.0 / shift)


@dataclass(frozen=True)
class FlowPath:
    """The linear path of one model convention: the model-call conversion and the training loss."""
    convention: str = "sit"

    def __post_init__(self):
        if self.convention not in FLOW_CONVENTIONS:
            raise ChoiceError("flow time convention", self.convention, FLOW_CONVENTIONS,
                              "sit: time 0 = noise (SiT, LightningDiT); repa: time 0 = data (REPA)")

    def model_time(self, tau: torch.Tensor) -> torch.Tensor:
        """The timestep input the network was trained with, from SiT time tau (N,)."""
        return tau if self.convention == "sit" else 1 - tau

    def noise_level(self, model_t: torch.Tensor) -> torch.Tensor:
        """sigma = 1 - tau of a network timestep input (for the guidance interval)."""
        return 1 - model_t if self.convention == "sit" else model_t

    tau_of = model_time  # SiT time tau of a network timestep input (N,): the map is its own inverse

    def field(self, model_fn, x: torch.Tensor, model_t: torch.Tensor, model_kwargs: dict | None) -> torch.Tensor:
        """SiT's velocity at x (N,C,h,w) from one network call at network time model_t (N,): samplers' only way in."""
        out = model_fn(x, model_t, **(model_kwargs or {}))  # (N, C or 2C, h, w)
        v = out[:, :x.shape[1]].float()  # (N, C, h, w): extra channels are ignored (as SiT)
        return v if self.convention == "sit" else -v

    def call(self, model_fn, x: torch.Tensor, tau: torch.Tensor, model_kwargs: dict | None) -> torch.Tensor:
        """The velocity field at (x, tau): one network call, converted to SiT's convention."""
        return self.field(model_fn, x, self.model_time(tau), model_kwargs)

    def training_losses(self, model_fn, x1, tau, noise, model_kwargs=None, cos_weight: float = 0.0) -> dict:
        """Velocity MSE (SiT Eq. 5) plus, with cos_weight > 0, LightningDiT's 1 - cos(v_hat, v) over C; each (N,)."""
        t = tau.view(-1, *([1] * (x1.ndim - 1))).to(x1.dtype)  # (N, 1, 1, 1)
        xt = t * x1 + (1 - t) * noise  # (N, C, h, w)
        target = x1 - noise  # (N, C, h, w): d x_tau / d tau
        pred = self.call(model_fn, xt, tau, model_kwargs)
        mse = mean_flat((pred - target) ** 2)
        if cos_weight <= 0:
            return {"loss": mse, "mse": mse}
        cos = mean_flat(1 - torch.nn.functional.cosine_similarity(pred, target, dim=1))  # (N,), per-pixel over C
        return {"loss": mse + cos_weight * cos, "mse": mse, "cos": cos}


def draw_time(generator: torch.Generator, sampling: str = "uniform", loc: float = 0.0, scale: float = 1.0,
              shift: float = 1.0) -> torch.Tensor:
    """One training time tau (1,) from `generator`: uniform on [0, 1), or sigmoid(N(loc, scale)) (SD3 Eq. 19)."""
    assert sampling in TIME_SAMPLINGS, sampling  # FlowObjective refuses another with a ChoiceError
    tau = (torch.rand(1, generator=generator) if sampling == "uniform"
           else torch.sigmoid(loc + scale * torch.randn(1, generator=generator)))
    return tau if shift == 1.0 else shift_time(tau, shift)


@dataclass(frozen=True)
class FlowProcess:
    """What a flow sampler walks: the path and the SiT-time grid (float64, from noise at 0 towards data at 1)."""
    path: FlowPath
    times: torch.Tensor  # (K + 1,) float64: the K steps' start and end points; the last is the end time
    last_step: float = 0.0  # SDE only: the final "Mean" step from times[-1] = 1 - last_step to tau = 1
    # (K + 1,) float64 network times at the grid points, computed as the convention's own release computes its
    # grid (REPA: linspace(1, 0, K + 1) itself, not 1 - tau, which differs by an ulp and moves interval edges)
    model_times: torch.Tensor | None = None

    def __post_init__(self):
        if self.model_times is None:
            object.__setattr__(self, "model_times", self.path.model_time(self.times))


def flow_grid(steps: int, shift: float = 1.0, end: float = 1.0) -> torch.Tensor:
    """steps + 1 SiT times from 0 to `end`, evenly spaced, then shifted (LightningDiT); float64."""
    return shift_time(torch.linspace(0.0, end, steps + 1, dtype=torch.float64), shift)


def sde_grid(steps: int, shift: float, last_step: float) -> torch.Tensor:
    """The N start times (float64) of the SDE's N - 1 Euler-Maruyama steps and its Mean step, ending at 1 - h."""
    # The uniform grid ends where the shift maps to 1 - h, so the Mean step keeps its size h and the walk still ends
    # at tau = 1 (shifting SiT's points instead would stop short of the data: shift 0.3 ends at tau 0.918).
    end = 1.0 - last_step  # shift 1 maps every time to itself exactly: SiT's linspace(0, 1 - h, N), bitwise
    uniform_end = float(shift_time(torch.tensor(end, dtype=torch.float64), 1.0 / shift))
    times = shift_time(torch.linspace(0.0, uniform_end, steps, dtype=torch.float64), shift)  # (N,)
    times[-1] = end  # exactly, not shift(shift^-1(end)) with its rounding
    return times


def make_process(path: FlowPath, sampler: str, steps: int, shift: float = 1.0,
                 last_step: float = SDE_LAST_STEP) -> FlowProcess:
    """The grid sampler `sampler` walks with `steps` model calls (ODE) or steps (SDE, the last one a Mean step)."""
    if sampler == "sde":  # SiT: N - 1 Euler-Maruyama steps, then one Mean step of size h: N in all
        if not 0.0 < last_step < 1.0:
            raise SettingError(f"{{last step}} {last_step:g} is outside (0, 1); SiT's SDE sampler ends with a "
                               f"deterministic step of this size (default {SDE_LAST_STEP}).")
        if steps < 2:
            raise SettingError("the SDE sampler takes at least 2 steps (Euler-Maruyama steps, then SiT's last "
                               "Mean step); pass {sampling steps} 2 or more (SiT uses 250).")
        times, last, count = sde_grid(steps, shift, last_step), last_step, steps
    else:
        times, last, count = flow_grid(steps, shift), 0.0, steps + 1
    # REPA's network times are its own float64 grid where it has one (no shift), so guidance edges fall as in its
    # sampler: linspace(1, 0, K + 1) for its ODE, linspace(1, h, N) for its SDE (time 0 = data).
    own_grid = path.convention == "repa" and shift == 1.0
    model_times = torch.linspace(1.0, last, count, dtype=torch.float64) if own_grid else None
    return FlowProcess(path, times, last, model_times)


def _tau(value, x) -> torch.Tensor:
    """A (N,) float64 time vector on x's device: the grid's own value, as REPA's guidance interval compares it."""
    return torch.full((x.shape[0],), float(value), device=x.device, dtype=torch.float64)


def _points(process: FlowProcess, progress: bool, desc: str):
    """(i, tau_i, tau_{i+1}) for each step, taus as float64 scalars, with an optional progress bar."""
    times = process.times.tolist()
    for i in tqdm(range(len(times) - 1), desc=desc, disable=not progress, leave=False):
        yield i, times[i], times[i + 1]


def _velocity(process: FlowProcess, model_fn, x, i: int, model_kwargs) -> torch.Tensor:
    """The velocity at grid point i: the network called at that point's float64 network time."""
    return process.path.field(model_fn, x, _tau(process.model_times[i], x), model_kwargs)


@torch.no_grad()
def euler_sample(process: FlowProcess, model_fn, noise, model_kwargs=None, generator=None, progress=False):
    """Euler's method on the probability-flow ODE dx/dtau = v(x, tau), noise -> data; one call per step."""
    x = noise.to(torch.promote_types(noise.dtype, torch.float32))  # fp32 at least; float64 noise stays (parity checks)
    for i, t0, t1 in _points(process, progress, "euler"):
        x = x + (t1 - t0) * _velocity(process, model_fn, x, i, model_kwargs)
    return x


@torch.no_grad()
def heun_sample(process: FlowProcess, model_fn, noise, model_kwargs=None, generator=None, progress=False):
    """Heun's (explicit trapezoidal) method on the ODE, two calls per step (torchdiffeq's 'heun2', SiT's ODE)."""
    x = noise.float()  # the corrector runs on the last step too (SiT's heun2; REPA's --heun does not)
    for i, t0, t1 in _points(process, progress, "heun"):
        h = t1 - t0
        k1 = _velocity(process, model_fn, x, i, model_kwargs)
        k2 = _velocity(process, model_fn, x + h * k1, i + 1, model_kwargs)
        x = x + 0.5 * h * (k1 + k2)
    return x


def score_from_velocity(v, x, tau):
    """grad log p_tau(x) from the velocity on the linear path: (tau v - x) / (1 - tau) (SiT App. A, ICPlan)."""
    t = tau.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)  # (N, 1, 1, 1), in x's precision
    return (t * v - x) / (1 - t)


@torch.no_grad()
def sde_sample(process: FlowProcess, model_fn, noise, model_kwargs=None, generator=None, progress=False):
    """SiT's reverse SDE by Euler-Maruyama with w_tau = sigma_tau = 1 - tau, then its deterministic "Mean" step."""
    # dx = [v + w score] dtau + sqrt(2 w) dW (SiT Eq. 8), drift and score from ONE network call (SiT makes two).
    x = noise.float()
    for i, t0, t1 in _points(process, progress, "sde"):
        w, dt = 1.0 - t0, t1 - t0
        v = _velocity(process, model_fn, x, i, model_kwargs)
        z = randn_rows(x, generator)  # (N, C, h, w)
        x = x + (v + w * score_from_velocity(v, x, _tau(t0, x))) * dt + math.sqrt(2 * w) * math.sqrt(dt) * z
    last, t_last = len(process.times) - 1, float(process.times[-1])
    v = _velocity(process, model_fn, x, last, model_kwargs)
    return x + (v + (1.0 - t_last) * score_from_velocity(v, x, _tau(t_last, x))) * process.last_step


@torch.no_grad()
def dopri5_sample(process: FlowProcess, model_fn, noise, model_kwargs=None, generator=None, progress=False,
                  atol: float = 1e-6, rtol: float = 1e-3):
    """Adaptive Dormand-Prince 5(4) on the ODE from tau = 0 to 1 (SiT's default ODE solver), one step size per row."""
    from shared.generative.odeint import dopri5_rows  # torchdiffeq's algorithm per row: image i depends on its noise
    def field(tau, x, rows):
        """dx/dtau of the rows `rows` (M,) at their own times tau (M,) float64."""
        kwargs = {k: v[rows] for k, v in (model_kwargs or {}).items()}
        return process.path.field(model_fn, x, process.path.model_time(tau), kwargs)

    return dopri5_rows(field, noise.float(), atol=atol, rtol=rtol)


for _spec in (
    SamplerSpec("euler", euler_sample, "flow", "Euler ODE solver on the flow, one call per step",
                options=(TIME_SHIFT,)),
    SamplerSpec("heun", heun_sample, "flow", "Heun ODE solver on the flow, two calls per step",
                options=(TIME_SHIFT,), calls_per_step=2),
    SamplerSpec("sde", sde_sample, "flow", "SiT's Euler-Maruyama SDE (w = sigma, last step Mean; 250 steps "
                "for its best FID)", options=(TIME_SHIFT, LAST_STEP_SIZE), deterministic=False),
    SamplerSpec("dopri5", dopri5_sample, "flow", "adaptive Dormand-Prince ODE solver (torchdiffeq; atol 1e-6, "
                "rtol 1e-3 as SiT); the step count is not used", calls_per_step=0),
):
    register_sampler(_spec)
