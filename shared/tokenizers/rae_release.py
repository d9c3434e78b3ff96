"""RAE's released tokenizer by name: DINOv2-B (with registers) tokens, RAE's ViT-XL decoder and its ImageNet statistics.

`--vae rae-dinov2-b` is the tokenizer RAE's ImageNet-256 DiT^DH-XL was trained on and is sampled with
(bytetriper/RAE, MIT: configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml, stage_1). Three files come through
the release download cache (shared/runtime/download.py; `$DIT_DOWNLOAD_URL` replaces their base):

    RAE-decoder-ViTXL-DINOv2-B.pt      nyu-visionx/RAE-collections decoders/dinov2/wReg_base/ViTXL_n08/model.pt:
                                       RAE's `GeneralDecoder` state dict (ViT-MAE decoder blocks, patch 16, 1152 wide,
                                       28 blocks, 16 heads, MLP 4096: its configs/decoder/ViTXL)
    RAE-stats-DINOv2-B-ImageNet1k.pt   nyu-visionx/RAE-collections stats/dinov2/wReg_base/imagenet1k/stat.pt:
                                       {"mean", "var"}, per element (768, 16, 16) (a leading 1 allowed)
    dinov2-with-registers-base.safetensors   facebook/dinov2-with-registers-base model.safetensors: the frozen
                                       encoder RAE loads with transformers (`Dinov2withNorm`, its final LayerNorm
                                       without affine parameters)

They are converted once into a diffusers `AutoencoderRAE` folder in the user cache: every tensor mapped by name
and loaded with strict=True (the only tensors not kept: the encoder's final LayerNorm weight and bias, which RAE
removes, and the decoder's fixed sin-cos table, checked equal to the one diffusers rebuilds). RAE normalises
(z - mean) / sqrt(var + 1e-5) (src/stage1/rae.py); diffusers divides by (latents_std + 1e-5), so the folder holds
latents_std = sqrt(var + 1e-5) - 1e-5 and the two agree to float32 rounding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from shared.runtime.errors import SettingError
from shared.tokenizers.tokenizer import DIFFUSERS_RAE_EPS, rae_geometry
from shared.tokenizers.locate import converted_folder, file_stamps, register_converted

HF_RAE = "https://huggingface.co/nyu-visionx/RAE-collections/resolve/main/"  # RAE's README: hf download this repo
HF_DINOV2 = "https://huggingface.co/facebook/dinov2-with-registers-base/resolve/main/model.safetensors"
RAE_EPS = 1e-5  # RAE's own normalisation: (z - mean) / sqrt(var + eps) (src/stage1/rae.py, its default eps)


@dataclass(frozen=True)
class RAERelease:
    """A released RAE tokenizer: its AutoencoderRAE config and its three files (cache name, URL)."""

    config: dict
    decoder: tuple[str, str]
    stats: tuple[str, str]
    encoder: tuple[str, str]

    def files(self) -> tuple[tuple[str, str], ...]:
        return self.decoder, self.stats, self.encoder


RAE_TOKENIZERS = {
    # DINOv2-B with registers at 224 px (patch 14: 16x16 tokens of 768), RAE's ViT-XL decoder (patch 16: 256 px).
    "rae-dinov2-b": RAERelease(
        config={"encoder_type": "dinov2", "encoder_hidden_size": 768, "encoder_patch_size": 14,
                "encoder_num_hidden_layers": 12, "encoder_input_size": 224, "decoder_hidden_size": 1152,
                "decoder_num_hidden_layers": 28, "decoder_num_attention_heads": 16, "decoder_intermediate_size": 4096,
                "patch_size": 16, "image_size": 256, "scaling_factor": 1.0},
        decoder=("RAE-decoder-ViTXL-DINOv2-B.pt", HF_RAE + "decoders/dinov2/wReg_base/ViTXL_n08/model.pt"),
        stats=("RAE-stats-DINOv2-B-ImageNet1k.pt", HF_RAE + "stats/dinov2/wReg_base/imagenet1k/stat.pt"),
        encoder=("dinov2-with-registers-base.safetensors", HF_DINOV2)),
}

# The latents RAE's released DiT^DH-XL (ImageNet 256) was trained on: this tokenizer's normalised tokens. A state
# dict of RAE's layout on tokens of this shape is decoded by it (shared/weights/checkpoint.py), with its own statistics.
RAE_DIT_LATENTS = {"vae": "rae-dinov2-b", "image_size": 256, "latent_shape": [768, 16, 16]}

# RAE's decoder block names (transformers' ViT-MAE) -> diffusers' RAEDecoder (its Attention's q/k/v/out).
_DECODER_PARTS = {"attention.attention.query.": "attention.to_q.", "attention.attention.key.": "attention.to_k.",
                  "attention.attention.value.": "attention.to_v.", "attention.output.dense.": "attention.to_out.0."}
POS_EMBED = "decoder_pos_embed"  # RAE keeps its fixed sin-cos table as a parameter; diffusers rebuilds it
# RAE's Dinov2withNorm sets the final LayerNorm's weight and bias to None (normalize=True): unused, not kept.
ENCODER_DROPPED = ("layernorm.weight", "layernorm.bias")


def decoder_key(key: str) -> str:
    """RAE's GeneralDecoder tensor name -> AutoencoderRAE's."""
    for ours, theirs in _DECODER_PARTS.items():
        if ours in key:
            key = key.replace(ours, theirs)
    return "decoder." + key


def rae_decoder_key(key: str) -> str:
    """AutoencoderRAE's decoder tensor name -> RAE's GeneralDecoder name (the inverse of `decoder_key`)."""
    key = key.removeprefix("decoder.")
    for ours, theirs in _DECODER_PARTS.items():
        if theirs in key:
            key = key.replace(theirs, ours)
    return key


def _element_stats(stats, geo: dict, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """RAE's stat.pt {"mean", "var"} -> (mean, var) float64 (C, h, w), or a refusal naming the shapes."""
    latent = (geo["channels"], geo["grid"], geo["grid"])
    if not isinstance(stats, dict) or not all(isinstance(stats.get(k), torch.Tensor) for k in ("mean", "var")):
        raise SettingError(f"{where} is not RAE's statistics file (a dict of 'mean' and 'var' tensors); download it "
                           f"again, or pass an AutoencoderRAE folder as {{vae}}.")
    out = []
    for key in ("mean", "var"):
        value = stats[key].double()
        value = value[0] if value.dim() == 4 and value.shape[0] == 1 else value
        if tuple(value.shape) != latent:
            raise SettingError(f"The RAE statistics {where} have {key} of shape {tuple(stats[key].shape)}, not the "
                               f"(C, h, w) = {latent} of the encoder's tokens: they belong to another encoder or "
                               f"input size. Download the statistics of this RAE again, or pass an AutoencoderRAE "
                               f"folder as {{vae}}.")
        out.append(value)
    return out[0], out[1]


