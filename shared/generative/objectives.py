"""The objective seam: what a model is trained to predict, how training draws its time, and how samplers run it.

An objective owns (1) the per-sample training draw of the time (keyed by the sample's stream position through
the generator it is handed, so resume stays bitwise), (2) the loss, (3) what the network input `t` and output
mean, and (4) how each of its samplers turns network outputs into an update (by building the process the
sampler walks). Every member is named by the `Objective` protocol below; the stages only call
`make_objective` / `objective_of` and those members; the model is only ever called as `model(x, t, **kwargs)`.

Each objective is a dataclass registered under its `name` (`@register_objective`), in the way of edm2's
`loss_kwargs` but looked up by a name a grep finds. Its fields are of two kinds:
- recorded fields (plain dataclass fields, e.g. the flow's time `convention`): what sampling needs to rebuild
  it; they go into the model config (`ModelConfig.objective_args`) and so into every checkpoint and export;
- training fields (declared with `option(...)` of shared/runtime/cli.py, e.g. `time_sampling`): how training
  draws and weighs; `python -m train` derives one flag per field from the registry.

- "ddpm": DiT's recipe (Peebles & Xie 2023): 1000-step linear-beta diffusion, eps + learned variance,
  L_hybrid, uniform integer timesteps. Bitwise the official code (shared/generative/diffusion.py).
- "flow": SiT's flow matching (Ma et al. 2024) on the linear path, velocity prediction (shared/generative/flow.py),
  with uniform or logit-normal time draws and LightningDiT's optional cosine velocity loss.

A third objective is one registered class, here or in a module of the user's (`--plugin MODULE` imports it in
train, sample and evaluate; docs/objectives.md); its samplers are those of its `family` in
shared/generative/samplers.py.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

import torch

from shared.generative.diffusion import NUM_TIMESTEPS, GaussianDiffusion, create_diffusion
from shared.generative.flow import (TIME_SAMPLINGS, FlowPath, check_convention, check_shift, draw_time, make_process,
                                   rae_shift)
from shared.generative.samplers import LAST_STEP_SIZE, TIME_SHIFT, get_sampler, sampler_options
from shared.runtime.cli import FLAG_KEY, Flag, option
from shared.runtime.errors import ChoiceError, SettingError, UserError


class Objective(Protocol):
    """What the stages may ask of an objective; a registered dataclass provides each member."""

    name: ClassVar[str]  # the registry key, recorded as ModelConfig.objective
    help: ClassVar[str]  # one line for --objective's help and errors
    family: ClassVar[str]  # the process its samplers walk ("ddpm" | "flow"): SamplerSpec.family
    default_sampler: ClassVar[str]  # python -m sample's sampler when --sampler is not given
    fast_sampler: ClassVar[str]  # deterministic, for previews and evaluate run
    level_range: ClassVar[tuple[float, float]]  # the noise levels of the guidance interval (lo = data)
    level_unit: ClassVar[str]  # what those levels are, in words
    # Optional: learns_sigma: ClassVar[bool], True when the loss trains a variance in the network's second C output
    # channels (DiT's hybrid loss); absent or False, the network outputs C channels (learns_sigma below).

    def draw_time(self, generator: torch.Generator) -> torch.Tensor:
        """One training time (1,), the first draw of a sample from its own generator."""

    def training_losses(self, model_fn, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                        model_kwargs: dict | None = None) -> dict[str, torch.Tensor]:
        """{"loss", ...} each (N,): x0 (N,C,h,w) clean latents, t (N,) drawn times, noise like x0."""

    def noise_level(self, model_t: torch.Tensor) -> torch.Tensor:
        """The guidance-interval level (in level_range) of a network time input (N,)."""

    def process(self, sampler: str, steps: int, options: dict) -> Any:
        """What `sampler` walks with `steps` steps and its options; SettingError for a count it cannot take."""

    def sample(self, sampler: str, model_fn, noise: torch.Tensor, steps: int, options: dict,
               model_kwargs: dict | None = None, generator=None, progress: bool = False) -> torch.Tensor:
        """Data latents (N,C,h,w) from `noise` by `sampler` with its options."""


# ----------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------

OBJECTIVES: dict[str, type] = {}
BUILT_IN = __name__  # objectives defined here need no --plugin


def register_objective(cls: type) -> type:
    """Class decorator: add dataclass `cls` to OBJECTIVES under cls.name (another class of that name is refused)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: an objective is a dataclass (decorate it with @dataclass first)")
    missing = [m for m in ("name", "help", "family", "default_sampler", "fast_sampler", "level_range", "level_unit",
                           "draw_time", "training_losses", "noise_level", "process", "sample") if not hasattr(cls, m)]
    if missing:
        raise TypeError(f"{cls.__name__} lacks the Objective members {missing}")
    old = OBJECTIVES.get(cls.name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"objective name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}")
    OBJECTIVES[cls.name] = cls
    return cls


