"""Latent normalisation: one record for how a tokenizer's raw latent z becomes what the DiT sees, and back.

Every convention in use is one formula, x = (z - mean) / std * scale, with mean and std one number, one per
channel, or one per element of the latent (C, h, w):

    kind         mean, std                     scale              used by
    scale        0, 1                          scaling_factor     SD-VAE (0.18215), DC-AE (0.3189), MAR KL-16
    shift-scale  shift_factor, 1               scaling_factor     SD3 (0.0609, 1.5305), FLUX.1 (0.1159, 0.3611)
    channel      per-channel mean, std         1 (or the config's) VA-VAE / LightningDiT, FLUX.2, diffusers'
                                                                  latents_mean / latents_std configs
    element      per-element mean, std (C,h,w) 1 (or the config's) RAE (DINOv2 tokens; its stat.pt or the folder's)
    none         0, 1                          1                  raw latents

Its statistics are fp32 tensors; it travels inside a `LatentSpace` (shared/tokenizers/space.py: kind and scale
in JSON, the numbers in safetensors). Training applies it to each fresh draw (`shared.datasets.shards.draw_latents`);
every decode inverts it (`Tokenizer.decode(x, norm)`). Nothing else scales a latent.

`ChannelStats` is the float64 accumulator of a folder's per-channel statistics from stored posterior moments
(`ElementStats` the same per element, for deterministic tokens):
mean = mean of the means; variance = variance of the means + mean of the variances (the law of total variance
over images, positions and posterior noise). Shards are combined with Chan et al.'s parallel update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import safetensors.torch
import torch

NORM_KINDS = ("scale", "shift-scale", "channel", "element", "none")
NORM_CHOICES = ("auto", *NORM_KINDS)  # train --latent-norm: auto = the tokenizer's own convention
NORM_HELP = {
    "auto": "the tokenizer's own convention (its config's latents_mean/latents_std, else shift_factor, else "
            "scaling_factor; for VA-VAE its latents_stats.pt)",
    "scale": "z x scaling_factor (SD-VAE, DC-AE)",
    "shift-scale": "(z - shift_factor) x scaling_factor (SD3, FLUX.1); needs a shift_factor",
    "channel": "(z - mean_c) / std_c with the folder's per-channel statistics (LightningDiT's way)",
    "element": "(z - mean) / std per element (C, h, w) with the folder's per-element statistics (RAE's way)",
    "none": "the raw latent",
}


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

    @property
    def channels(self) -> int | None:
        """Channels of a per-channel or per-element record, None for a scalar one."""
        if self.kind == "element":
            return self.shape[0]
        return self.mean.numel() if self.kind == "channel" else None

    def check_channels(self, channels: int, where: str = "these latents") -> None:
        """ValueError when a per-channel or per-element record does not have `channels` channels."""
        if self.channels is not None and self.channels != channels:
            what = "per-element" if self.kind == "element" else "per-channel"
            raise ValueError(f"a {what} normalisation of {self.channels} channels cannot apply to {where} "
                             f"with {channels} channels")

    def check_shape(self, shape, where: str = "these latents") -> None:
        """ValueError when latents of shape (C, h, w) cannot take this record (channels; an element record's grid)."""
        self.check_channels(int(shape[0]), where)
        if self.kind == "element" and tuple(int(n) for n in shape) != self.shape:
            raise ValueError(f"a per-element normalisation of shape {'x'.join(map(str, self.shape))} cannot apply "
                             f"to {where} of shape {'x'.join(str(int(n)) for n in shape)}")

    def _on(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) broadcastable to (N, C, h, w) on like's device, fp32."""
        view = (1, *self.shape) if self.kind == "element" else (1, -1, 1, 1)
        return self.mean.view(view).to(like.device), self.std.view(view).to(like.device)

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents (N,C,h,w) -> normalised, fp32."""
        self.check_shape(z.shape[1:])
        z = z.float()
        mean, std = self._on(z)
        return (z - mean) / std * self.scale

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised latents (N,C,h,w) -> raw, fp32 (the inverse of `apply`)."""
        self.check_shape(x.shape[1:])
        x = x.float()
        mean, std = self._on(x)
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


# ----------------------------------------------------------------------------------------------------------
# Per-channel statistics of a folder, from stored moments, in float64
# ----------------------------------------------------------------------------------------------------------

@dataclass
class ChannelStats:
    """Running per-channel count, mean of the means, sum of squared deviations of the means, sum of variances."""

    count: int = 0
    mean: list = field(default_factory=list)  # (C,) float64 as a list (JSON-able)
    m2: list = field(default_factory=list)    # (C,) sum over values of (mean_value - channel mean)^2
    var_sum: list = field(default_factory=list)  # (C,) sum of the posterior variances (0 when deterministic)

    def add(self, mean: torch.Tensor, std: torch.Tensor | None) -> None:
        """Fold in moments (..., C, h, w) (any leading dims: images, flips); std None for a deterministic latent."""
        m = mean.double().movedim(-3, 0).reshape(mean.shape[-3], -1)  # (C, n)
        n = m.shape[1]
        part_mean = m.mean(dim=1)
        part = ChannelStats(n, part_mean.tolist(), ((m - part_mean[:, None]) ** 2).sum(dim=1).tolist(),
                            (std.double().movedim(-3, 0).reshape(std.shape[-3], -1) ** 2).sum(dim=1).tolist()
                            if std is not None else [0.0] * m.shape[0])
        self.merge(part)

    def merge(self, other: "ChannelStats") -> None:
        """Combine two partial statistics (Chan, Golub & LeVeque 1979, the pairwise update)."""
        if other.count == 0:
            return
        if self.count == 0:
            self.count, self.mean, self.m2, self.var_sum = other.count, list(other.mean), list(other.m2), list(
                other.var_sum)
            return
        a, b = torch.tensor(self.mean, dtype=torch.float64), torch.tensor(other.mean, dtype=torch.float64)
        n = self.count + other.count
        delta = b - a
        mean = a + delta * other.count / n
        m2 = (torch.tensor(self.m2, dtype=torch.float64) + torch.tensor(other.m2, dtype=torch.float64)
              + delta ** 2 * self.count * other.count / n)
        var_sum = torch.tensor(self.var_sum, dtype=torch.float64) + torch.tensor(other.var_sum, dtype=torch.float64)
        self.count, self.mean, self.m2, self.var_sum = n, mean.tolist(), m2.tolist(), var_sum.tolist()

    def to_dict(self) -> dict:
        """The partial sums (written in each shard's sidecar)."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "var_sum": self.var_sum}

    @classmethod
    def from_dict(cls, d: dict) -> "ChannelStats":
        return cls(int(d["count"]), list(d["mean"]), list(d["m2"]), list(d["var_sum"]))

    def result(self) -> tuple[list[float], list[float]]:
        """(mean_c, std_c): std^2 = variance of the means + mean of the variances (population, /N)."""
        var = [(m2 + vs) / self.count for m2, vs in zip(self.m2, self.var_sum)]
        return list(self.mean), [math.sqrt(v) for v in var]

    def summary(self, images: int, flips: int, deterministic: bool) -> tuple[LatentNorm, dict]:
        """The folder's "channel" normalisation and what it was computed from."""
        mean, std = self.result()
        moments = "latents" if deterministic else "posterior moments (mean of the means; variance of the means + " \
                                                  "mean of the variances)"
        return (LatentNorm.channel(mean, std, 1.0, source="the latent folder's per-channel statistics"),
                {"values_per_channel": self.count, "images": images, "flips": flips,
                 "computed_from": f"the stored {moments} of every image and flip, float64"})


# ----------------------------------------------------------------------------------------------------------
# Per-element statistics of a folder of deterministic tokens (RAE), in float64
# ----------------------------------------------------------------------------------------------------------

# RAE's eps (bytetriper/RAE src/stage1/rae.py: (z - mean) / sqrt(var + eps), eps 1e-5): the per-element std of a
# folder is sqrt(var + ELEMENT_EPS), so an element that never varies (a border token, a tiny folder) stays finite.
ELEMENT_EPS = 1e-5


@dataclass
class ElementStats:
    """Running count, mean and sum of squared deviations of every element (C, h, w) of deterministic latents."""

    count: int = 0
    mean: torch.Tensor | None = None  # (C, h, w) float64
    m2: torch.Tensor | None = None    # (C, h, w) float64

    def add(self, latents: torch.Tensor) -> None:
        """Fold in latents (..., C, h, w) (any leading dims: images, flips)."""
        z = latents.double().reshape(-1, *latents.shape[-3:])  # (n, C, h, w)
        part_mean = z.mean(dim=0)
        self.merge(ElementStats(z.shape[0], part_mean, ((z - part_mean) ** 2).sum(dim=0)))

    def merge(self, other: "ElementStats") -> None:
        """Chan et al.'s pairwise update, element by element."""
        if other.count == 0:
            return
        if self.count == 0:
            self.count, self.mean, self.m2 = other.count, other.mean.clone(), other.m2.clone()
            return
        if other.mean.shape != self.mean.shape:
            raise ValueError(f"per-element statistics of shapes {tuple(self.mean.shape)} and "
                             f"{tuple(other.mean.shape)} cannot be merged")
        n = self.count + other.count
        delta = other.mean - self.mean
        self.mean = self.mean + delta * other.count / n
        self.m2 = self.m2 + other.m2 + delta ** 2 * self.count * other.count / n
        self.count = n

    def to_bytes(self) -> bytes:
        """The partial sums as safetensors bytes, float64 exact (each shard's stats file beside its sidecar)."""
        sums = {"mean": self.mean, "m2": self.m2} if self.count else {}
        return safetensors.torch.save({"count": torch.tensor([self.count]), **sums})

    @classmethod
    def from_bytes(cls, data: bytes) -> "ElementStats":
        tensors = safetensors.torch.load(data)
        count = int(tensors["count"])
        return cls(count, tensors["mean"], tensors["m2"]) if count else cls()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) (C, h, w) float64: std = sqrt(population variance + ELEMENT_EPS), RAE's convention."""
        return self.mean, torch.sqrt(self.m2 / self.count + ELEMENT_EPS)

    def summary(self, images: int, flips: int) -> tuple[LatentNorm, dict]:
        """The folder's "element" normalisation (float32) and what it was computed from."""
        mean, std = self.result()
        return (LatentNorm.element(mean, std, 1.0, source="the latent folder's per-element statistics"),
                {"eps": ELEMENT_EPS, "values_per_element": self.count, "images": images, "flips": flips,
                 "computed_from": f"the stored latents of every image and flip, float64; std = sqrt(variance + "
                                  f"{ELEMENT_EPS:g}) as RAE's stat.pt is used"})
