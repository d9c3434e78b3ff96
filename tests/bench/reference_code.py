"""Plumbing the parity checks share to run another project's own code beside ours (check_*_parity.py).

Their code is never copied here: each check points at a checkout. What they import and this project cannot
(timm, fairscale, torchvision) gets a minimal stand-in written for the checks; `load_file` imports one file by
path with its `@torch.compile` decorators switched off; `perturb_` makes zero-initialised gates live so the
comparison covers every tensor; `report` prints one line per compared output.
"""
import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn


class TimmPatchEmbed(nn.Module):
    """timm's PatchEmbed as DiT-family code uses it: a kxk stride-k convolution, flattened row-major; no norm."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim, bias=True):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x):
        """(N, C, H, W) -> (N, T, D)."""
        return self.proj(x).flatten(2).transpose(1, 2)


class TimmMlp(nn.Module):
    """timm's Mlp: fc1, activation, fc2."""

    def __init__(self, in_features, hidden_features, act_layer=nn.GELU, drop=0):
        super().__init__()
        self.fc1, self.act, self.fc2 = (nn.Linear(in_features, hidden_features), act_layer(),
                                        nn.Linear(hidden_features, in_features))

    def forward(self, x):
        """(..., D) -> (..., D)."""
        return self.fc2(self.act(self.fc1(x)))


def stand_in_timm(mlp=TimmMlp, attention=nn.Identity) -> None:
    """timm, timm.models and timm.models.vision_transformer (PatchEmbed, Mlp, Attention) in sys.modules."""
    vit = types.ModuleType("timm.models.vision_transformer")
    vit.PatchEmbed, vit.Mlp, vit.Attention = TimmPatchEmbed, mlp, attention
    timm = types.ModuleType("timm")
    timm.models = types.ModuleType("timm.models")
    timm.models.vision_transformer = vit
    sys.modules.update({"timm": timm, "timm.models": timm.models, "timm.models.vision_transformer": vit})


def stand_in_modules(*names: str) -> None:
    """Empty modules under these names (imported by the reference code, never used by the checks)."""
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))


def load_file(repo: Path, relative: str, name: str):
    """Import one file of a checkout by path as module `name`, with torch.compile a no-op while it loads."""
    compile_ = torch.compile
    torch.compile = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    try:
        spec = importlib.util.spec_from_file_location(name, repo / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        torch.compile = compile_
    return module


@torch.no_grad()
def perturb_(model: nn.Module, scale: float = 0.05, generator: torch.Generator | None = None,
             trainable_only: bool = False) -> nn.Module:
    """Add scale * N(0, 1) to every parameter (or every trainable one), so zero-initialised gates become live.

    generator None draws from torch's global generator, seeded by the caller.
    """
    for p in model.parameters():
        if p.requires_grad or not trainable_only:
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model.eval()


def report(what: str, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Print the largest absolute and relative difference of one output; return the relative one."""
    diff = (ours - theirs).abs().max().item()
    rel = diff / theirs.abs().max().item()
    print(f"{what:<40} max |diff| {diff:.3e}  relative {rel:.3e}  shape {tuple(theirs.shape)}")
    return rel