def import_plugins(modules) -> None:
    """Import each module named by --plugin, so the objectives it registers exist; UserError for one not found."""
    for module in modules or ():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not module.startswith(err.name):
                raise
            raise UserError(f"--plugin {module}: no module of that name can be imported ({err}); pass a dotted "
                            f"module path importable from here (its folder on PYTHONPATH).") from err


def objective_names() -> tuple[str, ...]:
    """The registered objective names (built-ins, then plugins in import order)."""
    return tuple(OBJECTIVES)


def objective_help() -> str:
    """name: help of every registered objective, for --objective's help and errors."""
    return "; ".join(f"{name}: {cls.help}" for name, cls in OBJECTIVES.items())


def learns_sigma(name: str) -> bool:
    """Whether objective `name`'s network outputs 2C channels, the second C a learned variance its loss trains."""
    return bool(getattr(OBJECTIVES[check_objective(name)], "learns_sigma", False))


def check_objective(name: str, plugin: str = "") -> str:
    """ChoiceError unless `name` is registered (naming the --plugin that would register it, when known)."""
    if name in OBJECTIVES:
        return name
    if plugin:
        raise UserError(f"these weights were trained with the objective {name!r}, which the module {plugin} registers "
                        f"(recorded with the model); pass --plugin {plugin} so it is imported (its folder on "
                        f"PYTHONPATH).")
    raise ChoiceError("objective", name, objective_names(), objective_help())


def recorded_fields(cls) -> list[dataclasses.Field]:
    """The fields sampling needs (written into the model config): the init fields that are not flags."""
    return [f for f in dataclasses.fields(cls) if f.init and FLAG_KEY not in f.metadata]


def training_fields(cls) -> list[dataclasses.Field]:
    """The training-only fields: each is a flag of python -m train (declared with option(...))."""
    return [f for f in dataclasses.fields(cls) if f.init and FLAG_KEY in f.metadata]


def recorded_args(objective) -> dict:
    """{field: value} of an objective's recorded fields (ModelConfig.objective_args)."""
    return {f.name: getattr(objective, f.name) for f in recorded_fields(type(objective))}


def training_args(objective) -> dict:
    """{field: value} of an objective's training fields (TrainConfig.objective_options)."""
    return {f.name: getattr(objective, f.name) for f in training_fields(type(objective))}


def plugin_of(name: str) -> str:
    """The module that registers objective `name` ("" for a built-in), recorded so a later stage can name it."""
    module = OBJECTIVES[name].__module__
    return "" if module == BUILT_IN else module


def training_flags() -> dict[str, tuple[Flag, tuple[str, ...]]]:
    """{field: (its Flag, the objectives that take it)} over every registered objective (train's flags)."""
    flags: dict[str, tuple[Flag, tuple[str, ...]]] = {}
    for name, cls in OBJECTIVES.items():
        for f in training_fields(cls):
            spec, takers = flags.get(f.name, (f.metadata[FLAG_KEY], ()))
            if spec.default != f.metadata[FLAG_KEY].default:
                raise TypeError(f"objective {name}'s training field {f.name} has default "
                                f"{f.metadata[FLAG_KEY].default!r}, another objective's has {spec.default!r}; one "
                                f"flag needs one default (rename the field)")
            flags[f.name] = (spec, (*takers, name))
    return flags


def make_objective(name: str, recorded: dict | None = None, plugin: str = "", **training) -> Objective:
    """Registered objective `name` from its recorded fields and training settings (None = its default).

    A training setting the objective does not take is refused unless it holds the default of the objectives
    that do (the flag was left alone).
    """
    cls = OBJECTIVES[check_objective(name, plugin)]
    recorded = dict(recorded or {})
    own_recorded = {f.name for f in recorded_fields(cls)}
    unknown = sorted(set(recorded) - own_recorded)
    if unknown:
        raise SettingError(f"the model config records {', '.join(unknown)} for the {name} objective, which records "
                           f"only {', '.join(sorted(own_recorded)) or 'nothing'}; it was written for another "
                           f"objective. Re-export the weights, or fix their {{objective}}.")
    own_training = {f.name for f in training_fields(cls)}
    flags = training_flags()
    for key, value in training.items():
        if key in own_training or value is None:
            continue
        if key not in flags:
            raise ValueError(f"no registered objective has a training field {key!r}")
        spec, takers = flags[key]
        if value != spec.default:
            owners = [t for t in takers if key in OBJECTIVES[t].__dict__.get("__annotations__", {})] or list(takers)
            built_on = [t for t in takers if t not in owners]
            also = f" (and {', '.join(built_on)}, built on it)" if built_on else ""
            raise SettingError(f"{{{key.replace('_', ' ')}}} {value} applies to the {'/'.join(owners)} objective "
                               f"only{also}; the {name} objective ({cls.help}) does not take it. Drop it, or train "
                               f"with {{objective}} {owners[0]}.")
    chosen = {k: v for k, v in training.items() if k in own_training and v is not None}
    return cls(**recorded, **chosen)


