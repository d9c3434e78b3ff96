"""The tokenizer classes a latent folder can be made with, each one record: how it encodes, decodes and scales.

A diffusers folder names its class in config.json's `_class_name`; `tokenizer_class` turns that name into a
`TokenizerClass` or refuses it in one paragraph naming the supported ones. Registering another class is one
`register_tokenizer(TokenizerClass(...))` call (the RAE tokenizer does so): nothing else in extract, train or
sample changes, because every stage goes through `shared.tokenizers.vae.LatentVAE`, which only calls the record.

A record says:
  encode(module, x) -> (mean, std | None)   x (N,3,H,W) in [-1,1]; raw (unnormalised) latents (N,C,h,w), fp32.
                                            std None: a deterministic tokenizer (the shard stores the latent alone)
  decode(module, z) -> images (N,3,H,W)     z raw latents
  native_norm(config, module) -> LatentNorm the tokenizer's own convention (`--latent-norm auto`)
  decoder_parts                             attribute names cast to the decode dtype (the encoder stays fp32)

diffusers is imported only when a class is loaded (`diffusers_class`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shared.runtime.errors import SettingError
from shared.tokenizers.norm import LatentNorm


@dataclass(frozen=True)
class TokenizerClass:
    """One supported tokenizer class (see the module doc for what each callable receives and returns)."""

    name: str                      # diffusers' _class_name
    what: str                      # one line for the refusal paragraph and the docs
    encode: Callable
    decode: Callable
    native_norm: Callable
    deterministic: bool = False
    decoder_parts: tuple = ("decoder", "post_quant_conv")
    # The latent's channels as its config declares them, for checks in processes without diffusers (train's
    # --watch-vae); everywhere else the shape is measured (shared.tokenizers.vae.measure_latent).
    declared_channels: Callable = lambda config: int(config.get("latent_channels", 4))

    def diffusers_class(self):
        """The diffusers model class (imported here, lazily)."""
        import diffusers

        return getattr(diffusers, self.name)


TOKENIZER_CLASSES: dict[str, TokenizerClass] = {}


def register_tokenizer(spec: TokenizerClass) -> TokenizerClass:
    """Add a tokenizer class to the registry (its name is the diffusers `_class_name`)."""
    TOKENIZER_CLASSES[spec.name] = spec
    return spec


def tokenizer_class(config: dict, where) -> TokenizerClass:
    """The record for config.json's `_class_name` (absent: AutoencoderKL, the single-file case), or a refusal."""
    name = config.get("_class_name", "AutoencoderKL")
    if name in TOKENIZER_CLASSES:
        return TOKENIZER_CLASSES[name]
    supported = "; ".join(f"{k} ({v.what})" for k, v in TOKENIZER_CLASSES.items())
    raise SettingError(
        f"The tokenizer {where} is a diffusers {name}, which this pipeline does not support: it cannot say how that "
        f"class encodes, scales and decodes latents, and a guess would train on wrong latents. Supported classes: "
        f"{supported}. Pass one of those as {{vae}} (a diffusers folder whose config.json names its class)."
    )


def _config_number(config: dict, key: str):
    """A float from the config, or None when absent or null."""
    value = config.get(key)
    return None if value is None else float(value)


# ----------------------------------------------------------------------------------------------------------
# AutoencoderKL: SD-VAE, SD3 / FLUX.1 (shift_factor), configs with latents_mean / latents_std (VA-VAE here)
# ----------------------------------------------------------------------------------------------------------

def _kl_encode(module, x):
    """Posterior moments of diffusers' DiagonalGaussianDistribution (logvar clamped to [-30, 20])."""
    posterior = module.encode(x).latent_dist
    return posterior.mean.float(), posterior.std.float()  # (N, C, h, w) each


def _decode_sample(module, z):
    """module.decode(z).sample: the images (N, 3, H, W)."""
    return module.decode(z).sample


def kl_native_norm(config: dict, module=None) -> LatentNorm:
    """diffusers' convention for its config: latents_mean/std (with scaling_factor), else shift_factor, else scale."""
    scale = _config_number(config, "scaling_factor")
    scale = 1.0 if scale is None else scale
    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is not None and std is not None:
        # diffusers' pipelines: (z - latents_mean) * scaling_factor / latents_std (e.g. SDXL's EDM variants)
        return LatentNorm.channel(mean, std, scale, source="the VAE config's latents_mean / latents_std")
    shift = _config_number(config, "shift_factor")
    if shift is not None:
        return LatentNorm.shift_scale(shift, scale, source="the VAE config's shift_factor and scaling_factor")
    return LatentNorm.scale_only(scale, source="the VAE config's scaling_factor")


