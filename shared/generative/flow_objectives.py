"""The flow-matching objectives: SiT's flow matching, MeanFlow and improved MeanFlow (Geng et al. 2025).

Each is a registered objective (shared/generative/objectives.py imports this module before its registry's first
read); the path and its samplers are in shared/generative/flow.py, the MeanFlow losses in meanflow.py and imf.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from shared.generative.flow import (TIME_SAMPLINGS, FlowPath, FlowProcess, check_shift, draw_time, make_process,
                                   rae_shift)
from shared.generative.imf import INTERVAL_SPLIT, NO_INTERVAL, draw_guidance, imf_losses
from shared.generative.meanflow import PAIR_SAMPLINGS, draw_pair, meanflow_losses
from shared.generative.objectives import register_objective, training_fields
from shared.generative.samplers import LAST_STEP_SIZE, TIME_SHIFT, get_sampler
from shared.runtime.cli import FLAG_KEY, option
from shared.runtime.errors import ChoiceError, SettingError


@register_objective
@dataclass
class FlowObjective:
    """SiT's flow matching: linear path, velocity prediction, uniform or logit-normal times (shared/generative/flow.py)."""
    # Recorded: the direction of the network's time input ("sit": 0 = noise; "repa": 0 = data).
    convention: str = "sit"
    # Recorded: RAE's shift of the training times and the sampling grid (1 = none; --time-dist-shift, docs/rae.md).
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
        self.path = self.make_path()  # ChoiceError for an unknown convention
        self.time_dist_shift = check_shift(self.time_dist_shift)
        if self.time_sampling not in TIME_SAMPLINGS:
            raise ChoiceError("time sampling", self.time_sampling, TIME_SAMPLINGS)
        if not self.time_scale > 0:
            raise SettingError("{time scale} must be positive; fix the flag and rerun.")
        if not self.cos_weight >= 0:
            raise SettingError("{cos weight} must be >= 0; fix the flag and rerun.")

    def make_path(self) -> FlowPath:
        """The path the loss and the samplers use (a subclass may return one whose `call` converts its output)."""
        return FlowPath(self.convention)

    def draw_time(self, generator: torch.Generator) -> torch.Tensor:
        """One training time tau (1,) float32 in SiT time (0 = noise), RAE's shift applied (RAE transport.sample)."""
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
        # The recorded RAE shift s shapes the grid as in training; a sampler --time-shift a multiplies onto it (the
        # odds: a / s in SiT time). dopri5 walks no grid: the option's default only fills the argument.
        grid_shift = options.get(TIME_SHIFT.name, TIME_SHIFT.default) / self.time_dist_shift
        return make_process(self.path, sampler, steps, grid_shift,
                            options.get(LAST_STEP_SIZE.name, LAST_STEP_SIZE.default))

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Integrate from `noise` (tau = 0) to data (tau = 1) with sampler `sampler` and its options."""
        spec = get_sampler(sampler, self)
        return spec.fn(self.process(sampler, steps, options), model_fn, noise, model_kwargs, generator, progress)


@register_objective
@dataclass
class MeanFlowObjective:
    """MeanFlow (Geng et al. 2025): the average velocity over an interval, trained through a JVP; few-step sampling."""
    # Recorded: the direction of the network's first time input (a flow model's, when fine-tuned from one); the two
    # times it embeds (t, t - r); the guidance training folded in, [omega, kappa, lo, hi] ([] = none).
    convention: str = "sit"
    time_inputs: str = "t,t-r"
    folded_guidance: list = dataclasses.field(default_factory=list)
    # Training only (flags of python -m train), in the paper's names and time (t = 1 is noise):
    pair_sampling: str = option("lognormal", "how training draws the two times t >= r: lognormal, sigmoid(N(mu, "
                                             "sigma)) each (the paper's), or uniform", choices=PAIR_SAMPLINGS)
    pair_mu: float = option(-0.4, "mean mu of the logit-normal (t, r) draw, in the paper's time (1 = noise; ImageNet: "
                                  "-0.4)")
    pair_sigma: float = option(1.0, "std sigma of the logit-normal (t, r) draw (ImageNet: 1.0)")
    interval_fraction: float = option(0.25, "the share of samples with r != t (the others train plain flow matching "
                                            "at h = 0); ImageNet: 0.25")
    adaptive_p: float = option(1.0, "power p of the adaptive loss weight 1 / (||Delta||^2 + c)^p (0 = plain squared "
                                    "error; ImageNet: 1)")
    adaptive_c: float = option(1e-3, "the constant c of the adaptive loss weight (the paper's 1e-3)")
    cfg_omega: float = option(1.0, "guidance folded into the training target: omega of v_g = omega v + kappa u(c) + "
                                   "(1 - omega - kappa) u(null) (1 with kappa 0 = no guidance; MF-XL/2: 0.2); the "
                                   "effective scale is omega / (1 - kappa), and sampling then needs no second call")
    cfg_kappa: float = option(0.0, "guidance folded into the training target: the mixing scale kappa (MF-XL/2: 0.92)")
    cfg_min_t: float = option(0.0, "folded guidance applies at noise levels t >= this (the paper's time; MF-XL/2: 0)")
    cfg_max_t: float = option(1.0, "folded guidance applies at noise levels t <= this (MF-XL/2: 0.75)")

    name: ClassVar[str] = "meanflow"
    help: ClassVar[str] = "MeanFlow: average velocity over [r, t], 1- or few-step sampling"
    family: ClassVar[str] = "meanflow"
    default_sampler: ClassVar[str] = "meanflow"
    fast_sampler: ClassVar[str] = "meanflow"
    interval_time: ClassVar[bool] = True  # the network embeds a second time (ModelConfig.interval_time)
    level_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    level_unit: ClassVar[str] = "noise level t of the interval's start (0 = data, 1 = noise; the paper's time)"

    def __post_init__(self):
        self.path = FlowPath(self.convention)  # ChoiceError for an unknown convention
        if self.time_inputs != "t,t-r":
            raise SettingError(f"the model config records MeanFlow time inputs {self.time_inputs!r}; this version "
                               "embeds only the paper's pair 't,t-r'. Re-export the weights with this version.")
        self.folded_guidance = [float(v) for v in self.folded_guidance]
        if self.folded_guidance and len(self.folded_guidance) != 4:
            raise SettingError(f"the model config records folded guidance {self.folded_guidance}; it should be "
                               "[omega, kappa, lo, hi] or []. Re-export the weights with this version.")
        if self.pair_sampling not in PAIR_SAMPLINGS:
            raise ChoiceError("(t, r) sampling", self.pair_sampling, PAIR_SAMPLINGS)
        bad = [(not self.pair_sigma > 0, "{pair sigma} must be positive (ImageNet: 1.0)"),
               (not 0 <= self.interval_fraction <= 1, "{interval fraction} is a share in [0, 1] (ImageNet: 0.25)"),
               (not self.adaptive_p >= 0, "{adaptive p} must be >= 0 (0 = plain squared error; ImageNet: 1)"),
               (not self.adaptive_c > 0, "{adaptive c} must be positive (the paper: 1e-3)"),
               (not 0 <= self.cfg_min_t <= self.cfg_max_t <= 1,
                "{cfg min t} and {cfg max t} must satisfy 0 <= min <= max <= 1 (noise levels; MF-XL/2: 0 and 0.75)"),
               (not self.cfg_kappa < 1 or not self.cfg_omega > 0,
                "{cfg omega} must be positive and {cfg kappa} below 1 (the effective scale is omega / (1 - kappa))")]
        for failed, message in bad:
            if failed:
                raise SettingError(f"{message}; fix the flag and rerun.")

    @classmethod
    def record_training(cls, options: dict) -> dict:
        """The recorded fields its training settings decide: the folded guidance [omega, kappa, lo, hi] ([] = none)."""
        defaults = {f.name: f.metadata[FLAG_KEY].default for f in training_fields(cls)}
        o = {**defaults, **{k: v for k, v in options.items() if k in defaults and v is not None}}
        if o["cfg_omega"] == 1.0 and o["cfg_kappa"] == 0.0:
            return {"folded_guidance": []}
        return {"folded_guidance": [o["cfg_omega"], o["cfg_kappa"], o["cfg_min_t"], o["cfg_max_t"]]}

    def draw_time(self, generator: torch.Generator) -> torch.Tensor:
        """One training interval (1, 2) float32: [tau (SiT time of z), h = t - r] (meanflow.draw_pair)."""
        return draw_pair(generator, self.pair_sampling, self.pair_mu, self.pair_sigma, self.interval_fraction)

    def training_losses(self, model_fn, x0, t, noise, model_kwargs=None) -> dict:
        """{"loss", "sq", "v_sq"}, each (N,): x0 (N,C,h,w) clean latents, t (N, 2) intervals, noise like x0."""
        return meanflow_losses(self.path, model_fn, x0, t, noise, dict(model_kwargs or {}), omega=self.cfg_omega,
                               kappa=self.cfg_kappa, levels=(self.cfg_min_t, self.cfg_max_t), p=self.adaptive_p,
                               c=self.adaptive_c)

    def noise_level(self, model_t: torch.Tensor) -> torch.Tensor:
        """The noise level (paper's t) of the start of each row's interval: model_t (N, 2) -> (N,) float64."""
        return self.path.noise_level(model_t[:, 0].double())

    def check_cfg_scale(self, cfg_scale: float, interval=None) -> None:
        """SettingError for sampling guidance on a field whose training already folded guidance in."""
        if cfg_scale != 1.0 and self.folded_guidance:
            omega, kappa, lo, hi = self.folded_guidance
            raise SettingError(f"these MeanFlow weights learned the guided field (omega {omega:g}, kappa {kappa:g}: "
                               f"effective scale {omega / (1 - kappa):g} at noise levels {lo:g}..{hi:g}, folded in "
                               f"at training), so guiding again at sampling would double it and cost a second "
                               f"network call per step; pass {{cfg scale}} 1.")

    def process(self, sampler: str, steps: int, options: dict) -> FlowProcess:
        """The SiT-time grid the meanflow sampler walks: `steps` uniform intervals from noise to data, time-shifted."""
        get_sampler(sampler, self)
        if steps < 1:
            raise SettingError(f"{{sampling steps}} {steps} must be at least 1 (MeanFlow: 1 or 2).")
        return make_process(self.path, "euler", steps, options.get(TIME_SHIFT.name, TIME_SHIFT.default))

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Data latents from `noise` (tau = 0) by `steps` average-velocity jumps (meanflow.meanflow_sample)."""
        spec = get_sampler(sampler, self)
        self.check_cfg_scale(float(getattr(model_fn, "cfg_scale", 1.0)), getattr(model_fn, "interval", None))
        return spec.fn(self.process(sampler, steps, options), model_fn, noise, model_kwargs, generator, progress)


def _flag_of(cls, name: str) -> dataclasses.Field:
    """A new field declaring the same training flag as `cls`'s field `name` (one flag, one default, both objectives)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=f.default, metadata=f.metadata)


@register_objective
@dataclass
class ImprovedMeanFlowObjective:
    """Improved MeanFlow (Geng et al. 2025, arXiv 2512.02012): the MeanFlow identity as a loss on the instantaneous
    velocity, guidance scale and interval as network inputs chosen at sampling (shared/generative/imf.py)."""
    # Recorded: as meanflow's convention; the guidance scales [1, w_max] training drew, the only ones the network saw.
    convention: str = "sit"
    cfg_range: list = dataclasses.field(default_factory=lambda: [1.0, 8.0])
    # Training only (flags of python -m train), shared with meanflow (the recipe sets the paper's values):
    pair_sampling: str = _flag_of(MeanFlowObjective, "pair_sampling")
    pair_mu: float = _flag_of(MeanFlowObjective, "pair_mu")
    pair_sigma: float = _flag_of(MeanFlowObjective, "pair_sigma")
    interval_fraction: float = _flag_of(MeanFlowObjective, "interval_fraction")
    adaptive_p: float = _flag_of(MeanFlowObjective, "adaptive_p")
    adaptive_c: float = _flag_of(MeanFlowObjective, "adaptive_c")
    cfg_max: float = option(8.0, "the largest guidance scale w improved MeanFlow trains with: w is drawn log-uniform "
                                 "in [1, cfg max] per sample and fed to the network, so python -m sample takes any "
                                 "--cfg-scale in that range in one network call (the release: 8)", min=1)

    name: ClassVar[str] = "imf"
    help: ClassVar[str] = "improved MeanFlow: v-loss on the average velocity, guidance chosen at sampling"
    family: ClassVar[str] = "meanflow"
    default_sampler: ClassVar[str] = "meanflow"
    fast_sampler: ClassVar[str] = "meanflow"
    interval_time: ClassVar[bool] = True  # the network embeds t - r (ModelConfig.interval_time)
    guidance_inputs: ClassVar[bool] = True  # and 1 - 1/w, t_min, t_max (ModelConfig.guidance_inputs)
    level_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    level_unit: ClassVar[str] = "noise level t (0 = data, 1 = noise; the paper's time)"

    def __post_init__(self):
        self.path = FlowPath(self.convention)  # ChoiceError for an unknown convention
        self.cfg_range = [float(v) for v in self.cfg_range]
        if len(self.cfg_range) != 2 or not 1.0 <= self.cfg_range[0] <= self.cfg_range[1]:
            raise SettingError(f"the model config records the guidance range {self.cfg_range}; it should be "
                               "[1, w_max]. Re-export the weights with this version.")
        if self.pair_sampling not in PAIR_SAMPLINGS:
            raise ChoiceError("(t, r) sampling", self.pair_sampling, PAIR_SAMPLINGS)

    @classmethod
    def record_training(cls, options: dict) -> dict:
        """The recorded guidance range its training draws from: [1, cfg_max]."""
        cfg_max = options.get("cfg_max")
        return {"cfg_range": [1.0, float(cfg_max if cfg_max is not None else cls.cfg_max)]}

    def draw_time(self, generator: torch.Generator) -> torch.Tensor:
        """One training row (1, 5) float32: [tau, h = t - r, 1 - 1/w, t_min, t_max] (imf.draw_guidance)."""
        pair = draw_pair(generator, self.pair_sampling, self.pair_mu, self.pair_sigma, self.interval_fraction)
        return torch.cat([pair, draw_guidance(generator, self.cfg_max, fm=bool(pair[0, 1] == 0)).view(1, 3)], dim=1)

    def training_losses(self, model_fn, x0, t, noise, model_kwargs=None) -> dict:
        """{"loss", "sq", "v_sq"}, each (N,): x0 (N,C,h,w) clean latents, t (N, 5) draws, noise like x0."""
        return imf_losses(self.path, model_fn, x0, t, noise, dict(model_kwargs or {}), p=self.adaptive_p,
                          c=self.adaptive_c)

    noise_level = MeanFlowObjective.noise_level  # of column 0 of model_t (N, 5): the start of each row's interval

    def check_cfg_scale(self, cfg_scale: float, interval=None) -> None:
        """SettingError for a scale or an interval outside those the network was conditioned on in training."""
        lo, hi = self.cfg_range
        if not lo <= cfg_scale <= hi:
            raise SettingError(f"{{cfg scale}} {cfg_scale:g} is outside [{lo:g}, {hi:g}], the guidance scales these "
                               f"improved MeanFlow weights were trained on (the scale is an input of the network, "
                               f"drawn in that range at training); pass a scale in it, or train with a larger "
                               f"--cfg-max.")
        if interval is not None and not interval[0] <= INTERVAL_SPLIT <= interval[1]:
            raise SettingError(f"{{cfg interval}} {interval[0]:g} {interval[1]:g} is not among the intervals these "
                               f"weights were trained on (t_min in [0, {INTERVAL_SPLIT:g}], t_max in "
                               f"[{INTERVAL_SPLIT:g}, 1], as the paper's); pass LO <= {INTERVAL_SPLIT:g} <= HI, or "
                               "leave it out (every level).")

    process = MeanFlowObjective.process  # the SiT-time grid the meanflow sampler walks

    def sample(self, sampler: str, model_fn, noise, steps: int, options: dict, model_kwargs=None, generator=None,
               progress=False):
        """Data latents from `noise` by `steps` jumps, the guidance fed to the network: one call per step at any scale."""
        spec = get_sampler(sampler, self)
        scale, interval = float(getattr(model_fn, "cfg_scale", 1.0)), getattr(model_fn, "interval", None)
        self.check_cfg_scale(scale, interval)
        call = getattr(model_fn, "conditional", model_fn)  # a GuidedModelFn's single pass: no [cond; null] batch
        lo, hi = interval if interval is not None else NO_INTERVAL
        guidance = torch.tensor([1 - 1 / scale, lo, hi], dtype=torch.float32).to(noise.device)  # (3,) as draw_guidance

        def fn(x, t, **kwargs):
            t = t.float()  # the grid time rounded once, as GuidedModelFn hands it over
            return call(x, torch.cat([t, guidance.expand(len(t), 3)], dim=1), **kwargs)
        return spec.fn(self.process(sampler, steps, options), fn, noise, model_kwargs, generator, progress)
