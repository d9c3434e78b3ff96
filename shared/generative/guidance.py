"""Classifier-free guidance (Ho & Salimans, 2022, Eq. 6): the one implementation, GuidedModelFn, for sampling and
training's previews, with its settings (which latent channels, the scale and interval checks, the one-line rule).

The guided prediction is eps_uncond + s * (eps_cond - eps_uncond). As in the DiT release, the conditional and the
null-class rows go through ONE forward pass as the batch [x; x] with labels [y; null], and only the predicted-noise
channels are guided: the learned-variance channels (and the unguided noise channels) are the conditional one's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from shared.runtime.errors import ChoiceError, SettingError
from shared.runtime.precision import PRECISIONS, autocast_dtype

# "3": the DiT release's quirk, which guides only the first 3 of the 4 latent channels of sd-vae-ft-ema latents (kept
# to reproduce its samples and FID protocol; it means nothing for other channel counts); "all": every latent channel,
# the standard form of guidance; "auto": what the weights' own sampler does (AutoGuide), "all" for any count but 4.
GUIDE_CHANNELS = ("auto", "3", "all")
QUIRK_CHANNELS = 4  # the latent channel count the release's quirk was written for


@dataclass(frozen=True)
class AutoGuide:
    """What --guide-channels auto means for one origin of weights: what that origin's own sampler guides."""
    channels: str  # "3" or "all" (for 4-channel latents; any other count is "all" unless every_width)
    why: str
    every_width: bool = False  # the origin guides the first 3 channels at any latent width (LightningDiT: 3 of 32)


# What this project's own runs guide: their training previews guide all channels. Each weight source's own rule
# is its record's (shared/weights/checkpoint.py FORMATS): the DiT, SiT and LightningDiT releases guide eps[:, :3].
AUTO_OWN = AutoGuide("all", "trained by this project, whose training previews guide all channels")
GUIDE_HELP = ("latent channels guided: 3 (the DiT release's quirk for 4-channel latents), all, or auto: what the "
              "weights' own sampler does (the first 3 for the DiT, SiT and LightningDiT releases and other bare .pt "
              "state dicts of their layout; all for REPA's release, diffusers pipelines and models this project trains, whose "
              "previews guide all); the rule used is printed")


def guide_channel_count(choice: str, in_channels: int, auto: AutoGuide = AUTO_OWN) -> int | None:
    """The guided latent channels of a GUIDE_CHANNELS choice: an int, or None for all `in_channels`."""
    if choice not in GUIDE_CHANNELS:
        raise ChoiceError("guide-channel choice", choice, GUIDE_CHANNELS)
    if choice == "auto":
        if auto.every_width and auto.channels != "all":
            return int(auto.channels)
        choice = auto.channels if in_channels == QUIRK_CHANNELS else "all"
    if choice == "all":
        return None
    if in_channels != QUIRK_CHANNELS:
        raise SettingError(f"{{guide-channel choice}} 3 is the DiT release's quirk for {QUIRK_CHANNELS}-channel "
                           f"latents (it guides 3 of their 4 channels) but this model has {in_channels} latent "
                           f"channels; use {{guide-channel choice}} all (or auto, which guides all of them here).")
    return int(choice)


def describe_guidance(choice: str, in_channels: int, cfg_scale: float, interval=None, unit: str = "",
                      auto: AutoGuide = AUTO_OWN) -> str:
    """One line saying which guidance rule applies, e.g. for the sampling log."""
    if cfg_scale == 1.0:
        return "guidance: none (cfg scale 1)"
    where = f" at noise levels {interval[0]:g} to {interval[1]:g} ({unit}; conditional only elsewhere)" if interval else ""
    count = guide_channel_count(choice, in_channels, auto)
    why = f"auto: {auto.why}" if choice == "auto" and (in_channels == QUIRK_CHANNELS or auto.every_width) else choice
    if count is None:
        return f"guidance: cfg scale {cfg_scale:g} on all {in_channels} latent channels ({why}){where}"
    why = why if choice == "auto" else "as asked"
    return (f"guidance: cfg scale {cfg_scale:g} on the first {count} of {in_channels} latent channels ({why}; the "
            f"last channel and the variance are the conditional prediction's){where}")