def build_rae(release: RAERelease, decoder_state: dict, stats: dict, encoder_state: dict, where: dict):
    """The diffusers AutoencoderRAE of a release from RAE's three files; every tensor placed strictly."""
    from diffusers import AutoencoderRAE

    geo = rae_geometry(release.config)
    mean, var = _element_stats(stats, geo, where["stats"])
    std = torch.sqrt(var + RAE_EPS) - DIFFUSERS_RAE_EPS  # diffusers adds its eps back: sqrt(var + eps) as RAE
    model = AutoencoderRAE(**release.config, latents_mean=mean.float().tolist(), latents_std=std.float().tolist())
    own = model.state_dict()
    state = {k: v for k, v in own.items() if k in ("encoder_mean", "encoder_std", "_latents_mean", "_latents_std")}
    decoder_state = {k.removeprefix("module."): v for k, v in decoder_state.items()}
    table = decoder_state.pop(POS_EMBED, None)
    if table is not None and not torch.allclose(table.float().cpu(), model.decoder.decoder_pos_embed, atol=1e-5):
        raise SettingError(f"The RAE decoder {where['decoder']} has another position table than RAE's sin-cos one "
                           f"for {geo['grid']}x{geo['grid']} tokens: it was trained for another token grid. Download "
                           f"the decoder of this RAE again.")
    state.update({decoder_key(k): v for k, v in decoder_state.items()})
    state.update({"encoder." + k: v for k, v in encoder_state.items() if k not in ENCODER_DROPPED})
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        parts = [f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in
                 (("tensors the RAE needs are missing", missing), ("tensors are not the RAE's", unexpected),
                  ("tensors have other shapes than the RAE's", wrong)) if keys]
        raise SettingError(f"RAE's released files ({where['decoder']}, {where['encoder']}) do not make the RAE "
                           f"{geo['channels']}x{geo['grid']}x{geo['grid']} tokens -> {geo['image_size']} px: "
                           f"{'; '.join(parts)}. A download was mixed with another release or cut short; delete "
                           f"them from the checkpoint cache and run again, or pass an AutoencoderRAE folder as {{vae}}.")
    model.load_state_dict(state, strict=True)
    return model


def locate_rae_release(name: str):
    """(the name recorded, the folder): its three files through the release cache, converted once."""
    from shared.runtime.download import fetch, release_url
    from shared.weights.export import load_torch_file, safetensors_problem

    release = RAE_TOKENIZERS[name]
    instead = "or pass a local AutoencoderRAE folder instead of the name"
    paths = [fetch(file, release_url(file, url), instead)[0] for file, url in release.files()]

    def build():
        decoder, stats, encoder = paths
        fix = ("Delete it from the checkpoint cache and run again to download it, or pass an AutoencoderRAE folder "
               "as {vae}.")
        problem = safetensors_problem(encoder)
        if problem:
            raise SettingError(f"The DINOv2 encoder weights {encoder} cannot be read ({problem}). {fix}")
        from safetensors.torch import load_file

        return build_rae(release, load_torch_file(decoder, fix), load_torch_file(stats, fix), load_file(str(encoder)),
                         {"decoder": decoder, "stats": stats, "encoder": encoder})

    return name, converted_folder(name, json.dumps([release.config, *file_stamps(paths)], sort_keys=True), build)


register_converted(tuple(RAE_TOKENIZERS), locate_rae_release)
