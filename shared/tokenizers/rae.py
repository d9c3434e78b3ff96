"""RAE's tokenizer whole: the AutoencoderRAE class record (Zheng et al. 2025), the check of a folder's weights
against its config, and RAE's released tokenizer by name (DINOv2-B tokens, RAE's ViT-XL decoder, its statistics).

The record: the shards store the raw tokens (deterministic: no std). AutoencoderRAE's own normalisation,
(z - latents_mean) / (latents_std + 1e-5) * scaling_factor, is skipped and becomes our LatentNorm (`_rae_native_norm`):
one owner, and decoding through it equals AutoencoderRAE.decode(AutoencoderRAE.encode(x)). AutoencoderRAE's images are
in [0, 1] (RAE's ToTensor inputs), ours in [-1, 1]. Registered when tokenizer.py reads BUILT_IN_TOKENIZERS.

The release (docs/rae.md): `--vae rae-dinov2-b`, the tokenizer RAE's ImageNet-256 DiT^DH-XL was trained on and is
sampled with (bytetriper/RAE, MIT: configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml, stage_1). Its three
files come through the release download cache (shared/runtime/download.py) and are converted once into a diffusers
`AutoencoderRAE` folder in the user cache, every tensor mapped by name and loaded strictly. RAE's (z - mean) /
sqrt(var + 1e-5) (src/stage1/rae.py) is stored as latents_std = sqrt(var + 1e-5) - 1e-5: diffusers adds its 1e-5
back, and the two agree to float32 rounding.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.runtime.errors import SettingError
from shared.tokenizers.tokenizer import LatentNorm, TokenizerClass, register_tokenizer
from shared.tokenizers.locate import converted_folder, file_stamps, register_converted


# ---- The class record: encode, decode, its own normalisation, the checks of its config and weights ----

DIFFUSERS_RAE_EPS = 1e-5  # diffusers' AutoencoderRAE._normalize_latents: (z - mean) / (std + 1e-5)


def rae_geometry(config: dict) -> dict:
    """An AutoencoderRAE config's shapes: token channels and grid, decoder patch and output size (its defaults)."""
    enc_in, enc_patch = int(config.get("encoder_input_size", 224)), int(config.get("encoder_patch_size", 14))
    patch = int(config.get("patch_size", 16))
    grid = enc_in // enc_patch if enc_patch > 0 else 0
    return {"channels": int(config.get("encoder_hidden_size", 768)), "grid": grid, "patch": patch,
            "encoder_input_size": enc_in, "encoder_patch_size": enc_patch, "image_size": patch * grid}


def check_rae_config(config: dict, where) -> None:
    """Refuse an AutoencoderRAE config whose encoder, decoder and statistics do not fit together (one paragraph)."""
    geo = rae_geometry(config)
    problems = []
    if geo["encoder_patch_size"] <= 0 or geo["encoder_input_size"] % geo["encoder_patch_size"]:
        problems.append(f"its encoder_input_size {geo['encoder_input_size']} is not a multiple of its "
                        f"encoder_patch_size {geo['encoder_patch_size']}")
    if config.get("image_size") is not None and int(config["image_size"]) != geo["image_size"]:
        problems.append(f"its decoder draws image_size {config['image_size']} px, but {geo['grid']}x{geo['grid']} "
                        f"tokens of decoder patch {geo['patch']} make {geo['image_size']} px")
    if config.get("reshape_to_2d", True) is False:
        problems.append("reshape_to_2d is false (the DiT needs the tokens as a (C, h, w) grid)")
    if config.get("encoder_type", "dinov2") not in ("dinov2", "siglip2", "mae"):
        problems.append(f"its encoder_type {config['encoder_type']!r} is not dinov2, siglip2 or mae")
    latent = (geo["channels"], geo["grid"], geo["grid"])
    for key in [k for k in ("latents_mean", "latents_std") if config.get(k) is not None]:  # they normalise (C, g, g)
        shape, fits = "unreadable (not a list of numbers)", False  # ragged lists, strings
        with contextlib.suppress(ValueError, TypeError, RuntimeError):  # RuntimeError: shapes that do not broadcast
            shape = tuple(torch.as_tensor(config[key], dtype=torch.float32).shape)
            fits = torch.broadcast_shapes(shape, (1, *latent)) == (1, *latent)
        if not fits:  # the first one that does not is said
            problems.append(f"its {key} has shape {shape}, which is not the (C, h, w) = {latent} of its encoder's "
                            f"tokens (encoder_hidden_size {latent[0]}, {geo['encoder_input_size']} px / patch "
                            f"{geo['encoder_patch_size']} = {latent[1]})")
            break
    if problems:
        raise SettingError(
            f"The RAE tokenizer {where} does not fit together: {'; '.join(problems)}. An RAE's decoder must be "
            f"trained on its own encoder's tokens and its statistics computed from them; pass the folder (config.json "
            f"and weights) saved from one RAE, or remove latents_mean / latents_std from its config.json so "
            f"extraction computes the folder's per-element statistics.")