AUTOENCODER_KL = register_tokenizer(TokenizerClass(
    "AutoencoderKL", "Gaussian posterior; SD-VAE, SD3, FLUX.1, VA-VAE; normalisation from scaling_factor, "
                     "shift_factor or latents_mean/latents_std", _kl_encode, _decode_sample, kl_native_norm))


# ----------------------------------------------------------------------------------------------------------
# AutoencoderDC (Chen et al. 2024, DC-AE): deterministic, one scaling_factor
# ----------------------------------------------------------------------------------------------------------

def _dc_encode(module, x):
    """The deterministic latent (no posterior): (latent, None)."""
    return module.encode(x).latent.float(), None


def _dc_native_norm(config: dict, module=None) -> LatentNorm:
    """DC-AE's pipelines multiply by scaling_factor (0.3189 for f32c32-in)."""
    scale = _config_number(config, "scaling_factor")
    return LatentNorm.scale_only(1.0 if scale is None else scale, source="the VAE config's scaling_factor")


register_tokenizer(TokenizerClass(
    "AutoencoderDC", "deterministic DC-AE, f32/f64, one scaling_factor", _dc_encode, _decode_sample,
    _dc_native_norm, deterministic=True, decoder_parts=("decoder",)))


# ----------------------------------------------------------------------------------------------------------
# AutoencoderKLFlux2 (FLUX.2): posterior patchified 2x2 into channels, normalised by its BatchNorm running stats
# ----------------------------------------------------------------------------------------------------------

def _patch(config: dict) -> tuple[int, int]:
    """FLUX.2's latent patch (p, q) from config.json (diffusers' default (2, 2))."""
    p = config.get("patch_size", (2, 2))
    return (int(p), int(p)) if isinstance(p, int) else (int(p[0]), int(p[1]))


def patchify(z, p: int, q: int):
    """(N,C,h,w) -> (N,C*p*q,h/p,w/q) in FLUX.2's channel order (channel, row offset, column offset)."""
    n, c, h, w = z.shape
    return z.view(n, c, h // p, p, w // q, q).permute(0, 1, 3, 5, 2, 4).reshape(n, c * p * q, h // p, w // q)


def unpatchify(x, p: int, q: int):
    """The inverse of `patchify`: (N,C*p*q,h,w) -> (N,C,h*p,w*q)."""
    n, cpq, h, w = x.shape
    return x.reshape(n, cpq // (p * q), p, q, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, cpq // (p * q), h * p, w * q)


def _flux2_encode(module, x):
    """Posterior moments, patchified as FLUX.2's pipeline does before its BatchNorm (element-wise: exact)."""
    mean, std = _kl_encode(module, x)
    p, q = _patch(dict(module.config))
    return patchify(mean, p, q), patchify(std, p, q)  # (N, 4C, h/2, w/2)


def _flux2_decode(module, z):
    """Unpatchify, then decode."""
    p, q = _patch(dict(module.config))
    return module.decode(unpatchify(z, p, q)).sample


def _flux2_native_norm(config: dict, module=None) -> LatentNorm:
    """FLUX.2's pipeline: (z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps); needs the loaded buffers."""
    if module is None:
        return None  # the numbers live in the weights: known once loaded
    bn = module.bn
    eps = float(config.get("batch_norm_eps", 1e-4))
    std = torch.sqrt(bn.running_var.double() + eps)
    return LatentNorm.channel(bn.running_mean.double().tolist(), std.tolist(), 1.0,
                              source="the VAE's BatchNorm running statistics (FLUX.2)")


register_tokenizer(TokenizerClass(
    "AutoencoderKLFlux2", "FLUX.2's VAE: posterior patchified 2x2 into 4x the channels, per-channel BatchNorm "
                          "statistics", _flux2_encode, _flux2_decode, _flux2_native_norm,
    declared_channels=lambda config: int(config.get("latent_channels", 32)) * _patch(config)[0] * _patch(config)[1]))
