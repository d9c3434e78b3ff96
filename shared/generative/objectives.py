"""The objective seam: what a model is trained to predict, how training draws its time, and how samplers run it.

An objective owns (1) the per-sample training draw of the time (keyed by the sample's stream position through
the generator it is handed, so resume stays bitwise), (2) the loss, (3) what the network input `t` and output
mean, and (4) how each of its samplers turns network outputs into an update (by building the process the
sampler walks). The stages only call `make_objective(model_config, ...)` and the methods below; the model is
only ever called as `model(x, t, **kwargs)`.

- "ddpm": DiT's recipe (Peebles & Xie 2023): 1000-step linear-beta diffusion, eps + learned variance,
  L_hybrid, uniform integer timesteps. Bitwise the official code (shared/generative/diffusion.py).
- "flow": SiT's flow matching (Ma et al. 2024) on the linear path, velocity prediction (shared/generative/flow.py), with
  uniform or logit-normal time draws and LightningDiT's optional cosine velocity loss.

A third objective is one class here plus its entry in OBJECTIVES, and its samplers' records in
shared/generative/samplers.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.generative.diffusion import NUM_TIMESTEPS, GaussianDiffusion, create_diffusion
from shared.runtime.errors import ChoiceError, SettingError
from shared.generative.flow import (SDE_LAST_STEP, TIME_SAMPLINGS, FlowPath, check_convention, check_shift, draw_time,
                                   make_process, rae_shift)
from shared.generative.samplers import get_sampler, sampler_options


@dataclass
class DDPMObjective:
    """DiT's diffusion: eps + learned-range variance, L_hybrid, t uniform in {0..999} (IDDPM Eq. 16)."""

    name = "ddpm"
    default_sampler = "ddpm"
    fast_sampler = "ddim"  # deterministic, so previews of successive checkpoints are comparable
    level_range = (0.0, float(NUM_TIMESTEPS))  # noise levels in DiT timesteps (0 = data)
    level_unit = f"DiT timesteps (0 = data, {NUM_TIMESTEPS} = noise)"
    diffusion: GaussianDiffusion = field(default_factory=create_diffusion)

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
        spec = get_sampler(sampler, self.name)
        if not 1 <= steps <= NUM_TIMESTEPS:
            raise SettingError(f"{{sampling steps}} {steps} must lie in [1, {NUM_TIMESTEPS}] for a DDPM model (250 "
                               f"as the DiT paper; DDIM often uses 50).")
        return create_diffusion(f"{spec.spacing}{steps}")  # UserError for a count its spacing cannot take

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Draw data latents from `noise` (N,C,h,w) with sampler `sampler` (a registry name) and its options."""
        spec = get_sampler(sampler, self.name)
        extra = {"eta": options["ddim_eta"]} if "ddim_eta" in options else {}
        return spec.fn(self.process(sampler, steps, options), model_fn, noise, model_kwargs, generator, progress,
                       **extra)


@dataclass
class FlowObjective:
    """SiT's flow matching: linear path, velocity prediction, uniform or logit-normal times (shared/generative/flow.py)."""

    convention: str = "sit"
    time_sampling: str = "uniform"
    time_loc: float = 0.0  # logit-normal location (SD3 / LightningDiT: 0)
    time_scale: float = 1.0  # logit-normal scale (1)
    cos_weight: float = 0.0  # LightningDiT's cosine velocity-direction loss weight (its recipe: 1)
    time_dist_shift: float = 1.0  # RAE's shift of the training times and the sampling grid (1 = none; flow.rae_shift)

    name = "flow"
    default_sampler = "sde"  # SiT's sampler for its reported FID
    fast_sampler = "euler"
    level_range = (0.0, 1.0)
    level_unit = "flow noise level sigma = 1 - tau (0 = data, 1 = noise; REPA's time)"

    def __post_init__(self):
        check_convention(self.convention)
        if self.time_sampling not in TIME_SAMPLINGS:
            raise ChoiceError("time sampling", self.time_sampling, TIME_SAMPLINGS)
        self.time_dist_shift = check_shift(self.time_dist_shift)
        self.path = FlowPath(self.convention)

    def draw_time(self, generator: torch.Generator) -> torch.Tensor:
        """One training time tau (1,) float32 in SiT's convention (0 = noise), RAE's shift applied (RAE transport.sample)."""
        return rae_shift(draw_time(generator, self.time_sampling, self.time_loc, self.time_scale), self.time_dist_shift)

    def training_losses(self, model_fn, x0, t, noise, model_kwargs=None) -> dict:
        """{"loss", "mse"[, "cos"]}, each (N,): x0 (N,C,h,w) clean latents, t (N,) SiT times, noise like x0."""
        return self.path.training_losses(model_fn, x0, t, noise, model_kwargs, self.cos_weight)

    def noise_level(self, model_t: torch.Tensor) -> torch.Tensor:
        """sigma = 1 - tau of a network input, in float64 (the samplers hand over their float64 grid times)."""
        return self.path.noise_level(model_t.double())

    def process(self, sampler: str, steps: int, options: dict):
        """The time grid `sampler` walks (time shift and SDE last step from its options)."""
        get_sampler(sampler, self.name)
        if steps < 1:
            raise SettingError(f"{{sampling steps}} {steps} must be at least 1.")
        # The recorded RAE shift s shapes the grid as in training (RAE's ode/sde grids); a sampler --time-shift a
        # multiplies onto it (shifts compose by multiplying the odds: a / s in SiT time).
        grid_shift = options.get("time_shift", 1.0) / self.time_dist_shift
        return make_process(self.path, sampler, steps, grid_shift, options.get("last_step_size", SDE_LAST_STEP))

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Integrate from `noise` (tau = 0) to data (tau = 1) with sampler `sampler` and its options."""
        spec = get_sampler(sampler, self.name)
        return spec.fn(self.process(sampler, steps, options), model_fn, noise, model_kwargs, generator, progress)


OBJECTIVES = {"ddpm": DDPMObjective, "flow": FlowObjective}
OBJECTIVE_NAMES = tuple(OBJECTIVES)
OBJECTIVE_HELP = {"ddpm": "DiT: DDPM, eps + learned variance, 1000 steps",
                  "flow": "SiT: flow matching on the linear path, velocity prediction"}


def check_objective(name: str) -> str:
    """ChoiceError unless `name` is a registered objective."""
    if name not in OBJECTIVES:
        raise ChoiceError("objective", name, OBJECTIVE_NAMES, "; ".join(f"{k}: {v}" for k, v in OBJECTIVE_HELP.items()))
    return name


def make_objective(name: str, convention: str = "sit", **training) -> DDPMObjective | FlowObjective:
    """Objective `name` (a flow model's time convention too), with training-only settings (time draws, loss weights)."""
    check_objective(name)
    if name == "ddpm":
        for key, value in training.items():
            default = getattr(FlowObjective, key, None)
            if value is not None and value != default:
                raise SettingError(f"{{{key.replace('_', ' ')}}} {value} applies to the flow objective only; the "
                                   f"ddpm objective draws DiT's uniform integer timesteps and uses its own loss. "
                                   f"Drop it, or train with {{objective}} flow.")
        return DDPMObjective()
    return FlowObjective(convention=convention, **{k: v for k, v in training.items() if v is not None})


def objective_of(model_config, **training) -> DDPMObjective | FlowObjective:
    """The objective a ModelConfig records (its objective, flow_convention and time_dist_shift)."""
    shift = getattr(model_config, "time_dist_shift", 1.0)
    return make_objective(model_config.objective, model_config.flow_convention,
                          **({"time_dist_shift": shift} if shift != 1.0 else {}), **training)


def run_sampler(objective, sampler: str, model_fn, noise, steps: int, given_options: dict, **kwargs):
    """Check sampler and options against the objective, then sample (the one entry point of every stage)."""
    get_sampler(sampler, objective.name)
    return objective.sample(sampler, model_fn, noise, steps, sampler_options(sampler, given_options), **kwargs)
