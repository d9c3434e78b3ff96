"""The one registry of samplers: each a record of its function, the objectives it serves, its spacing and options.

Every sampler function has one signature, `fn(process, model_fn, noise, model_kwargs=None, generator=None,
progress=False, **options) -> x_data`, where `process` is what the objective builds for it from the step count
(a respaced GaussianDiffusion for DDPM, a FlowProcess time grid for flow matching; see shared/generative/objectives.py).
A new sampler is one SamplerSpec here. A sampler serves every objective of its `family`, the kind of process it
walks ("ddpm": a respaced GaussianDiffusion; "flow": a FlowProcess), so a new objective that builds one of
these processes (e.g. x-prediction flow) is served with no record changed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shared.generative.diffusion import check_ddim_eta, ddim_sample, ddpm_sample
from shared.runtime.errors import ChoiceError, SettingError
from shared.generative.flow import SDE_LAST_STEP, dopri5_sample, euler_sample, heun_sample, sde_sample
from shared.generative.solvers import dpmpp_2m_sample, unipc_sample

# Options a sampler may take, with the flag-free description used in errors: name -> (default, meaning).
SAMPLER_OPTIONS = {
    "ddim_eta": (0.0, "DDIM's eta in [0, 1] (0 = deterministic)"),
    "time_shift": (1.0, "LightningDiT's timestep shift of the flow time grid (1 = none, LightningDiT uses 0.3)"),
    "last_step_size": (SDE_LAST_STEP, "the size of the SDE's final deterministic Mean step (SiT: 0.04)"),
}


@dataclass(frozen=True)
class SamplerSpec:
    """One sampler: its function, the family of objectives it serves, its DDPM spacing prefix, its options."""

    name: str
    fn: Callable
    family: str  # the process it walks, Objective.family: "ddpm" or "flow"
    help: str
    spacing: str = ""  # DDPM only: a kept_timesteps prefix ("" = DiT's respacing, "linspace" = diffusers')
    options: tuple[str, ...] = ()
    calls_per_step: int = 1  # network evaluations per step (Heun: 2); adaptive solvers: 0 (not known ahead)
    deterministic: bool = True


SAMPLERS = {spec.name: spec for spec in (
    SamplerSpec("ddpm", ddpm_sample, "ddpm", "ancestral DDPM, DiT's respacing (250 steps as the paper)",
                deterministic=False),
    SamplerSpec("ddim", ddim_sample, "ddpm", "DDIM (eta 0 deterministic), DiT's respacing", options=("ddim_eta",)),
    SamplerSpec("dpmpp-2m", dpmpp_2m_sample, "ddpm", "DPM-Solver++(2M) ODE solver, linspace spacing (10-25 steps)",
                spacing="linspace"),
    SamplerSpec("unipc", unipc_sample, "ddpm", "UniPC-2 (bh2) ODE solver, linspace spacing (10-25 steps)",
                spacing="linspace"),
    SamplerSpec("euler", euler_sample, "flow", "Euler ODE solver on the flow, one call per step",
                options=("time_shift",)),
    SamplerSpec("heun", heun_sample, "flow", "Heun ODE solver on the flow, two calls per step",
                options=("time_shift",), calls_per_step=2),
    SamplerSpec("sde", sde_sample, "flow", "SiT's Euler-Maruyama SDE (w = sigma, last step Mean; 250 steps "
                "for its best FID)", options=("time_shift", "last_step_size"), deterministic=False),
    SamplerSpec("dopri5", dopri5_sample, "flow", "adaptive Dormand-Prince ODE solver (torchdiffeq; atol 1e-6, "
                "rtol 1e-3 as SiT); the step count is not used", calls_per_step=0),
)}
SAMPLER_NAMES = tuple(SAMPLERS)  # the sampler vocabulary, for CLI choices and errors


def get_sampler(name: str, objective=None) -> SamplerSpec:
    """The record of sampler `name`; ChoiceError for an unknown name, SettingError when it does not serve
    `objective` (an Objective, or a family name)."""
    if name not in SAMPLERS:
        raise ChoiceError("sampler", name, SAMPLER_NAMES,
                          detail="; ".join(f"{s.name} ({s.family})" for s in SAMPLERS.values()))
    spec = SAMPLERS[name]
    if objective is None:
        return spec
    family, called = (objective, objective) if isinstance(objective, str) else (objective.family, objective.name)
    if spec.family != family:
        raise SettingError(f"{{sampler}} {name} samples {spec.family} models, but these weights were trained with "
                           f"the {called} objective (recorded with the model); use one of its samplers: "
                           f"{', '.join(samplers_for(family))}.")
    return spec


def samplers_for(family: str) -> list[str]:
    """The names of the samplers of an objective family ("ddpm" | "flow"), in registry order."""
    return [s.name for s in SAMPLERS.values() if s.family == family]


def sampler_options(name: str, given: dict) -> dict:
    """The options sampler `name` runs with: its own, defaulted; SettingError for a given option it does not take."""
    spec = get_sampler(name)
    for option, value in given.items():
        if option not in SAMPLER_OPTIONS:
            raise ValueError(f"unknown sampler option {option!r}")
        if value is not None and option not in spec.options:
            takers = [s.name for s in SAMPLERS.values() if option in s.options]
            raise SettingError(f"{{{option.replace('_', ' ')}}} {value:g} sets {SAMPLER_OPTIONS[option][1]}, which "
                               f"the {name} sampler does not take (only {', '.join(takers)}); drop it, or pass "
                               f"{{sampler}} {takers[0]}.")
    options = {o: given.get(o) if given.get(o) is not None else SAMPLER_OPTIONS[o][0] for o in spec.options}
    if "ddim_eta" in options:
        options["ddim_eta"] = check_ddim_eta(options["ddim_eta"])
    if "time_shift" in options and not float(options["time_shift"]) > 0:
        raise SettingError(f"{{time shift}} {options['time_shift']:g} must be positive (1 = no shift; LightningDiT "
                           f"uses 0.3, which puts more steps near noise).")
    return options
