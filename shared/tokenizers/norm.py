"""Latent normalisation: one record for how a tokenizer's raw latent z becomes what the DiT sees, and back.

Every convention in use is one formula, x = (z - mean) / std * scale, with mean and std one number or one per
channel:

    kind         mean, std                     scale              used by
    scale        0, 1                          scaling_factor     SD-VAE (0.18215), DC-AE (0.3189), MAR KL-16
    shift-scale  shift_factor, 1               scaling_factor     SD3 (0.0609, 1.5305), FLUX.1 (0.1159, 0.3611)
    channel      per-channel mean, std         1 (or the config's) VA-VAE / LightningDiT, FLUX.2, diffusers'
                                                                  latents_mean / latents_std configs
    none         0, 1                          1                  raw latents

The record travels as a JSON dict (`to_dict` / `from_dict`) in index.json (the tokenizer's own convention, in
the VAE identity), in every checkpoint and export (`latent_meta["latent_norm"]`, what the run trained on) and
in preview files. Training applies it to each fresh draw (`shared.tokenizers.vae.draw_latents`); every decode
inverts it (`LatentVAE.decode(x, norm)`). Nothing else scales a latent.

`ChannelStats` is the float64 accumulator of a folder's per-channel statistics from stored posterior moments:
mean = mean of the means; variance = variance of the means + mean of the variances (the law of total variance
over images, positions and posterior noise). Shards are combined with Chan et al.'s parallel update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

NORM_KINDS = ("scale", "shift-scale", "channel", "none")
NORM_CHOICES = ("auto", *NORM_KINDS)  # train --latent-norm: auto = the tokenizer's own convention
NORM_HELP = {
    "auto": "the tokenizer's own convention (its config's latents_mean/latents_std, else shift_factor, else "
            "scaling_factor; for VA-VAE its latents_stats.pt)",
    "scale": "z x scaling_factor (SD-VAE, DC-AE)",
    "shift-scale": "(z - shift_factor) x scaling_factor (SD3, FLUX.1); needs a shift_factor",
    "channel": "(z - mean_c) / std_c with the folder's per-channel statistics (LightningDiT's way)",
    "none": "the raw latent",
}


@dataclass(frozen=True)
class LatentNorm:
    """x = (z - mean) / std * scale; mean and std are one value or one per channel (see the module doc)."""

    kind: str
    mean: tuple = (0.0,)
    std: tuple = (1.0,)
    scale: float = 1.0
    source: str = field(default="", compare=False)  # where the numbers come from (for messages only)

    def __post_init__(self):
        if self.kind not in NORM_KINDS:
            raise ValueError(f"latent normalisation kind {self.kind!r} is not one of {NORM_KINDS}")
        if len(self.mean) != len(self.std) or not all(s > 0 for s in self.std) or not self.scale > 0:
            raise ValueError(f"latent normalisation needs matching mean/std and positive std and scale: {self}")

    # -- constructors -------------------------------------------------------------------------------------
    @classmethod
    def scale_only(cls, scale: float, source: str = "") -> "LatentNorm":
        """z x scale (SD-VAE's convention)."""
        return cls("scale", (0.0,), (1.0,), float(scale), source)

    @classmethod
    def shift_scale(cls, shift: float, scale: float, source: str = "") -> "LatentNorm":
        """(z - shift) x scale (SD3 / FLUX.1)."""
        return cls("shift-scale", (float(shift),), (1.0,), float(scale), source)

    @classmethod
    def channel(cls, mean, std, scale: float = 1.0, source: str = "") -> "LatentNorm":
        """(z - mean_c) / std_c x scale, one mean and std per channel."""
        return cls("channel", tuple(float(m) for m in mean), tuple(float(s) for s in std), float(scale), source)

    @classmethod
    def none(cls, source: str = "") -> "LatentNorm":
        """The identity: the DiT sees raw latents."""
        return cls("none", source=source)

    # -- use ------------------------------------------------------------------------------------------------
    @property
    def channels(self) -> int | None:
        """Channels of a per-channel record, None for a scalar one."""
        return len(self.mean) if self.kind == "channel" else None

    def _view(self, values, like: torch.Tensor) -> torch.Tensor:
        """(C,) or (1,) values as a (1, C, 1, 1) tensor on like's device, fp32."""
        return torch.tensor(values, dtype=torch.float32, device=like.device).view(1, -1, 1, 1)

    def check_channels(self, channels: int, where: str = "these latents") -> None:
        """ValueError when a per-channel record does not have `channels` entries."""
        if self.channels is not None and self.channels != channels:
            raise ValueError(f"a per-channel normalisation of {self.channels} channels cannot apply to {where} "
                             f"with {channels} channels")

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents (N,C,h,w) -> normalised, fp32."""
        self.check_channels(z.shape[1])
        z = z.float()
        return (z - self._view(self.mean, z)) / self._view(self.std, z) * self.scale

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised latents (N,C,h,w) -> raw, fp32 (the inverse of `apply`)."""
        self.check_channels(x.shape[1])
        x = x.float()
        return x / self.scale * self._view(self.std, x) + self._view(self.mean, x)

    # -- records --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON form written to index.json, checkpoints, exports and preview files."""
        return {"kind": self.kind, "mean": list(self.mean), "std": list(self.std), "scale": self.scale,
                "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "LatentNorm":
        """The record back from its JSON form."""
        return cls(d["kind"], tuple(float(v) for v in d.get("mean", (0.0,))),
                   tuple(float(v) for v in d.get("std", (1.0,))), float(d.get("scale", 1.0)), d.get("source", ""))

    def describe(self) -> str:
        """One phrase: 'scale x0.18215', 'shift-scale (z - 0.1159) x0.3611', 'channel (32 channels)'."""
        if self.kind == "scale":
            return f"scale x{self.scale:g}"
        if self.kind == "shift-scale":
            return f"shift-scale (z - {self.mean[0]:g}) x{self.scale:g}"
        if self.kind == "channel":
            extra = f" x{self.scale:g}" if self.scale != 1 else ""
            return f"channel ((z - mean_c) / std_c{extra}, {len(self.mean)} channels)"
        return "none (raw latents)"


def norm_of_meta(latent_meta: dict | None) -> LatentNorm | None:
    """The normalisation latents were trained with, from latent metadata; older files record only a scale."""
    meta = latent_meta or {}
    if isinstance(meta.get("latent_norm"), dict):
        return LatentNorm.from_dict(meta["latent_norm"])
    if meta.get("scaling_factor") is not None:
        return LatentNorm.scale_only(float(meta["scaling_factor"]), source="the recorded scaling_factor")
    return None


def native_norm_of_identity(identity: dict) -> LatentNorm | None:
    """The tokenizer's own convention recorded in a VAE identity (older identities: only scaling_factor)."""
    if isinstance(identity.get("norm"), dict):
        return LatentNorm.from_dict(identity["norm"])
    if identity.get("scaling_factor") is not None:
        return LatentNorm.scale_only(float(identity["scaling_factor"]), source="the VAE's scaling_factor")
    return None


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

    def summary(self, images: int, flips: int, deterministic: bool) -> dict:
        """index.json's "latent_stats": the per-channel mean and std and what they were computed from."""
        mean, std = self.result()
        moments = "latents" if deterministic else "posterior moments (mean of the means; variance of the means + " \
                                                  "mean of the variances)"
        return {"mean": mean, "std": std, "values_per_channel": self.count, "images": images, "flips": flips,
                "computed_from": f"the stored {moments} of every image and flip, float64"}
