"""--recipe: one word for the objective, time sampling, block and optimizer defaults of a published recipe.

A recipe only changes settings the command line left alone: every flag given explicitly wins. The values
are the authors' (read from their MIT-licensed code and configs), except the global batch and step count,
which stay the user's:

- dit (Peebles & Xie 2023): DDPM, eps + learned variance, uniform timesteps, the DiT block, AdamW(0.9,
  0.999) at lr 1e-4, no weight decay, EMA 0.9999. These are TrainConfig's own defaults.
- sit (Ma et al. 2024, willisma/SiT): the same network and optimizer, trained by flow matching on the linear
  path with uniform times; sample with its SDE (250 steps) for the paper's FID.
- lightning (Yao et al. 2025, hustvl/LightningDiT `configs/lightningdit_xl_vavae_f16d32.yaml`): flow
  matching with logit-normal times (loc 0, scale 1) and the cosine velocity-direction loss (weight 1);
  RMSNorm + SwiGLU + 2-D RoPE blocks; AdamW beta2 0.95 at lr 2e-4 (tuned for its batch 1024). Sample with
  `--sampler euler --num-sampling-steps 250 --time-shift 0.3 --cfg-interval 0 0.89` as its config does
  (`sample:` in that file: euler, timestep_shift 0.3, cfg_interval_start 0.11 in its time, where 0 = noise:
  noise levels 0 to 0.89 in ours); the model records that sampling half, so python -m sample, evaluate run and
  the previews use it when no sampling flag says otherwise (LightningDiT's cfg scale, 6.7 or 10 for VA-VAE
  latents, and its 250 steps stay the commands' own defaults).
  Its VA-VAE latents and their per-channel normalisation are not part of the recipe here (SD-VAE latents).
- rae (Zheng et al. 2025, bytetriper/RAE `configs/stage2/training/ImageNet256/DiTDH-XL_DINOv2-B.yaml`): flow
  matching with logit-normal times (`time_dist_type: logit-normal_0_1`) shifted by sqrt(C*H*W / 4096)
  (`time_dist_shift_dim` / `time_dist_shift_base`; --time-dist-shift auto), RMSNorm + SwiGLU + RoPE blocks
  (`use_rmsnorm`, `use_swiglu`, `use_rope`), AdamW lr 2e-4 betas (0.9, 0.95) no weight decay (`optimizer`),
  linear decay to 2e-5 (`scheduler`), EMA 0.9995 (`ema_decay`), gradient clipping 1.0 (`clip_grad`). Its
  sampler (`sampler`: ODE, euler, num_steps 50: torchdiffeq's Euler over 50 grid points, 49 steps) is recorded
  as its sampling half (euler, 49 steps; shared/weights/official.py RAE_SAMPLING, as RAE's released weights) and
  the shift with the model, so python -m sample applies them with no flag. The model (DiTDH-XL) and the tokenizer stay
  the user's flags. See docs/rae.md for what differs (RAE holds the LR for 40 epochs and ends its decay at
  epoch 800 of 1400; here the decay runs over the whole --max-steps).
- meanflow (Geng et al. 2025, Table 4's MF-XL/2 column; Gsunshine/meanflow `configs/default.py` for the rest):
  the meanflow objective with (t, r) ~ logit-normal(-0.4, 1.0), r != t on 25% of the samples, adaptive weight
  p = 1 (c = 1e-3, the paper's text; the JAX code's norm_eps is 0.01), classifier-free guidance folded into the
  target with omega 0.2, kappa 0.92 (effective scale 2.5) at noise levels t in [0, 0.75], label dropout 0.1,
  AdamW lr 1e-4 betas (0.9, 0.95), EMA 0.9999, batch 256 (the user's), 240 epochs for the paper's 3.43
  (the user's --epochs). Sampled with the meanflow sampler at 1 step (both recorded; --num-sampling-steps 2 for the paper's 2-step row), --cfg-scale 1.
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
                 "sampling": {"sampler": "meanflow", "num_sampling_steps": 1}},  # lr 1e-4, EMA 0.9999, label dropout 0.1: the defaults
}
RECIPE_HELP = {"dit": "DiT: DDPM, DiT block, AdamW lr 1e-4",
               "sit": "SiT: flow matching, uniform times, DiT block, AdamW lr 1e-4",
               "lightning": "LightningDiT: flow, logit-normal times, cosine loss, RMSNorm+SwiGLU+RoPE, AdamW lr 2e-4 "
                            "beta2 0.95",
               "rae": "RAE stage 2: flow, logit-normal times shifted by sqrt(CHW/4096), RMSNorm+SwiGLU+RoPE, AdamW lr "
                      "2e-4 beta2 0.95 linear to 2e-5, EMA 0.9995, clip 1",
               "meanflow": "MeanFlow (MF-XL/2): average velocity, (t, r) logit-normal(-0.4, 1) with 25% r != t, "
                           "adaptive weight p 1, guidance folded in (omega 0.2, kappa 0.92, t in [0, 0.75]), DiT "
                           "block, AdamW lr 1e-4 beta2 0.95; 1-step sampling"}


def apply_recipe(cfg, explicit: set[str]):
    """Set the recipe's values on `cfg` for every field not in `explicit` (the flags given); returns cfg.

    A name that is no TrainConfig field is a training field of the objective (cfg.objective_options).
    """
    own = {f.name for f in dataclasses.fields(cfg)}
    for name, value in RECIPES[cfg.recipe].items():
        if name in explicit:
            continue
        if name in own:
            setattr(cfg, name, dict(value) if isinstance(value, dict) else value)
        else:
            cfg.objective_options[name] = value
    return cfg
