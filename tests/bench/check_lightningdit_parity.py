"""Our VA-VAE conversion and our `lightning` DiT at patch 1 against LightningDiT's own code (hustvl/LightningDiT, MIT).

Run: .venv/bin/python tests/bench/check_lightningdit_parity.py --repo PATH_TO_A_LIGHTNINGDIT_CHECKOUT
(LightningDiT's code is not part of this project and is never copied into it. Its modules import timm, fairscale
and einops, which this project does not use: the first two are replaced here by stand-ins written for this check
(timm's PatchEmbed is a strided convolution then flatten; its Mlp is fc1, GELU, fc2; fairscale is only imported),
einops must be importable (`pip install --target DIR einops` and --extra-path DIR). Its `@torch.compile`
decorators are switched off while its files load.)

1. VA-VAE: LightningDiT's tokenizer/autoencoder.py AutoencoderKL(embed_dim=32, ch_mult=(1, 1, 2, 2, 4)) with
   random weights (every tensor perturbed, so GroupNorm gains and biases are live) -> its state dict converted by
   shared/tokenizers/vavae.py into diffusers' AutoencoderKL (strict load) -> posterior mean, std and decode of the
   same input compared.
2. LightningDiT: models/lightningdit.py LightningDiT at patch 1 with the released configuration (SwiGLU, RoPE,
   RMSNorm, no QK-norm, learn_sigma False, 32 channels) and random weights -> its state dict loaded strictly by
   sample/lightningdit.py's mapping into our DiT with the `lightning` block -> forward(x, t, y) compared.
Prints the largest absolute and relative differences.
"""
import argparse
import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    """Check options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, help="a checkout of github.com/hustvl/LightningDiT")
    p.add_argument("--extra-path", default=None, help="a folder holding einops (pip install --target DIR einops)")
    p.add_argument("--image-size", type=int, default=64, help="pixels per side of the VA-VAE input")
    p.add_argument("--model", default="DiT-T/1", help="our preset whose shape the random LightningDiT takes "
                                                     "(DiT-XL/1 is LightningDiT-XL/1, the released model)")
    p.add_argument("--latent-size", type=int, default=16, help="latent side of the DiT input (16 at 256 px)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Stand-ins for what LightningDiT imports and this project does not have
# ----------------------------------------------------------------------------------------------------------

class PatchEmbed(nn.Module):
    """timm's PatchEmbed as LightningDiT uses it: a kxk stride-k convolution, tokens (N, T, D)."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim, bias=True):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Mlp(nn.Module):
    """timm's Mlp: fc1, activation, fc2 (LightningDiT's GELU branch; unused with SwiGLU)."""

    def __init__(self, in_features, hidden_features, act_layer=nn.GELU, drop=0):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(in_features, hidden_features), act_layer(), nn.Linear(
            hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def install_stand_ins():
    """timm.models.vision_transformer and fairscale modules in sys.modules."""
    vit = types.ModuleType("timm.models.vision_transformer")
    vit.PatchEmbed, vit.Mlp = PatchEmbed, Mlp
    for name, module in (("timm", types.ModuleType("timm")),("timm.models", types.ModuleType("timm.models")),
                         ("timm.models.vision_transformer", vit)):
        sys.modules.setdefault(name, module)
    layers = types.ModuleType("fairscale.nn.model_parallel.layers")
    layers.ColumnParallelLinear = layers.ParallelEmbedding = layers.RowParallelLinear = object
    for name in ("fairscale", "fairscale.nn", "fairscale.nn.model_parallel", "fairscale.nn.model_parallel.initialize"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["fairscale.nn.model_parallel.layers"] = layers
    torchvision = types.ModuleType("torchvision")
    torchvision.transforms = types.ModuleType("torchvision.transforms")
    sys.modules.setdefault("torchvision", torchvision)
    sys.modules.setdefault("torchvision.transforms", torchvision.transforms)


def load_module(repo: Path, relative: str, name: str):
    """Import one of LightningDiT's files by path, with torch.compile made a no-op while it loads."""
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


def perturb(model: nn.Module, seed: int, scale: float = 0.05) -> nn.Module:
    """Add noise to every parameter (zero-initialised gates and biases become live)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def report(what: str, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Print and return the largest relative difference."""
    diff = (ours - theirs).abs().max().item()
    rel = diff / theirs.abs().max().item()
    print(f"{what:<40} max |diff| {diff:.3e}  relative {rel:.3e}  shape {tuple(theirs.shape)}")
    return rel


# ----------------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------------

def check_vavae(repo: Path, args) -> float:
    """LightningDiT's VA-VAE vs our diffusers conversion of its state dict."""
    from diffusers import AutoencoderKL

    from shared.tokenizers.vavae import convert_vavae, vavae_config

    autoencoder = load_module(repo, "tokenizer/autoencoder.py", "lightningdit_autoencoder")
    torch.manual_seed(args.seed)
    theirs = perturb(autoencoder.AutoencoderKL(embed_dim=32, ch_mult=(1, 1, 2, 2, 4)), args.seed)
    ours = AutoencoderKL.from_config(vavae_config([0.0] * 32, [1.0] * 32)).eval()
    ours.load_state_dict(convert_vavae(theirs.state_dict()), strict=True)
    from tests.tiny_tokenizers import to_ldm  # the tests' random VA-VAE checkpoints use these names

    names_equal = set(to_ldm(ours.state_dict())) == set(theirs.state_dict())
    print(f"tests/tiny_tokenizers.py to_ldm names == LightningDiT's VA-VAE state dict names: {names_equal}")
    x = torch.rand(2, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        post_theirs, post_ours = theirs.encode(x), ours.encode(x).latent_dist
        z = post_theirs.mean
        worst = max(report("VA-VAE posterior mean", post_ours.mean, post_theirs.mean),
                    report("VA-VAE posterior std", post_ours.std, post_theirs.std),
                    report("VA-VAE decode", ours.decode(z).sample, theirs.decode(z)))
    return worst


def check_dit(repo: Path, args) -> float:
    """LightningDiT's model vs ours with the lightning block, on LightningDiT's random weights."""
    from sample.lightningdit import lightningdit_state_dict, release_model_config
    from shared.network.models import PRESETS

    lightningdit = load_module(repo, "models/lightningdit.py", "lightningdit_models")
    arch = PRESETS[args.model]
    torch.manual_seed(args.seed)
    theirs = lightningdit.LightningDiT(input_size=args.latent_size, patch_size=arch["patch_size"], in_channels=32,
                                       hidden_size=arch["hidden_size"], depth=arch["depth"],
                                       num_heads=arch["num_heads"], num_classes=1000, learn_sigma=False,
                                       use_qknorm=False, use_swiglu=True, use_rope=True, use_rmsnorm=True,
                                       wo_shift=False)
    perturb(theirs, args.seed + 1)
    state = lightningdit_state_dict({"ema": theirs.state_dict()}, "random LightningDiT")
    ours = release_model_config(state, "random LightningDiT").build().eval()
    ours.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, args.latent_size, args.latent_size, generator=g)
    t, y = torch.rand(3, generator=g), torch.tensor([1, 7, 1000])  # 1000: the null class
    with torch.no_grad():
        return report(f"LightningDiT forward ({args.model} shape)", ours(x, t, y), theirs(x, t, y))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.extra_path:
        sys.path.insert(0, args.extra_path)
    repo = Path(args.repo)
    from diffusers import AutoencoderKL  # noqa: F401 - imported before the stand-ins (it probes for torchvision)

    sys.path.insert(0, str(repo))  # its files import each other as models.*
    install_stand_ins()
    worst = max(check_vavae(repo, args), check_dit(repo, args))
    print(f"largest relative difference: {worst:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
