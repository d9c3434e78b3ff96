"""The one registry of samplers: each a record of its function, the objectives it serves, its spacing and options.

Every sampler function has one signature, `fn(process, model_fn, noise, model_kwargs=None, generator=None,
progress=False, **options) -> x_data`, where `process` is what the objective builds for it from the step count.
A new sampler is one SamplerSpec passed to `register_sampler` (`--plugin MODULE`; docs/objectives.md); it serves
every objective of its `family`, the process it walks ("ddpm": a respaced GaussianDiffusion; "flow": a FlowProcess).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shared.runtime.errors import SettingError, UserError
from shared.runtime.registry import Registry

SDE_LAST_STEP = 0.04  # SiT's default size of the final "Mean" step (its sample.py --last-step-size)


@dataclass(frozen=True)
class SamplerOption:
    """An option a sampler takes, stated once: its default, what it sets (flag help and errors), its folder tag."""
    name: str
    default: float
    help: str  # what it sets, in a phrase (errors say "{flag} X sets <help>")
    tag: str  # python -m sample's default folder names a value other than the default: -<tag><value>
    detail: str = ""  # more for the flag's help


DDIM_ETA = SamplerOption("ddim_eta", 0.0, "DDIM's eta in [0, 1] (0 = deterministic)", "eta",
                         "Song et al. Eq. 16: 1 is DDPM-like")
TIME_SHIFT = SamplerOption("time_shift", 1.0, "LightningDiT's timestep shift of the flow time grid (1 = none, "
                           "LightningDiT uses 0.3)", "shift",
                           "tau' = s tau / (1 + (s-1) tau); s < 1 puts more steps near noise")
LAST_STEP_SIZE = SamplerOption("last_step_size", SDE_LAST_STEP, "the size of the SDE's final deterministic Mean step "
                               "(SiT: 0.04)", "last",
                               "it ends at the data; with a time shift the shifted grid ends at 1 - this size")


@dataclass(frozen=True)
class SamplerSpec:
    """One sampler: its function, the family of objectives it serves, its DDPM spacing prefix, its options."""
    name: str
    fn: Callable
    family: str  # the process it walks, Objective.family: "ddpm", "flow" or "meanflow"
    help: str
    spacing: str = ""  # DDPM only: a kept_timesteps prefix ("" = DiT's respacing, "linspace" = diffusers')
    options: tuple[SamplerOption, ...] = ()
    calls_per_step: int = 1  # network evaluations per step (Heun: 2); adaptive solvers: 0 (not known ahead)
    deterministic: bool = True


# The package's samplers are registered by the module of the process each walks: diffusion.py, flow.py, meanflow.py,
# imported in this order (each imports the one before) before the first read, so the registry order is fixed.
BUILT_IN_SAMPLERS = ("shared.generative.diffusion", "shared.generative.flow", "shared.generative.meanflow")
SAMPLERS: Registry[SamplerSpec] = Registry("sampler", lambda s: f"{s.fn.__module__}.{s.fn.__qualname__}",
                                           lambda s: f"{s.name} ({s.family})", imports=BUILT_IN_SAMPLERS)
SAMPLER_OPTIONS = {o.name: o for o in (DDIM_ETA, TIME_SHIFT, LAST_STEP_SIZE)}  # every option (each a sampling flag)


def check_ddim_eta(eta: float) -> float:
    """DDIM's eta as a float in [0, 1], or a SettingError (eta > 1 makes 1 - abar' - sigma^2 negative)."""
    eta = float(eta)
    if not 0.0 <= eta <= 1.0:
        raise SettingError(f"{{ddim eta}} {eta:g} is outside [0, 1]: DDIM's eta must lie in [0, 1] (0 = "
                           f"deterministic, 1 = DDPM-like noise); pass a value in that range.")
    return eta


def register_sampler(spec: SamplerSpec) -> SamplerSpec:
    """Add `spec` to SAMPLERS (TypeError for a name taken by another record or an option with no flag); returns it."""
    strange = [o.name for o in spec.options if SAMPLER_OPTIONS.get(o.name) != o]
    if strange:
        raise TypeError(f"sampler {spec.name!r} takes options {strange} that are not those of the sampling flags "
                        f"({', '.join(SAMPLER_OPTIONS)}); reuse their records (TIME_SHIFT, ...)")
    return SAMPLERS.register(spec.name, spec)


def sampler_names() -> tuple[str, ...]:
    """The registered sampler names (built-ins, then plugins in import order): --sampler's choices."""
    return SAMPLERS.names()


def get_sampler(name: str, objective=None) -> SamplerSpec:
    """Sampler `name`'s record; ChoiceError if unknown, SettingError if it does not serve `objective` (or family)."""
    spec = SAMPLERS.lookup(name)
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


def takers_of(option: str) -> list[str]:
    """The samplers that take `option`, in registry order."""
    return [s.name for s in SAMPLERS.values() if any(o.name == option for o in s.options)]


