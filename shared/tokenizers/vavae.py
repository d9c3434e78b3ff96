"""VA-VAE (Yao et al. 2025, hustvl/LightningDiT, MIT), the tokenizer of LightningDiT's records, as a diffusers
AutoencoderKL.

VA-VAE is LDM's KL autoencoder (ch 128, ch_mult (1, 1, 2, 2, 4), z 32 channels, attention at LDM's "resolution 16":
the encoder's last level and the decoder's first, plus both mid-blocks), and every part has an exact diffusers
counterpart, so the released checkpoint converts exactly (tests/bench/check_lightningdit_parity.py compares with
LightningDiT's own code). Training-only parts (DINOv2, VF-loss projection, LPIPS/discriminator) are dropped; its
latents_stats.pt (1, 32, 1, 1) become latents_mean / latents_std with scaling_factor 1, as LightningDiT trains.
"""
from __future__ import annotations

import re

from shared.runtime.errors import SettingError
from shared.tokenizers.locate import _hub_file, converted_folder, file_stamps, register_converted

VAVAE_REPO = "hustvl/vavae-imagenet256-f16d32-dinov2"
VAVAE_WEIGHTS = "vavae-imagenet256-f16d32-dinov2.pt"
VAVAE_STATS = "latents_stats.pt"
LEVELS = 5  # ch_mult (1, 1, 2, 2, 4)


def vavae_config(mean, std) -> dict:
    """The diffusers AutoencoderKL config of VA-VAE f16d32, its normalisation from latents_stats.pt."""
    return {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * (LEVELS - 1) + ["AttnDownEncoderBlock2D"],
            "up_block_types": ["AttnUpDecoderBlock2D"] + ["UpDecoderBlock2D"] * (LEVELS - 1),
            "block_out_channels": [128, 128, 256, 256, 512], "layers_per_block": 2, "act_fn": "silu",
            "latent_channels": 32, "norm_num_groups": 32, "sample_size": 256,
            "scaling_factor": 1.0, "shift_factor": None,  # LightningDiT's latent_multiplier 1.0
            "latents_mean": [float(v) for v in mean], "latents_std": [float(v) for v in std],
            "force_upcast": True, "use_quant_conv": True, "use_post_quant_conv": True, "mid_block_add_attention": True}


_ATTN_PARTS = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _attention_key(key: str) -> str | None:
    """diffusers' name of an LDM attention tensor inside a down or up level, else None."""
    m = re.match(r"(encoder|decoder)\.(down|up)\.(\d+)\.attn\.(\d+)\.(norm|q|k|v|proj_out)\.(weight|bias)$", key)
    if m is None:
        return None
    part, kind, level, j, name, tensor = m.groups()
    block = int(level) if kind == "down" else LEVELS - 1 - int(level)  # diffusers' up blocks run low res first
    return f"{part}.{kind}_blocks.{block}.attentions.{j}.{_ATTN_PARTS[name]}.{tensor}"


def convert_vavae(state_dict: dict) -> dict:
    """LDM (VA-VAE) tensor names -> diffusers AutoencoderKL names; training-only tensors dropped."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    if isinstance(state_dict.get("state_dict"), dict):
        state_dict = state_dict["state_dict"]
    kept = {k: v for k, v in state_dict.items()
            if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv."))}
    attention = {k: v for k, v in kept.items() if _attention_key(k)}
    config = vavae_config([0.0] * 32, [1.0] * 32)
    converted = convert_ldm_vae_checkpoint({k: v for k, v in kept.items() if k not in attention}, config)
    for key, value in attention.items():
        # LDM's 1x1 convolutions become diffusers' linear layers: (C, C, 1, 1) -> (C, C)
        converted[_attention_key(key)] = value[:, :, 0, 0] if value.dim() == 4 else value
    return converted


def locate_vavae(name: str):
    """(the Hub id recorded, the folder): the released checkpoint and latents_stats.pt, converted once."""
    weights, stats = _hub_file(VAVAE_REPO, VAVAE_WEIGHTS), _hub_file(VAVAE_REPO, VAVAE_STATS)

    def build():
        """A diffusers AutoencoderKL holding the released VA-VAE weights and its statistics (strict load)."""
        from diffusers import AutoencoderKL

        from shared.weights.export import load_torch_file
        try:  # strict: every tensor of the conversion must load
            # LightningDiT's latents_stats.pt: {"mean", "std"} each (1, C, 1, 1)
            moments = load_torch_file(stats, f"Download latents_stats.pt of {VAVAE_REPO} again.")
            state = load_torch_file(weights, f"Download {VAVAE_WEIGHTS} again.")
            vae = AutoencoderKL.from_config(vavae_config(*(moments[k].flatten().double().tolist()
                                                           for k in ("mean", "std"))))
            vae.load_state_dict(convert_vavae(state), strict=True)
            return vae
        except RuntimeError as err:
            raise SettingError(f"{weights} is not VA-VAE f16d32's checkpoint ({' '.join(str(err).split())[:200]}); "
                               f"download it again (`huggingface-cli download {VAVAE_REPO} {VAVAE_WEIGHTS}`).") from None

    stamp = ":".join(file_stamps([weights, stats]))
    return VAVAE_REPO, converted_folder("vavae-imagenet256-f16d32-dinov2", stamp, build)


register_converted(("vavae", VAVAE_REPO), locate_vavae)
