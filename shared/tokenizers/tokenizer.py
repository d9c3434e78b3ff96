"""The tokenizer: its classes (one record each: how it encodes, decodes and scales), the normalisation record, and
the wrapper that encodes and decodes one (found and loaded by shared/tokenizers/locate.py).

A diffusers folder names its class in config.json's `_class_name`; `tokenizer_class` turns it into a
`TokenizerClass` or refuses it. Another class is one `register_tokenizer(TokenizerClass(...))` call (rae.py's, or a
--plugin module's): every stage goes through `Tokenizer`, which only calls the record.

`LatentNorm` is how a raw latent z becomes what the DiT sees, and back. Every convention in use is one formula,
x = (z - mean) / std * scale, with mean and std one number, one per channel, or one per element (C, h, w):

    kind         mean, std                     scale              used by
    scale        0, 1                          scaling_factor     SD-VAE (0.18215), DC-AE (0.3189), MAR KL-16
    shift-scale  shift_factor, 1               scaling_factor     SD3 (0.0609, 1.5305), FLUX.1 (0.1159, 0.3611)
    channel      per-channel mean, std         1 (or the config's) VA-VAE / LightningDiT, FLUX.2, diffusers'
                                                                  latents_mean / latents_std configs
    element      per-element mean, std (C,h,w) 1 (or the config's) RAE (DINOv2 tokens; its stat.pt or the folder's)
    none         0, 1                          1                  raw latents

Its numbers come from the tokenizer's config or weights or a folder's statistics, never from literals, inside a
`LatentSpace` (space.py); training's draw applies it, every decode inverts it: nothing else scales a latent. The
latent shape is measured on the meta device (`measure_latent`); diffusers is imported lazily (`diffusers_class`).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from shared.runtime.errors import SettingError, UserError
from shared.runtime.registry import Registry

# ---- LatentNorm: x = (z - mean) / std * scale (the module doc's table) ----

NORM_KINDS = ("scale", "shift-scale", "channel", "element", "none")
NORM_CHOICES = ("auto", *NORM_KINDS)  # train --latent-norm: auto = the tokenizer's own convention
NORM_HELP = {"auto": "the tokenizer's own convention (its config's latents_mean/latents_std, else shift_factor, else "
                     "scaling_factor; for VA-VAE its latents_stats.pt)",
             "scale": "z x scaling_factor (SD-VAE, DC-AE)",
             "shift-scale": "(z - shift_factor) x scaling_factor (SD3, FLUX.1); needs a shift_factor",
             "channel": "(z - mean_c) / std_c with the folder's per-channel statistics (LightningDiT's way)",
             "element": "(z - mean) / std per element (C, h, w) with the folder's per-element statistics (RAE's way)",
             "none": "the raw latent"}


@dataclass(frozen=True, eq=False)
class LatentNorm:
    """x = (z - mean) / std * scale; mean and std fp32 tensors (1,), (C,) or (C, h, w) (module doc)."""

    kind: str
    mean: torch.Tensor = (0.0,)
    std: torch.Tensor = (1.0,)
    scale: float = 1.0
    source: str = ""  # where the numbers come from (messages only: never compared or hashed)

    def __post_init__(self):
        if self.kind not in NORM_KINDS:
            raise ValueError(f"latent normalisation kind {self.kind!r} is not one of {NORM_KINDS}")
        for name in ("mean", "std"):  # an own fp32 CPU copy: the record never aliases a caller's tensor
            value = torch.tensor(np.asarray(getattr(self, name), dtype=np.float32))
            object.__setattr__(self, name, value.reshape(-1) if self.kind != "element" else value)
        object.__setattr__(self, "scale", float(self.scale))
        if self.mean.shape != self.std.shape or not self.scale > 0 or not bool((self.std > 0).all()):
            raise ValueError(f"latent normalisation needs matching mean/std and positive std and scale "
                             f"({self.describe()})")
        if (self.kind == "element") != (self.mean.dim() == 3):
            raise ValueError(f"a per-element normalisation needs (C, h, w) statistics, got {tuple(self.mean.shape)}")

    def __eq__(self, other) -> bool:
        return (isinstance(other, LatentNorm) and (self.kind, self.scale) == (other.kind, other.scale)
                and torch.equal(self.mean, other.mean) and torch.equal(self.std, other.std))

    __hash__ = None

    def __repr__(self) -> str:
        return f"LatentNorm({self.describe()})"

    @classmethod
    def scale_only(cls, scale: float, source: str = "") -> "LatentNorm":
        """z x scale (SD-VAE's convention)."""
        return cls("scale", (0.0,), (1.0,), scale, source)

    @classmethod
    def shift_scale(cls, shift: float, scale: float, source: str = "") -> "LatentNorm":
        """(z - shift) x scale (SD3 / FLUX.1)."""
        return cls("shift-scale", (float(shift),), (1.0,), scale, source)

    @classmethod
    def channel(cls, mean, std, scale: float = 1.0, source: str = "") -> "LatentNorm":
        """(z - mean_c) / std_c x scale, one mean and std per channel."""
        return cls("channel", mean, std, scale, source)

    @classmethod
    def element(cls, mean, std, scale: float = 1.0, source: str = "") -> "LatentNorm":
        """(z - mean) / std x scale with one mean and std per element of shape (C, h, w)."""
        return cls("element", mean, std, scale, source)

    @classmethod
    def none(cls, source: str = "") -> "LatentNorm":
        """The identity: the DiT sees raw latents."""
        return cls("none", source=source)

    shape = property(lambda self: tuple(self.mean.shape) if self.kind == "element" else (),
                     doc="(C, h, w) of an element record, () otherwise.")

    def check_channels(self, channels: int, where: str = "these latents") -> None:
        """ValueError when a per-channel or per-element record does not have `channels` channels."""
        own = {"element": self.mean.shape[0], "channel": self.mean.numel()}.get(self.kind)  # None: a scalar record
        if own is not None and own != channels:
            raise ValueError(f"a {'per-element' if self.kind == 'element' else 'per-channel'} normalisation of {own} "
                             f"channels cannot apply to {where} with {channels} channels")

    def _on(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x fp32, mean, std broadcastable to (N, C, h, w) on x's device); ValueError for latents it cannot take."""
        shape = tuple(int(n) for n in x.shape[1:])  # (C, h, w)
        self.check_channels(shape[0], "these latents")
        if self.kind == "element" and shape != self.shape:
            raise ValueError(f"a per-element normalisation of shape {'x'.join(map(str, self.shape))} cannot apply "
                             f"to these latents of shape {'x'.join(map(str, shape))}")
        view = (1, *self.shape) if self.kind == "element" else (1, -1, 1, 1)
        return x.float(), self.mean.view(view).to(x.device), self.std.view(view).to(x.device)

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents (N,C,h,w) -> normalised, fp32."""
        z, mean, std = self._on(z)
        return (z - mean) / std * self.scale

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised latents (N,C,h,w) -> raw, fp32 (the inverse of `apply`)."""
        x, mean, std = self._on(x)
        return x / self.scale * std + mean

    def describe(self) -> str:
        """One phrase: 'scale x0.18215', 'shift-scale (z - 0.1159) x0.3611', 'channel (32 channels)'."""
        extra = f" x{self.scale:g}" if self.scale != 1 else ""
        if self.kind == "scale":
            return f"scale x{self.scale:g}"
        if self.kind == "shift-scale":
            return f"shift-scale (z - {float(self.mean[0]):g}) x{self.scale:g}"
        if self.kind == "channel":
            return f"channel ((z - mean_c) / std_c{extra}, {self.mean.numel()} channels)"
        if self.kind == "element":
            return f"element ((z - mean) / std per element{extra}, {'x'.join(map(str, self.shape))})"
        return "none (raw latents)"


@dataclass(frozen=True)
class TokenizerClass:
    """One supported tokenizer class: what each callable receives and returns is said beside it."""

    name: str                      # diffusers' _class_name
    what: str                      # one line for the refusal paragraph and the docs
    # (module, x (N,3,H,W) in [-1,1]) -> raw latents (mean, std) (N,C,h,w) fp32; std None: deterministic (the shard
    # stores the latent alone)
    encode: Callable
    decode: Callable               # (module, raw latents z) -> images (N,3,H,W)
    native_norm: Callable          # (config, module) -> LatentNorm: the tokenizer's own (`--latent-norm auto`)
    deterministic: bool = False
    decoder_parts: tuple = ("decoder", "post_quant_conv")  # cast to the decode dtype (the encoder stays fp32)
    # the latent's channels as its config declares them, for checks without diffusers; elsewhere `measure_latent`
    declared_channels: Callable = lambda config: int(config.get("latent_channels", 4))
    native_size: Callable = lambda config: None  # the one image size it takes (RAE: its decoder's), else None
    check_config: Callable = lambda config, where: None  # SettingError for a config whose parts cannot work together
    check_weights: Callable = lambda weights, config, where: None  # SettingError: a folder's weights vs its config
    element_stats: bool = False    # extraction also computes the folder's per-element statistics (C, h, w)
    family: str = "vae"            # "vae" or "rae": latents of one family never decode with the other
    model_class: type | None = None  # the class that loads it (from_config, from_pretrained); default diffusers'

    def diffusers_class(self):
        """The model class: `model_class`, else diffusers' class of this name (imported here, lazily)."""
        if self.model_class is not None:
            return self.model_class
        import diffusers
        return getattr(diffusers, self.name)

    def decode_normalised(self, module, x: torch.Tensor, norm: LatentNorm, dtype) -> torch.Tensor:
        """Images (N,3,H,W) from normalised latents x (N,C,h,w): `norm` inverted in fp32, decoded in `dtype`."""
        return self.decode(module, norm.invert(x).to(dtype))


BUILT_IN_TOKENIZERS = ("shared.tokenizers.rae",)  # registers AutoencoderRAE, imported on the first read
TOKENIZER_CLASSES: Registry[TokenizerClass] = Registry("tokenizer class", lambda spec: spec.encode.__module__,
                                                       imports=BUILT_IN_TOKENIZERS)


def register_tokenizer(spec: TokenizerClass) -> TokenizerClass:
    """Add a tokenizer class to the registry (its name is the diffusers `_class_name`)."""
    return TOKENIZER_CLASSES.register(spec.name, spec)


def tokenizer_class(config: dict, where) -> TokenizerClass:
    """The record for config.json's `_class_name` (absent: AutoencoderKL, the single-file case), or a refusal."""
    name = config.get("_class_name", "AutoencoderKL")
    if name in TOKENIZER_CLASSES:
        TOKENIZER_CLASSES[name].check_config(config, where)
        return TOKENIZER_CLASSES[name]
    supported = "; ".join(f"{k} ({v.what})" for k, v in TOKENIZER_CLASSES.items())
    raise SettingError(
        f"The tokenizer {where} is a diffusers {name}, which this pipeline does not support: it cannot say how that "
        f"class encodes, scales and decodes latents, and a guess would train on wrong latents. Supported classes: "
        f"{supported}. Pass one of those as {{vae}} (a diffusers folder whose config.json names its class), or, "
        f"for a class a module of yours registers (register_tokenizer), pass --plugin MODULE to import it.")


def _config_number(config: dict, key: str, default=None):
    """A float from the config, or `default` when absent or null."""
    value = config.get(key)
    return default if value is None else float(value)


# ---- AutoencoderKL: SD-VAE, SD3 / FLUX.1 (shift_factor), latents_mean / latents_std configs (VA-VAE) ----

def _kl_encode(module, x):
    """Posterior moments of diffusers' DiagonalGaussianDistribution (logvar clamped to [-30, 20])."""
    posterior = module.encode(x).latent_dist
    return posterior.mean.float(), posterior.std.float()  # (N, C, h, w) each


def _decode_sample(module, z):
    """module.decode(z).sample: the images (N, 3, H, W)."""
    return module.decode(z).sample


def kl_native_norm(config: dict, module=None) -> LatentNorm:
    """diffusers' convention for its config: latents_mean/std (with scaling_factor), else shift_factor, else scale."""
    scale = _config_number(config, "scaling_factor", 1.0)
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


# ---- AutoencoderDC (Chen et al. 2024, DC-AE): deterministic, one scaling_factor ----

register_tokenizer(TokenizerClass(
    "AutoencoderDC", "deterministic DC-AE, f32/f64, one scaling_factor",
    lambda module, x: (module.encode(x).latent.float(), None), _decode_sample,  # no posterior: (latent, None)
    # DC-AE's pipelines multiply by scaling_factor (0.3189 for f32c32-in)
    lambda config, module=None: LatentNorm.scale_only(_config_number(config, "scaling_factor", 1.0),
                                                      source="the VAE config's scaling_factor"),
    deterministic=True, decoder_parts=("decoder",)))


# ---- AutoencoderKLFlux2 (FLUX.2): posterior patchified 2x2 into channels, BatchNorm running stats ----

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


def _flux2_native_norm(config: dict, module=None) -> LatentNorm:
    """FLUX.2's pipeline: (z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps); needs the loaded buffers."""
    if module is None:
        return None  # the numbers live in the weights: known once loaded
    bn, eps = module.bn, float(config.get("batch_norm_eps", 1e-4))
    return LatentNorm.channel(bn.running_mean.double().tolist(), torch.sqrt(bn.running_var.double() + eps).tolist(),
                              1.0, source="the VAE's BatchNorm running statistics (FLUX.2)")


register_tokenizer(TokenizerClass(
    "AutoencoderKLFlux2", "FLUX.2's VAE: posterior patchified 2x2 into 4x the channels, per-channel BatchNorm "
                          "statistics", _flux2_encode,
    lambda module, z: module.decode(unpatchify(z, *_patch(dict(module.config)))).sample,  # unpatchify, then decode
    _flux2_native_norm,
    declared_channels=lambda config: int(config.get("latent_channels", 32)) * _patch(config)[0] * _patch(config)[1]))


# ---- The wrapper: measure a latent, encode and decode (locating and loading: locate.py) ----

PROBE_SIZE = 1024  # pixels per side of the probe image when no extraction size is given (any f <= 1024 divides it)


def measure_latent(config: dict, image_size: int | None = None, where: str = "the VAE") -> tuple[int, int, int]:
    """(C, h, w) of one image of `image_size` encoded by the tokenizer of `config`, measured on the meta device."""
    native = tokenizer_class(config, where).native_size(config)
    if native and image_size and int(image_size) != native:
        raise SettingError(
            f"{where} ({config.get('_class_name')}) encodes and decodes {native}x{native} images only (its encoder "
            f"resizes any input to its own size, and its decoder draws {native} px), so latents of {image_size}x"
            f"{image_size} images would decode at another size. Extract with {{image size}} {native}, or pass a "
            f"tokenizer made for {image_size} px.")
    size = int(image_size or probe_size(config))
    return _measure(json.dumps(config, sort_keys=True, default=list), size, str(where))


def probe_size(config: dict) -> int:
    """The image side a tokenizer is measured at when no size is given: its one size (RAE), else PROBE_SIZE."""
    return int(tokenizer_class(config, "the VAE").native_size(config) or PROBE_SIZE)


@functools.lru_cache(maxsize=32)
def _measure(config_json: str, size: int, where: str) -> tuple[int, int, int]:
    """measure_latent's work, cached per (config, size)."""
    config = json.loads(config_json)
    kind = tokenizer_class(config, where)
    cls = kind.diffusers_class()  # outside the try: a missing diffusers is no size problem
    try:
        with torch.device("meta"):
            module = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
            mean, _ = kind.encode(module, torch.empty(1, 3, size, size))
    except Exception as err:  # noqa: BLE001 - an architecture that cannot take this size: said in one paragraph
        raise SettingError(f"{where} ({kind.name}) cannot encode a {size}x{size} image ({type(err).__name__}: "
                           f"{' '.join(str(err).split())[:200]}). Pick an image size its encoder accepts (a multiple "
                           f"of its downsampling factor), or pass another {{vae}}.") from None
    return tuple(int(n) for n in mean.shape[1:])  # (C, h, w)


def downsample_factor(config: dict, image_size: int | None = None) -> int:
    """Pixels per latent cell, measured (`measure_latent`): image side / latent side."""
    size = int(image_size or probe_size(config))
    return size // measure_latent(config, size)[1]  # (C, h, w)


def latent_channels(config: dict) -> int:
    """Channels of the latent the DiT sees, measured (FLUX.2's are 4x its config's latent_channels)."""
    return measure_latent(config)[0]


def config_sha256(config: dict) -> str:
    """A hash of the architecture (keys starting with '_' are bookkeeping, e.g. the diffusers version)."""
    public = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(public, sort_keys=True, default=list).encode()).hexdigest()


# ---- Pixel ranges: uint8 images (files, npz) <-> the [-1, 1] floats a tokenizer encodes and decodes ----

def to_unit_range(pixels) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1] (ToTensor then Normalize(0.5, 0.5), as DiT does); layout unchanged."""
    pixels = torch.from_numpy(np.asarray(pixels)) if not isinstance(pixels, torch.Tensor) else pixels
    return pixels.float().div_(127.5).sub_(1.0)


def channels_first(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float32 (N, 3, H, W) in [-1, 1], the range Tokenizer encodes."""
    return to_unit_range(images).permute(0, 3, 1, 2)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Images (N,3,H,W) in [-1,1] -> uint8 (N,H,W,3), rounded as torchvision's save_image does."""
    images = ((images.float().clamp(-1, 1) + 1) * 127.5 + 0.5).clamp(0, 255)  # (N, 3, H, W) in [0, 255]
    return images.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()  # (N, H, W, 3)


