"""Tiny random tokenizers of every supported class, built through diffusers' own classes and save_pretrained.

Each is a few thousand parameters at downsampling factor 4 (2 for DC-AE's two stages), so a CPU test extracts,
trains and decodes with it in seconds. Their normalisation conventions mirror the real ones (FLUX.1's shift, a
VA-VAE-like latents_mean/latents_std config, DC-AE's single scale, FLUX.2's BatchNorm statistics).
"""
import re
from pathlib import Path

import torch

ATTN_PARTS = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}  # LDM -> diffusers

KL_BLOCKS = dict(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                 block_out_channels=(8, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=32)


def flux_like(out: Path, seed: int = 0) -> Path:
    """AutoencoderKL, 16 channels, f4, no quant convs, FLUX.1's convention (z - shift_factor) * scaling_factor."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    AutoencoderKL(latent_channels=16, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
                  use_post_quant_conv=False, **KL_BLOCKS).save_pretrained(out)
    return Path(out)


def vavae_like(out: Path, seed: int = 1, channels: int = 8) -> Path:
    """AutoencoderKL, f4, whose config holds per-channel latents_mean / latents_std (and scaling_factor 1)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    mean = (torch.randn(channels, generator=g) * 0.3).tolist()
    std = (torch.rand(channels, generator=g) + 0.5).tolist()
    AutoencoderKL(latent_channels=channels, scaling_factor=1.0, latents_mean=mean, latents_std=std,
                  **KL_BLOCKS).save_pretrained(out)
    return Path(out)


def dc_ae(out: Path, seed: int = 2) -> Path:
    """AutoencoderDC (deterministic), 8 channels, two stages: f2, scaling_factor as DC-AE f32c32's 0.3189."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    AutoencoderDC(in_channels=3, latent_channels=8, attention_head_dim=8,
                  encoder_block_types=("ResBlock", "EfficientViTBlock"),
                  decoder_block_types=("ResBlock", "EfficientViTBlock"),
                  encoder_block_out_channels=(16, 32), decoder_block_out_channels=(16, 32),
                  encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                  encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
                  upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
                  decoder_act_fns="silu", scaling_factor=0.3189).save_pretrained(out)
    return Path(out)


def flux2_like(out: Path, seed: int = 3) -> Path:
    """AutoencoderKLFlux2, 4 channels at f2 patchified 2x2: 16 channels at f4; random BatchNorm statistics."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                             norm_num_groups=8, sample_size=32)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(16) * 0.2)
        vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    vae.save_pretrained(out)
    return Path(out)


def unsupported(out: Path, seed: int = 4) -> Path:
    """A diffusers VQModel: a class this pipeline refuses."""
    from diffusers import VQModel

    torch.manual_seed(seed)
    VQModel(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, num_vq_embeddings=16,
            vq_embed_dim=4).save_pretrained(out)
    return Path(out)


# A tiny RAE: a 1-layer DINOv2-with-registers encoder of width 64 (patch 4 at 16 px: 4x4 tokens of 64 channels) and
# a 1-layer ViT decoder of patch 8 (32 px images), a few hundred thousand parameters.
RAE_TINY = dict(encoder_type="dinov2", encoder_hidden_size=64, encoder_patch_size=4, encoder_num_hidden_layers=1,
                encoder_input_size=16, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                decoder_num_attention_heads=2, decoder_intermediate_size=64, patch_size=8)


def rae(out: Path, seed: int = 5, stats: bool = True, scaling_factor: float = 1.0, perturb: float = 0.2,
        **overrides) -> Path:
    """AutoencoderRAE (diffusers), deterministic 64x4x4 tokens of 32 px images; with per-element latents_mean /
    latents_std (64, 4, 4) in its config when `stats`, else none (extraction computes the folder's)."""
    from diffusers import AutoencoderRAE

    torch.manual_seed(seed)
    config = {**RAE_TINY, **overrides}
    if stats:
        c, g = config["encoder_hidden_size"], config["encoder_input_size"] // config["encoder_patch_size"]
        config["latents_mean"] = (torch.randn(c, g, g) * 0.3).tolist()
        config["latents_std"] = (torch.rand(c, g, g) + 0.5).tolist()
    model = AutoencoderRAE(scaling_factor=scaling_factor, **config)
    with torch.no_grad():  # the decoder's zero-initialised parts made live, so decoded pixels depend on the tokens
        for p in model.decoder.parameters():
            p.add_(perturb * torch.randn_like(p))
    model.save_pretrained(out)
    return Path(out)


def vavae_ldm_state_dict(seed: int = 0) -> dict:
    """A random state dict in VA-VAE's LDM layout (tests/bench/check_lightningdit_parity.py checks these names against
    LightningDiT's own module), plus training-only tensors of its checkpoint that the conversion must drop."""
    from diffusers import AutoencoderKL

    from shared.tokenizers.vavae import vavae_config

    torch.manual_seed(seed)
    vae = AutoencoderKL.from_config(vavae_config([0.0] * 32, [1.0] * 32))
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.02 * torch.randn_like(p))
    state = to_ldm(vae.state_dict())
    state.update({"loss.discriminator.main.0.weight": torch.zeros(2), "foundation_model.model.cls_token":
                  torch.zeros(1, 1, 4), "linear_proj.weight": torch.zeros(4, 32, 1, 1)})
    return {"state_dict": state}, vae


def to_ldm(diffusers_state: dict) -> dict:
    """diffusers AutoencoderKL names -> LDM names (the inverse of `convert_vavae`), for tests and checks."""
    out = {}
    for key, value in diffusers_state.items():
        new = key
        m = re.match(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)$",
                     key)
        if m:
            part, kind, block, what, j, rest = m.groups()
            level = int(block) if kind == "down" else 4 - int(block)
            if what == "resnets":
                new = f"{part}.{kind}.{level}.block.{j}.{rest.replace('conv_shortcut', 'nin_shortcut')}"
            elif what == "attentions":
                name, tensor = rest.rsplit(".", 1)
                ldm = {v: k for k, v in ATTN_PARTS.items()}[name]
                new = f"{part}.{kind}.{level}.attn.{j}.{ldm}.{tensor}"
                value = value[:, :, None, None] if value.dim() == 2 else value
            else:
                new = f"{part}.{kind}.{level}.{'downsample' if kind == 'down' else 'upsample'}.{rest}"
        m = re.match(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", key)
        if m:
            part, what, j, rest = m.groups()
            if what == "resnets":
                new = f"{part}.mid.block_{int(j) + 1}.{rest}"
            else:
                name, tensor = rest.rsplit(".", 1)
                ldm = {v: k for k, v in ATTN_PARTS.items()}[name]
                new = f"{part}.mid.attn_1.{ldm}.{tensor}"
                value = value[:, :, None, None] if value.dim() == 2 else value
        new = new.replace("conv_norm_out", "norm_out")
        out[new] = value
    return out


MAKERS = {"flux-like": flux_like, "vavae-like": vavae_like, "dc-ae": dc_ae, "flux2-like": flux2_like}