def _rae_tokens(module, x):
    """Raw encoder tokens (N, C, g, g) of images x (N,3,H,W) in [-1,1], before AutoencoderRAE's normalisation."""
    pixels = module._resize_and_normalize((x + 1) / 2)  # [0, 1], bicubic to encoder_input_size, ImageNet mean/std
    mae = (module.config.encoder_patch_size,) if module.config.encoder_type == "mae" else ()  # MAE takes its patch
    tokens = module._encoder_forward_fn(module.encoder, pixels, *mae)  # (N, T, C), CLS and registers dropped
    n, t, c = tokens.shape
    return tokens.transpose(1, 2).reshape(n, c, math.isqrt(t), math.isqrt(t))  # (N, C, g, g)


def _rae_decode(module, z):
    """Raw tokens (N, C, g, g) -> images (N, 3, H, W) in [-1, 1] (AutoencoderRAE._decode without denormalising)."""
    n, c, h, w = z.shape
    tokens = z.reshape(n, c, h * w).transpose(1, 2)  # (N, T, C)
    patches = module.decoder(tokens).logits  # (N, T, p*p*3)
    pixels = module._denormalize_image(module.decoder.unpatchify(patches))  # (N, 3, H, W), ~[0, 1]
    return pixels * 2 - 1


def _rae_native_norm(config: dict, module=None) -> LatentNorm | None:
    """AutoencoderRAE's own normalisation as a per-element record, or None (no statistics: the folder's are used):
    diffusers' x = (z - latents_mean) / (latents_std + 1e-5) * scaling_factor: the std is latents_std + 1e-5 in fp32."""
    if config.get("latents_mean") is None and config.get("latents_std") is None:
        return None
    geo = rae_geometry(config)
    shape = (1, geo["channels"], geo["grid"], geo["grid"])
    mean, std = (torch.broadcast_to(torch.as_tensor(default if config.get(key) is None else config[key],
                                                    dtype=torch.float32), shape)
                 for key, default in (("latents_mean", 0.0), ("latents_std", 1.0)))  # (1, C, g, g) each
    if module is not None:  # what the loaded module really uses (its buffers); must be what the config says
        if not all(torch.equal(torch.broadcast_to(buffer.detach().float().cpu(), shape), value)
                   for buffer, value in ((module._latents_mean, mean), (module._latents_std, std))):
            raise SettingError("The RAE tokenizer's weights hold other latents_mean / latents_std than its config.json "
                               "says; the folder was edited or mixed from two RAEs. Save it again from one "
                               "AutoencoderRAE (save_pretrained), or pass another {vae}.")
    scale = float(config.get("scaling_factor") or 1.0)
    return LatentNorm.element(mean[0], std[0] + DIFFUSERS_RAE_EPS, scale,
                              source="the RAE config's latents_mean / latents_std (diffusers: (z - mean) / (std + "
                                     "1e-5) x scaling_factor)")


@functools.lru_cache(maxsize=16)
def _check_rae_weights(weights: str, size: int, mtime_ns: int, config_json: str, where: str) -> None:
    """An RAE folder's tensors against the shapes its config builds, from the safetensors header (no weights read)."""
    from safetensors import SafetensorError, safe_open

    config = json.loads(config_json)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AUTOENCODER_RAE.diffusers_class().from_config(
            {k: v for k, v in config.items() if not k.startswith("_")}).state_dict().items()}
    try:
        with safe_open(weights, framework="pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise SettingError(f"The RAE weights {weights} cannot be read ({err}); download or save the folder again, or "
                           f"pass another {{vae}}.") from None
    wrong = [k for k in expected if k in found and found[k] != expected[k]]
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if not (wrong or missing or unexpected):
        return
    geo = rae_geometry(config)
    parts = []
    embed = "decoder.decoder_embed.weight"
    if embed in wrong:  # (decoder width, token channels)
        parts.append(f"its decoder reads tokens of {found[embed][1]} channels, its encoder gives {geo['channels']} "
                     f"(encoder_hidden_size)")
    pred = "decoder.decoder_pred.weight"
    if pred in wrong:  # (patch^2 x 3, decoder width)
        parts.append(f"its decoder draws {found[pred][0]} values per token, its config's decoder patch "
                     f"{geo['patch']} needs {expected[pred][0]}")
    if wrong:
        parts.append(f"{len(wrong)} tensors of other shapes than its config builds (e.g. {wrong[0]}: "
                     f"{list(found[wrong[0]])} in the weights, {list(expected[wrong[0]])} for the config)")
    parts += [f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in
              (("tensors its config needs are missing", missing), ("tensors are not in its config", unexpected))
              if keys]
    raise SettingError(
        f"The RAE tokenizer {where} does not fit together: {'; '.join(parts)}. An RAE's decoder works only on the "
        f"tokens of the encoder it was trained on, with the statistics computed from them; pass a folder saved "
        f"from one AutoencoderRAE (save_pretrained), or fix its config.json to the weights' encoder and decoder.")


