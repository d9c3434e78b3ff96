"""The objective seam: what a model is trained to predict, how training draws its time, and how samplers run it.

An objective is a dataclass registered under its `name` (`@register_objective`) providing the `Objective` members.
Plain fields are recorded (ModelConfig.objective_args); fields declared with `option(...)` are training flags of
`python -m train`. Built in: "ddpm" (DiT) in diffusion.py; "flow" (SiT), "meanflow" and "imf" in flow_objectives.py;
another is one class in a module imported by `--plugin MODULE` (docs/objectives.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import torch

from shared.generative.samplers import get_sampler, sampler_options
from shared.runtime.cli import FLAG_KEY, Flag
from shared.runtime.errors import SettingError
from shared.runtime.registry import Registry, plugin_module


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


# The package's objectives, imported before the first read: ddpm with its diffusion, flow, meanflow and imf.
BUILT_IN_OBJECTIVES = ("shared.generative.diffusion", "shared.generative.flow_objectives")
OBJECTIVES: Registry[type] = Registry("objective", lambda cls: f"{cls.__module__}.{cls.__qualname__}",
                                      lambda cls: f"{cls.name}: {cls.help}", imports=BUILT_IN_OBJECTIVES)
DEFAULT_OBJECTIVE = "ddpm"  # DiT's: train's default, and what weights that record no objective were trained with
_MEMBERS = (*Objective.__annotations__, *(k for k in vars(Objective) if not k.startswith("_")))


def register_objective(cls: type) -> type:
    """Class decorator: add dataclass `cls` to OBJECTIVES under cls.name (another class of that name is refused)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: an objective is a dataclass (decorate it with @dataclass first)")
    missing = [m for m in _MEMBERS if not hasattr(cls, m)]
    if missing:
        raise TypeError(f"{cls.__name__} lacks the Objective members {missing}")
    return OBJECTIVES.register(cls.name, cls)


def objective_help() -> str:
    """name: help of every registered objective, for --objective's help and errors."""
    return "; ".join(f"{name}: {cls.help}" for name, cls in OBJECTIVES.items())


def learns_sigma(name: str) -> bool:
    """Whether objective `name`'s network outputs 2C channels, the second C a learned variance its loss trains."""
    return bool(getattr(OBJECTIVES.lookup(name), "learns_sigma", False))


def check_objective(name: str) -> str:
    """ChoiceError unless `name` is registered."""
    OBJECTIVES.lookup(name)
    return name


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
    return plugin_module(OBJECTIVES[name].__module__)


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


def make_objective(name: str, recorded: dict | None = None, **training) -> Objective:
    """Registered objective `name` from its recorded fields and training settings (None = its default)."""
    cls = OBJECTIVES.lookup(name)
    own_recorded = {f.name for f in recorded_fields(cls)}
    unknown = sorted(set(recorded or {}) - own_recorded)
    if unknown:
        raise SettingError(f"the model config records {', '.join(unknown)} for the {name} objective, which records "
                           f"only {', '.join(sorted(own_recorded)) or 'nothing'}; it was written for another "
                           f"objective. Re-export the weights, or fix their {{objective}}.")
    own_training = {f.name for f in training_fields(cls)}
    flags = training_flags()
    for key, value in training.items():
        if key in own_training or value is None:
            continue
        assert key in flags, f"no registered objective has a training field {key!r}"
        spec, takers = flags[key]
        if value != spec.default:
            owners = [t for t in takers if key in OBJECTIVES[t].__dict__.get("__annotations__", {})] or list(takers)
            built_on = [t for t in takers if t not in owners]
            also = f" (and {', '.join(built_on)}, built on it)" if built_on else ""
            raise SettingError(f"{{{key.replace('_', ' ')}}} {value} applies to the {'/'.join(owners)} objective "
                               f"only{also}; the {name} objective ({cls.help}) does not take it. Drop it, or train "
                               f"with {{objective}} {owners[0]}.")
    chosen = {k: v for k, v in training.items() if k in own_training and v is not None}
    return cls(**(recorded or {}), **chosen)


def objective_of(model_config, **training) -> Objective:
    """The objective a ModelConfig records (ModelConfig.objective, objective_args)."""
    return make_objective(model_config.objective, model_config.objective_args, **training)


def run_sampler(objective: Objective, sampler: str, model_fn, noise, steps: int, given_options: dict, **kwargs):
    """Check sampler and options against the objective, then sample (the one entry point of every stage)."""
    get_sampler(sampler, objective)
    return objective.sample(sampler, model_fn, noise, steps, sampler_options(sampler, given_options), **kwargs)


def check_sampling_guidance(objective, cfg_scale: float, interval=None) -> None:
    """SettingError when `objective` refuses guidance at `cfg_scale` (folded MeanFlow, imf outside its range)."""
    getattr(objective, "check_cfg_scale", lambda *_: None)(cfg_scale, interval)


def recorded_by_training(name: str, options: dict) -> dict:
    """The recorded fields objective `name` derives from its training settings ({} for most)."""
    return getattr(OBJECTIVES.lookup(name), "record_training", lambda _: {})(options)
