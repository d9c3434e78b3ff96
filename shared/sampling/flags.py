"""Flag families the commands that decode and sample share, each stated once (default and help).

A command's options dataclass derives from a family (`class SampleOptions(SamplingFlags, DecodeFlags)`) or
takes one member as a field, `vae: str | None = VAE.field()`, and may change what differs for it (evaluate
run redeclares `num_sampling_steps: int = NUM_SAMPLING_STEPS.field(default=50, help=STEPS_HELP)`).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.runtime.cli import Flag, flag_name, option
from shared.runtime.plugins import PLUGIN
from shared.generative.samplers import (DEFAULT_STEPS, SAMPLER_OPTIONS, SAMPLERS, SamplerOption, sampler_names,
                                        takers_of)
from shared.generative.guidance import GUIDE_CHANNELS, GUIDE_HELP
from shared.runtime.precision import PRECISIONS
from shared.sampling.compiled import COMPILE_HELP, COMPILE_MODES

# ---- the VAE that turns latents into pixels (sample, decode, watch, export, evaluate run) -----------------
VAE = Flag("the tokenizer that decodes the latents (any tokenizer, not only a VAE): ema | mse "
           "(stabilityai/sd-vae-ft-*), a released name (rae-dinov2-b, vavae), a hub id, or a local diffusers folder / "
           "weight file. Default: the tokenizer recorded with the weights' latent space, else ema", None)
VAE_CONFIG = Flag("config.json for a single-file --vae (default: the config.json beside it)", None)
ALLOW_OTHER_VAE = Flag("decode with a VAE whose scaling factor or config differs from the one recorded with the "
                       "latents (a deliberate swap); a VAE with other latent channels or downsample factor is always "
                       "refused", False)
CPU = Flag("run on the CPU even when a GPU is present", False)


@dataclass(kw_only=True)
class DecodeFlags:
    """The flags of every command that decodes latents with a VAE: its options dataclass derives from this."""
    vae: str | None = VAE.field()
    vae_config: str | None = VAE_CONFIG.field()
    vae_precision: str = option("fp32", "VAE decoder precision (fp32 default; bf16/fp16 halve its memory)",
                                choices=tuple(PRECISIONS))
    vae_tiling: bool = option(False, "decode in overlapping tiles (less memory, faint seams)")
    vae_slicing: bool = option(False, "decode one image of a batch at a time (less memory)")
    allow_other_vae: bool = ALLOW_OTHER_VAE.field()
    cpu: bool = CPU.field()
    plugin: list | None = PLUGIN.field()  # a tokenizer class (or objective) registered by a module of the user's

# ---- drawing images from a DiT (sample, evaluate run) ------------------------------------------------------
CFG_SCALE = Flag("classifier-free guidance scale; 1 = none (4.0 for pictures, 1.5 for FID)", 4.0)
SAMPLER = Flag("; ".join(f"{s.name} [{s.family}]: {s.help}" for s in SAMPLERS.values())
               + ". DiT's respacing calls the model at t = 0 too; the solvers' linspace spacing (diffusers' default) "
                 "steps from about t = 999/K straight to clean data. Default: the one the model's recipe records "
                 "(lightning: euler), else the objective's own (ddpm for DDPM models, sde for flow models); a sampler "
                 "of another objective is refused; a --plugin module may register more", None,
               choices=sampler_names)
STEPS_HELP = ("steps per image (model calls, twice the batch with guidance; heun: 2 calls per step): 250 as the paper "
              "for ddpm and SiT's sde, ~50 for ddim, 10-25 for dpmpp-2m and unipc")
# python -m sample's default is "not given"; evaluate run redeclares the field with its own number and STEPS_HELP.
NUM_SAMPLING_STEPS = Flag(f"{STEPS_HELP}. Not given (the default): the count the model records with its sampler "
                          f"(RAE's release: euler, 49), else {DEFAULT_STEPS}", None, type=int, min=1,
                          hint="250 as the DiT paper; DDIM often uses 50")
PRECISION = Flag("DiT precision: fp32, or fp16/bf16 autocast", "fp32", choices=tuple(PRECISIONS))
COMPILE = Flag(COMPILE_HELP, "off", choices=COMPILE_MODES)
SEED = Flag("image i's label and noise come from (seed, i)", 0, aliases=("--global-seed",), min=0)
BATCH_SIZE = Flag("images per forward pass (per process)", 32, min=1, hint="images per forward pass")


def sampler_option_flag(option: SamplerOption) -> Flag:
    """The flag of a sampler option, from its record in shared/generative/samplers.py (None = not given)."""
    detail = f"; {option.detail}" if option.detail else ""
    return Flag(f"{'/'.join(takers_of(option.name))} only: {option.help}{detail} (default {option.default:g}, or the "
                f"model's recorded value)", None, type=float)


@dataclass(kw_only=True)
class SamplingFlags:
    """The flags of every command that draws images from a DiT (sample, evaluate run); the previews and the recipes'
    sampling half (ModelConfig.sampling) use the same names. A setting left unset takes the model's recorded one."""
    sampler: str | None = SAMPLER.field()  # None: the recorded sampler, else the objective's own
    num_sampling_steps: int | None = NUM_SAMPLING_STEPS.field()  # None: the recorded count, else DEFAULT_STEPS
    cfg_scale: float = CFG_SCALE.field()
    cfg_interval: tuple | None = option(  # (lo, hi) noise levels where guidance applies
        None, "guide only at noise levels in [LO, HI] (Kynkaanniemi et al. 2024); elsewhere one conditional call (half "
              "the work). Levels are the objective's: DiT timesteps 0-1000 for ddpm, the flow's noise level 0-1 "
              "(REPA's time; 0 = data) for flow. REPA: 0 0.7; LightningDiT: 0 0.89 (default: the interval the model's "
              "recipe records, e.g. lightning's 0 0.89, else every level)", type=float, nargs=2, metavar=("LO", "HI"))
    guide_channels: str = option("auto", GUIDE_HELP, choices=GUIDE_CHANNELS)
    ddim_eta: float | None = sampler_option_flag(SAMPLER_OPTIONS["ddim_eta"]).field()
    time_shift: float | None = sampler_option_flag(SAMPLER_OPTIONS["time_shift"]).field()
    last_step_size: float | None = sampler_option_flag(SAMPLER_OPTIONS["last_step_size"]).field()
    precision: str = PRECISION.field()
    compile: str = COMPILE.field()


def given_sampler_options(o) -> dict:
    """The sampler options of a SamplingFlags as given on the command line (None = not given)."""
    return {name: getattr(o, name) for name in SAMPLER_OPTIONS}


# The flag of each setting shared/ names in its errors (SettingError fields, ChoiceError settings).
SAMPLING_SETTING_FLAGS = {
    "sampler": "--sampler", "sampling steps": "--num-sampling-steps", "cfg scale": "--cfg-scale",
    "cfg interval": "--cfg-interval", "guide-channel choice": "--guide-channels", "precision": "--precision",
    "compile mode": "--compile", "last step": flag_name("last_step_size"),
    **{name.replace("_", " "): flag_name(name) for name in SAMPLER_OPTIONS}}