def objective_of(model_config, **training) -> Objective:
    """The objective a ModelConfig records (ModelConfig.objective, objective_args, objective_plugin)."""
    return make_objective(model_config.objective, model_config.objective_args, model_config.objective_plugin,
                          **training)


def run_sampler(objective: Objective, sampler: str, model_fn, noise, steps: int, given_options: dict, **kwargs):
    """Check sampler and options against the objective, then sample (the one entry point of every stage)."""
    get_sampler(sampler, objective)
    return objective.sample(sampler, model_fn, noise, steps, sampler_options(sampler, given_options), **kwargs)


# ----------------------------------------------------------------------------------------------------------
# The built-in objectives
# ----------------------------------------------------------------------------------------------------------

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


@register_objective
@dataclass
class FlowObjective:
    """SiT's flow matching: linear path, velocity prediction, uniform or logit-normal times (shared/generative/flow.py)."""

    # Recorded: the direction of the network's time input ("sit": 0 = noise; "repa": 0 = data).
    convention: str = "sit"
    # Recorded: RAE's dimension-dependent shift of the training times and the sampling grid (1 = none; flow.rae_shift;
    # python -m train --time-dist-shift auto|S sets it, docs/rae.md).
    time_dist_shift: float = 1.0
    # Training only (flags of python -m train):
    time_sampling: str = option("uniform", "how training draws the time: uniform (SiT) or lognormal, the sigmoid of "
                                           "a normal (SD3, LightningDiT)", choices=TIME_SAMPLINGS)
    time_loc: float = option(0.0, "location of the lognormal time draw (SD3 / LightningDiT: 0)")
    time_scale: float = option(1.0, "scale of the lognormal time draw")
    cos_weight: float = option(0.0, "weight of LightningDiT's cosine velocity-direction loss (its recipe: 1)")

    name: ClassVar[str] = "flow"
    help: ClassVar[str] = "SiT: flow matching on the linear path, velocity prediction"
    family: ClassVar[str] = "flow"
    default_sampler: ClassVar[str] = "sde"  # SiT's sampler for its reported FID
    fast_sampler: ClassVar[str] = "euler"
    level_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    level_unit: ClassVar[str] = "flow noise level sigma = 1 - tau (0 = data, 1 = noise; REPA's time)"

    def __post_init__(self):
        check_convention(self.convention)
        self.time_dist_shift = check_shift(self.time_dist_shift)
        if self.time_sampling not in TIME_SAMPLINGS:
            raise ChoiceError("time sampling", self.time_sampling, TIME_SAMPLINGS)
        if not self.time_scale > 0:
            raise SettingError(f"{{time scale}} must be positive; fix the flag and rerun.")
        if not self.cos_weight >= 0:
            raise SettingError(f"{{cos weight}} must be >= 0; fix the flag and rerun.")
        self.path = self.make_path()

    def make_path(self) -> FlowPath:
        """The path the loss and the samplers use (a subclass may return one whose `call` converts its output)."""
        return FlowPath(self.convention)

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
        get_sampler(sampler, self)
        if steps < 1:
            raise SettingError(f"{{sampling steps}} {steps} must be at least 1.")
        # The recorded RAE shift s shapes the grid as in training (RAE's ode/sde grids); a sampler --time-shift a
        # multiplies onto it (shifts compose by multiplying the odds: a / s in SiT time). A sampler without an
        # option (dopri5) walks no grid: the option's default only fills the argument.
        grid_shift = options.get(TIME_SHIFT.name, TIME_SHIFT.default) / self.time_dist_shift
        return make_process(self.path, sampler, steps, grid_shift,
                            options.get(LAST_STEP_SIZE.name, LAST_STEP_SIZE.default))

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Integrate from `noise` (tau = 0) to data (tau = 1) with sampler `sampler` and its options."""
        spec = get_sampler(sampler, self)
        return spec.fn(self.process(sampler, steps, options), model_fn, noise, model_kwargs, generator, progress)