def check_guidance(cfg_scale: float, has_null_class: bool) -> None:
    """SettingError for a scale below 1, or for guidance of a model that never learned the null class."""
    if cfg_scale < 1.0:
        raise SettingError(f"{{cfg scale}} {cfg_scale:g} is below 1; use {{cfg scale}} 1 for no guidance or a "
                           f"larger value (4.0 for pictures, 1.5 for FID as in the DiT paper).")
    if cfg_scale > 1.0 and not has_null_class:
        raise SettingError("this model was trained without class dropout (class_dropout_prob 0), so it has no "
                           "null class to guide against; use {cfg scale} 1 (no guidance).")


def _autocast(device: torch.device, precision: str):
    """fp16/bf16 autocast on `device` (weights, LayerNorm and softmax stay fp32); nothing for fp32."""
    if precision not in PRECISIONS:
        raise ChoiceError("precision", precision, PRECISIONS)
    dtype = autocast_dtype(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


class GuidedModelFn:
    """fn(x (N,C,h,w), t (N,), y (N,)) -> (N, out, h, w) float32: the DiT's guided prediction; counts network rows."""

    def __init__(self, model, cfg_scale: float, guide_channels: int | None = None, precision: str = "fp32",
                 interval: tuple[float, float] | None = None, noise_level=None):
        check_guidance(cfg_scale, model.y_embedder.has_null)
        _autocast(torch.device("cpu"), precision)  # an unknown precision fails now, not at the first step
        assert interval is None or noise_level is not None, "a guidance interval needs the objective's noise_level"
        self.model, self.cfg_scale, self.precision = model, cfg_scale, precision
        self.guided = model.in_channels if guide_channels is None else guide_channels
        self.interval, self.noise_level = interval, noise_level
        self.rows = 0  # network rows evaluated so far (a guided row costs 2)
        self.calls = {"guided": 0, "conditional": 0}  # sampler calls of each kind

    def conditional(self, x, t, y):
        """One conditional pass of N rows."""
        self.rows += len(x)
        with _autocast(x.device, self.precision):
            return self.model(x, t, y).float()  # (N, out, h, w)

    def classifier_free(self, x, t, y):
        """[cond; null] rows in one 2N batch, combined per Eq. 6 on the guided channels."""
        self.rows += 2 * len(x)
        null = torch.full_like(y, self.model.null_label)  # (N,)
        g = self.guided
        with _autocast(x.device, self.precision):
            out = self.model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))  # (2N, out, h, w)
            cond, uncond = out[: len(x)], out[len(x):]  # (N, out, h, w) each
            eps = uncond[:, :g] + self.cfg_scale * (cond[:, :g] - uncond[:, :g])  # (N, g, h, w)
            return torch.cat([eps, cond[:, g:]], dim=1).float(), cond.float()  # (N, out, h, w) each

    def __call__(self, x, t, y):
        inside = None
        if self.interval is not None:  # (N,) bool: lo <= level <= hi (Kynkaanniemi et al. 2024 Sec. 3; REPA's edges)
            level = self.noise_level(t)  # on t as given (flow: its float64 grid time)
            inside = (level >= self.interval[0]) & (level <= self.interval[1])
        if t.dtype == torch.float64:
            t = t.float()  # the network's time: the grid time rounded once, as REPA's sampler hands it over
        if self.cfg_scale == 1.0 or (inside is not None and not bool(inside.any())):
            self.calls["conditional"] += 1
            return self.conditional(x, t, y)
        self.calls["guided"] += 1
        guided, cond = self.classifier_free(x, t, y)
        if inside is None or bool(inside.all()):  # no interval: t is never read on the host (no GPU sync)
            return guided
        return torch.where(inside.view(-1, 1, 1, 1), guided, cond)  # rows at different levels (rare)


def check_interval(interval, level_range: tuple[float, float], unit: str, objective: str) -> tuple | None:
    """The (lo, hi) guidance interval, or None; SettingError when it is empty or outside the objective's levels."""
    if interval is None:
        return None
    lo, hi = (float(v) for v in interval)
    low, high = level_range
    if not (low <= lo < hi <= high):
        raise SettingError(f"{{cfg interval}} {lo:g} {hi:g} is not a range inside [{low:g}, {high:g}], the noise "
                           f"levels of a {objective} model ({unit}); pass LO HI with {low:g} <= LO < HI <= {high:g} "
                           f"(e.g. {0.0:g} {0.7 * high:g} guides the lower 70% of the noise levels).")
    return lo, hi
