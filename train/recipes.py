"""--recipe: one word for the objective, time sampling, block and optimizer defaults of a published recipe.

Only settings the command line left alone change (every explicit flag wins); the global batch and step count stay
the user's. The values are the authors' (their MIT code and configs; docs/recipes.md tabulates them): dit is
TrainConfig's defaults; sit willisma/SiT; lightning hustvl/LightningDiT `configs/lightningdit_xl_vavae_f16d32.yaml`,
whose `sample:` section is its sampling half (cfg_interval_start 0.11 counted from noise: 0 to 0.89 here); rae
bytetriper/RAE `configs/stage2/training/ImageNet256/DiTDH-XL_DINOv2-B.yaml` (docs/rae.md); meanflow the paper's
Table 4 MF-XL/2 column and Gsunshine/meanflow `configs/default.py` (c = 1e-3 is the paper's text); imf
Lyy-iiis/imeanflow `imf.py` and `configs/train_config.yml` (data_proportion 0.5 = half the samples r != t, norm_eps
0.01, s_max 7 = scales up to 8).
"""
from __future__ import annotations

import dataclasses

from shared.weights.official import RAE_SAMPLING

RECIPES = {
    "dit": {},
    "sit": {"objective": "flow", "time_sampling": "uniform"},
    "lightning": {"objective": "flow", "time_sampling": "lognormal", "time_loc": 0.0, "time_scale": 1.0,
                  "cos_weight": 1.0, "block": "lightning", "lr": 2e-4, "adam_betas": (0.9, 0.95),
                  # The sampling half, in the names of the sampling flags (shared/sampling/flags.py SamplingFlags).
                  "sampling": {"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, 0.89]}},
    "rae": {"objective": "flow", "time_sampling": "lognormal", "time_loc": 0.0, "time_scale": 1.0,
            "time_dist_shift": "auto", "block": "lightning", "lr": 2e-4, "adam_betas": (0.9, 0.95),
            "weight_decay": 0.0, "lr_schedule": "linear", "final_lr": 2e-5, "ema_decay": 0.9995,
            "max_grad_norm": 1.0, "sampling": dict(RAE_SAMPLING)},  # RAE's `sampler`: ODE, euler, 50 points
    "meanflow": {"objective": "meanflow", "pair_sampling": "lognormal", "pair_mu": -0.4, "pair_sigma": 1.0,
                 "interval_fraction": 0.25, "adaptive_p": 1.0, "adaptive_c": 1e-3, "cfg_omega": 0.2,
                 "cfg_kappa": 0.92, "cfg_min_t": 0.0, "cfg_max_t": 0.75, "adam_betas": (0.9, 0.95),
                 "sampling": {"sampler": "meanflow", "num_sampling_steps": 1}},  # lr, EMA, label dropout: the defaults
    "imf": {"objective": "imf", "pair_sampling": "lognormal", "pair_mu": -0.4, "pair_sigma": 1.0,
            "interval_fraction": 0.5, "adaptive_p": 1.0, "adaptive_c": 0.01, "cfg_max": 8.0, "adam_betas": (0.9, 0.95),
            "sampling": {"sampler": "meanflow", "num_sampling_steps": 1}},
}
RECIPE_HELP = {"dit": "DiT: DDPM, DiT block, AdamW lr 1e-4",
               "sit": "SiT: flow matching, uniform times, DiT block, AdamW lr 1e-4",
               "lightning": "LightningDiT: flow, logit-normal times, cosine loss, RMSNorm+SwiGLU+RoPE, AdamW lr 2e-4 "
                            "beta2 0.95",
               "rae": "RAE stage 2: flow, logit-normal times shifted by sqrt(CHW/4096), RMSNorm+SwiGLU+RoPE, AdamW lr "
                      "2e-4 beta2 0.95 linear to 2e-5, EMA 0.9995, clip 1",
               "meanflow": "MeanFlow (MF-XL/2): average velocity, (t, r) logit-normal(-0.4, 1) with 25% r != t, "
                           "adaptive weight p 1, guidance folded in (omega 0.2, kappa 0.92, t in [0, 0.75]), DiT "
                           "block, AdamW lr 1e-4 beta2 0.95; 1-step sampling",
               "imf": "improved MeanFlow: v-loss, (t, r) logit-normal(-0.4, 1) with 50% r != t, adaptive weight p 1 "
                      "c 0.01, guidance scale 1..8 and interval drawn and fed to the network (any --cfg-scale in "
                      "range at sampling), DiT block, AdamW lr 1e-4 beta2 0.95; 1-step sampling"}


def apply_recipe(cfg, explicit: set[str]):
    """The recipe's values set on `cfg` where no flag was given (`explicit`); a non-field goes to objective_options."""
    own = {f.name for f in dataclasses.fields(cfg)}
    for name, value in RECIPES[cfg.recipe].items():
        if name in own and name not in explicit:
            setattr(cfg, name, dict(value) if isinstance(value, dict) else value)
        elif name not in explicit:
            cfg.objective_options[name] = value
    return cfg
