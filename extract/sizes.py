"""--image-size against the VAE and the DiT presets: the latent must tile the image, the patches the latent."""
from __future__ import annotations

from shared.runtime.errors import UserError
from shared.network.models import PRESETS

# What the measured downsample factor belongs to, by tokenizer family (shared/tokenizers/tokenizer.py): an RAE's
# factor is its frozen encoder's patch grid, not a VAE's.
FACTOR_OWNERS = {"vae": "VAE", "rae": "RAE encoder"}


def presets_by_patch() -> dict[int, list[str]]:
    """Patch size -> the DiT presets that use it, smallest patch first."""
    groups: dict[int, list[str]] = {}
    for name, arch in PRESETS.items():
        if not arch.get("head_depth"):  # DiT^DH (RAE: patch 1 on representation tokens) is no VAE-latent preset
            groups.setdefault(arch["patch_size"], []).append(name)
    return dict(sorted(groups.items()))


def _suggestion(image_size: int, factor: int, groups: dict, owner: str) -> str:
    """'192 or 256: multiples of 64 (...), whose latents every DiT preset can train on (...)'."""
    patch = max(groups)
    unit = factor * patch
    lower = image_size // unit * unit  # the multiples just below (if > 0) and above image_size
    sizes = " or ".join(str(s) for s in (lower, lower + unit) if 0 < s != image_size)
    return (f"{sizes}: multiples of {unit} ({owner} factor {factor} x the largest DiT patch {patch}), "
            f"whose latents every DiT preset can train on (DiT itself uses 256 or 512).")


def check_image_size(image_size: int, factor: int, family: str = "vae") -> list[str]:
    """Warnings for a size only some presets can train on; UserError for one the tokenizer or no preset can use."""
    groups, owner = presets_by_patch(), FACTOR_OWNERS.get(family, "tokenizer")
    if image_size % factor:
        raise UserError(f"--image-size {image_size} is not a multiple of the {owner}'s downsample factor {factor} "
                        f"(measured by encoding a probe image): latents would not tile the image. "
                        f"Use {_suggestion(image_size, factor, groups, owner)}")
    latent = image_size // factor
    usable = [p for p in groups if latent % p == 0]
    if not usable:
        raise UserError(f"--image-size {image_size} gives {latent}x{latent} latents ({owner} factor {factor}), which no "
                        f"DiT preset can train on: the latent side must be a multiple of the patch size "
                        f"({', '.join(str(p) for p in groups)}). Use {_suggestion(image_size, factor, groups, owner)}")
    if len(usable) == len(groups):
        return []
    names = ", ".join(name for p in usable for name in groups[p])
    return [f"--image-size {image_size} gives {latent}x{latent} latents ({owner} factor {factor}): only DiT presets "
            f"with patch {' or '.join(str(p) for p in usable)} can train on them ({names}). "
            f"For any preset use {_suggestion(image_size, factor, groups, owner)}"]