def sampler_options(name: str, given: dict) -> dict:
    """The options sampler `name` runs with: its own, defaulted; SettingError for a given option it does not take."""
    spec = get_sampler(name)
    for option, value in given.items():
        assert option in SAMPLER_OPTIONS, f"unknown sampler option {option!r}"
        if value is not None and option not in (o.name for o in spec.options):
            takers = takers_of(option)
            raise SettingError(f"{{{option.replace('_', ' ')}}} {value:g} sets {SAMPLER_OPTIONS[option].help}, which "
                               f"the {name} sampler does not take (only {', '.join(takers)}); drop it, or pass "
                               f"{{sampler}} {takers[0]}.")
    options = {o.name: given.get(o.name) if given.get(o.name) is not None else o.default for o in spec.options}
    if "ddim_eta" in options:
        options["ddim_eta"] = check_ddim_eta(options["ddim_eta"])
    if "time_shift" in options and not float(options["time_shift"]) > 0:
        raise SettingError(f"{{time shift}} {options['time_shift']:g} must be positive (1 = no shift; LightningDiT "
                           f"uses 0.3, which puts more steps near noise).")
    return options


SAMPLING_KEYS = ("sampler", "sampler_plugin", "num_sampling_steps", "cfg_interval", *SAMPLER_OPTIONS)  # what a recipe
# or release may record (ModelConfig.sampling); the step count belongs to the recorded sampler and applies only with it
DEFAULT_STEPS = 250  # when neither a flag nor the model's record says: the DiT paper's DDPM and SiT's SDE count


@dataclass(frozen=True)
class Sampling:
    """A resolved sampler, its options and guidance interval, and where each came from (for settings.json)."""
    sampler: str
    options: dict
    cfg_interval: tuple | None
    notes: tuple[str, ...] = ()
    steps: int = DEFAULT_STEPS


def check_recorded(recorded: dict, family: str, where: str) -> dict:
    """SettingError unless a recorded sampling half names only known keys, a sampler of `family`, options it takes."""
    unknown = sorted(set(recorded) - set(SAMPLING_KEYS))
    if unknown:
        raise SettingError(f"{where} records sampling settings {unknown}, which this version does not know (it knows "
                           f"{', '.join(SAMPLING_KEYS)}); re-export the weights with this version.")
    if "sampler" in recorded:
        name, plugin = recorded["sampler"], recorded.get("sampler_plugin", "")
        if name not in SAMPLERS:  # UserError naming --plugin: no imported module registers it
            raise UserError(f"{where} records the sampler {name!r}, which "
                            f"{f'the module {plugin}' if plugin else 'a module'} registers (it is not one of "
                            f"{', '.join(SAMPLERS)}); pass --plugin {plugin or 'MODULE'} so it is imported (its "
                            f"folder on PYTHONPATH).")
        get_sampler(name, family)  # SettingError for a sampler of another family
        sampler_options(name, {k: v for k, v in recorded.items() if k in SAMPLER_OPTIONS})
    steps = recorded.get("num_sampling_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or
                              "sampler" not in recorded):
        raise SettingError(f"{where} records num_sampling_steps {steps!r}: it must be a whole number >= 1 and "
                           f"come with the sampler it counts for; re-export the weights with this version.")
    return recorded


def resolve_sampling(objective, sampler: str | None, given: dict, cfg_interval, recorded: dict, guided: bool,
                     fast: bool = False, steps: int | None = None) -> Sampling:
    """The sampling settings a command uses: each flag given wins; else what the model records (e.g. LightningDiT's
    euler, time shift 0.3, interval 0 0.89); else the objective's default sampler (`fast`: its deterministic one).
    A recorded option applies only where the sampler takes it, a recorded step count only to the recorded sampler
    (`steps` None: not given), a recorded interval only with guidance (`guided`)."""
    notes = []
    if sampler is None and recorded.get("sampler"):
        sampler = recorded["sampler"]
        if fast and not get_sampler(sampler).deterministic:
            sampler = None
        else:
            notes.append(f"sampler {sampler} (recorded with the model)")
    sampler = sampler or (objective.fast_sampler if fast else objective.default_sampler)
    get_sampler(sampler, objective)
    if steps is None and recorded.get("num_sampling_steps") and sampler == recorded.get("sampler"):
        steps = recorded["num_sampling_steps"]
        notes.append(f"{steps} steps (recorded with the model)")
    taken = tuple(o.name for o in SAMPLERS[sampler].options)
    chosen = dict(given)
    for name in taken:
        if chosen.get(name) is None and recorded.get(name) is not None:
            chosen[name] = recorded[name]
            notes.append(f"{name.replace('_', ' ')} {recorded[name]:g} (recorded with the model)")
    options = sampler_options(sampler, {k: v for k, v in chosen.items() if k in taken or given.get(k) is not None})
    if cfg_interval is None and guided and recorded.get("cfg_interval"):
        cfg_interval = tuple(recorded["cfg_interval"])
        notes.append(f"cfg interval {cfg_interval[0]:g} {cfg_interval[1]:g} (recorded with the model)")
    return Sampling(sampler, options, tuple(cfg_interval) if cfg_interval else None, tuple(notes),
                    DEFAULT_STEPS if steps is None else steps)