def check_rae_weights(weights, config: dict, where) -> None:
    """A folder's weights file against its config (`TokenizerClass.check_weights`; cached per file and config)."""
    stat = Path(weights).stat()
    _check_rae_weights(str(weights), stat.st_size, stat.st_mtime_ns, json.dumps(config, sort_keys=True), str(where))


AUTOENCODER_RAE = register_tokenizer(TokenizerClass(
    "AutoencoderRAE", "RAE: a frozen representation encoder's patch tokens (DINOv2-B: 768x16x16) and a ViT decoder; "
                      "deterministic; per-element statistics from its config or the folder",
    lambda module, x: (_rae_tokens(module, x).float(), None), _rae_decode, _rae_native_norm,  # no posterior
    deterministic=True, decoder_parts=("decoder",),
    declared_channels=lambda config: rae_geometry(config)["channels"],
    native_size=lambda config: rae_geometry(config)["image_size"], check_config=check_rae_config,
    check_weights=check_rae_weights, element_stats=True, family="rae"))


# ---- RAE's release by name: three files converted once into an AutoencoderRAE folder ----

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
    return "decoder." + functools.reduce(lambda k, part: k.replace(*part), _DECODER_PARTS.items(), key)


def rae_decoder_key(key: str) -> str:
    """AutoencoderRAE's decoder tensor name -> RAE's GeneralDecoder name (the inverse of `decoder_key`)."""
    return functools.reduce(lambda k, part: k.replace(part[1], part[0]), _DECODER_PARTS.items(),
                            key.removeprefix("decoder."))


def build_rae(release: RAERelease, decoder_state: dict, stats: dict, encoder_state: dict, where: dict):
    """The diffusers AutoencoderRAE of a release from RAE's three files; every tensor placed strictly."""
    from diffusers import AutoencoderRAE

    geo = rae_geometry(release.config)
    latent = (geo["channels"], geo["grid"], geo["grid"])
    if not isinstance(stats, dict) or not all(isinstance(stats.get(k), torch.Tensor) for k in ("mean", "var")):
        raise SettingError(f"{where['stats']} is not RAE's statistics file (a dict of 'mean' and 'var' tensors); "
                           f"download it again, or pass an AutoencoderRAE folder as {{vae}}.")
    element = {}  # RAE's stat.pt {"mean", "var"} -> float64 (C, h, w)
    for key in ("mean", "var"):
        value = stats[key].double()
        element[key] = value[0] if value.dim() == 4 and value.shape[0] == 1 else value
        if tuple(element[key].shape) != latent:
            raise SettingError(f"The RAE statistics {where['stats']} have {key} of shape {tuple(stats[key].shape)}, "
                               f"not the (C, h, w) = {latent} of the encoder's tokens: they belong to another encoder "
                               f"or input size. Download the statistics of this RAE again, or pass an AutoencoderRAE "
                               f"folder as {{vae}}.")
    std = torch.sqrt(element["var"] + RAE_EPS) - DIFFUSERS_RAE_EPS  # diffusers adds its eps back: sqrt(var + eps)
    model = AutoencoderRAE(**release.config, latents_mean=element["mean"].float().tolist(),
                           latents_std=std.float().tolist())
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
    paths = [fetch(file, release_url(file, url), instead)[0]
             for file, url in (release.decoder, release.stats, release.encoder)]

    def build():
        decoder, stats, encoder = paths
        fix = ("Delete it from the checkpoint cache and run again to download it, or pass an AutoencoderRAE folder "
               "as {vae}.")
        if problem := safetensors_problem(encoder):
            raise SettingError(f"The DINOv2 encoder weights {encoder} cannot be read ({problem}). {fix}")
        from safetensors.torch import load_file

        return build_rae(release, load_torch_file(decoder, fix), load_torch_file(stats, fix), load_file(str(encoder)),
                         {"decoder": decoder, "stats": stats, "encoder": encoder})

    return name, converted_folder(name, json.dumps([release.config, *file_stamps(paths)], sort_keys=True), build)


register_converted(tuple(RAE_TOKENIZERS), locate_rae_release)
