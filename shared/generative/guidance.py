"""Classifier-free guidance settings (Ho & Salimans, 2022): which latent channels are guided (the DiT release's
quirk, all, or what the weights' own sampler does), the scale and interval checks, and the one-line description.

The guided prediction itself is shared/sampling/generate.py's GuidedModelFn, for sampling and training's previews.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.runtime.errors import ChoiceError, SettingError

# "3": the DiT release's quirk, which guides only the first 3 of the 4 latent channels of sd-vae-ft-ema
# latents (kept for exact reproduction of its samples and FID protocol; it means nothing for other channel
# counts); "all": every latent channel, the standard form of guidance; "auto": what the weights' own sampler
# does (AutoGuide below), and "all" for any channel count but 4.
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