class Tokenizer:
    """A tokenizer of a supported class (its `TokenizerClass` record): fp32 encoder, decoder in the requested dtype."""
    def __init__(self, vae, source: str, device, dtype=torch.float32):
        """Wrap a loaded diffusers tokenizer (shared/tokenizers/locate.py `load_tokenizer` builds one from a spec)."""
        assert dtype in (torch.float32, torch.float16, torch.bfloat16), f"decode dtype {dtype} is not fp32/fp16/bf16"
        config = dict(vae.config)
        self.kind: TokenizerClass = tokenizer_class({**config, "_class_name": type(vae).__name__}, source)
        self.vae = vae.eval().requires_grad_(False).to(device)  # loaded in fp32
        self.device, self.dtype = torch.device(device), dtype
        # Only the decoder side is cast: the moments must come from an fp32 encoder (they are stored).
        for name in self.kind.decoder_parts:
            if (part := getattr(self.vae, name, None)) is not None:
                part.to(dtype)
        self.deterministic = self.kind.deterministic
        # the tokenizer's own convention; None: it has none (an RAE without statistics: the folder's are used)
        self.norm: LatentNorm | None = self.kind.native_norm(config, self.vae)
        self.family = self.kind.family
        self.latent_channels, h, _ = measure_latent(config, where=source)
        self.downsample_factor = probe_size(config) // h
        self.image_size: int | None = self.kind.native_size(config)  # its one image size (RAE), else None
        self.scaling_factor = _config_number(config, "scaling_factor")
        self.identity = {"source": source, "class": self.kind.name,
                         **({"scaling_factor": self.scaling_factor} if self.scaling_factor is not None else {}),
                         **({"family": self.family} if self.family != "vae" else {}),  # absent: a VAE
                         "deterministic": self.deterministic, "latent_channels": self.latent_channels,
                         "downsample_factor": self.downsample_factor, "config_sha256": config_sha256(config)}

    @torch.no_grad()
    def encode_moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Raw latents of images (N,3,H,W), uint8 or in [-1,1]: (mean, std) (N,C,h,w) fp32; std None: deterministic."""
        x = images.to(self.device, non_blocking=True)
        x = to_unit_range(x) if x.dtype == torch.uint8 else x.float()  # (N, 3, H, W) in [-1, 1]
        # Autocast from a caller must not turn the stored moments into half precision.
        with torch.autocast(self.device.type, enabled=False):
            return self.kind.encode(self.vae, x)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, norm: LatentNorm | None = None) -> torch.Tensor:
        """Images (N,3,H,W) in [-1,1], fp32, from normalised latents (N,C,h,w): `norm` (default: own) inverted."""
        norm = norm or self.norm
        if norm is None:
            raise UserError(f"{self.identity['source']} has no normalisation of its own (no latents_mean / latents_std "
                            f"in its config) and these latents record none; decode latents written by training "
                            f"(their metadata records the normalisation the run trained with).")
        with torch.autocast(self.device.type, enabled=False):
            images = self.kind.decode_normalised(self.vae, latents.to(self.device), norm, self.dtype)  # (N, 3, H, W)
        return images.float().clamp_(-1.0, 1.0)

    def decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        """Images (N,3,H,W) in [-1,1], fp32, from raw latents (N,C,h,w) as the encoder gives them."""
        return self.decode(z, LatentNorm.none())

    def decode_uint8(self, latents: torch.Tensor, norm: LatentNorm | None = None) -> np.ndarray:
        """The uint8 images (N,H,W,3) a PNG or npz holds, from normalised latents (N,C,h,w) (`decode`)."""
        return to_uint8(self.decode(latents, norm))

    def enable_tiling(self):
        """Encode/decode large images tile by tile (diffusers' switch; lower memory, slight seams)."""
        self.vae.enable_tiling()

    def enable_slicing(self):
        """Encode/decode a batch one image at a time (diffusers' switch; lower peak memory)."""
        self.vae.enable_slicing()
