"""LightningDiT's released DiTs (Yao et al. 2025, hustvl/LightningDiT, MIT) in our DiT with the `lightning` block.

`lightningdit-xl-imagenet256-800ep.pt` (FID 1.35 with guidance) and `-64ep.pt` (2.11) are LightningDiT-XL/1 on
VA-VAE f16d32 latents (32x16x16 at 256 px, normalised per channel by VA-VAE's latents_stats.pt): depth 28, width
1152, patch 1, RMSNorm, SwiGLU, 2-D RoPE, no QK-norm, no learned sigma, SiT's flow (time 0 = noise, velocity).
Their tensor names are ours with the lightning block (shared/network/models.py follows LightningDiT's names), so
the mapping is the identity after unwrapping the checkpoint ("ema", else "model") and dropping DDP/compile prefixes;
the architecture is inferred from the tensors and every tensor must load strictly.
`tests/bench/check_lightningdit_parity.py` compares our forward with LightningDiT's own model on random weights of
its layout. Sampling as LightningDiT does (its configs/reproductions/*.yaml): Euler, 250 steps, timestep shift 0.3,
guidance on the first 3 of 32 channels (its forward_with_cfg keeps DiT's quirk), scale 6.7 (800 epochs) or 10
(64 epochs), only where its time is at least 0.125 (the guidance interval).
"""
from __future__ import annotations

import dataclasses

from shared.network.models import ModelConfig, infer_model_config
from shared.runtime.errors import UserError

# LightningDiT's sampling settings (configs/reproductions/*.yaml), recorded with the release's ModelConfig so
# python -m sample and evaluate run use them with no flags (a flag given still wins): Euler (250 steps is sample's
# own default), timestep shift 0.3, guidance only where LightningDiT's time (0 = noise) is at least
# cfg_interval_start, i.e. our noise levels 0 .. 1 - start. The scale stays a flag: it is printed.
CFG_INTERVAL_START = {"lightningdit-xl-imagenet256-800ep.pt": 0.125, "lightningdit-xl-imagenet256-64ep.pt": 0.10}
CFG_SCALES = {"lightningdit-xl-imagenet256-800ep.pt": 6.7, "lightningdit-xl-imagenet256-64ep.pt": 10.0}


def release_sampling(name: str) -> dict:
    """The sampling half LightningDiT's config gives release `name`, in python -m sample's flag names."""
    start = CFG_INTERVAL_START.get(name, CFG_INTERVAL_START["lightningdit-xl-imagenet256-800ep.pt"])
    return {"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, round(1.0 - start, 6)]}


def lightningdit_state_dict(obj, where) -> dict:
    """The EMA weights of a LightningDiT checkpoint ({"ema", "model", ...} from its train.py, or bare), unwrapped."""
    if isinstance(obj, dict) and isinstance(obj.get("ema"), dict):
        obj = obj["ema"]
    elif isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not obj:
        raise UserError(f"{where} holds no LightningDiT state dict (neither an 'ema' nor a 'model' entry, nor bare "
                        f"tensors); download it again from its Hugging Face repository.")
    for prefix in ("module.", "_orig_mod."):
        if all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return dict(obj)


def release_model_config(state: dict, where) -> ModelConfig:
    """Our ModelConfig of LightningDiT weights: shapes inferred, flow in SiT's time direction, its sampling half."""
    config = infer_model_config(state)
    if config.block != "lightning" or config.learn_sigma:
        raise UserError(f"{where} is not a LightningDiT release: its tensors describe the {config.block} block"
                        f"{' with learned sigma' if config.learn_sigma else ''}, LightningDiT's released models use "
                        f"the lightning block (RMSNorm, SwiGLU, RoPE) without learned sigma.")
    return dataclasses.replace(config, objective="flow", objective_args={"convention": "sit"},
                               sampling=release_sampling(getattr(where, "name", str(where))))
