"""Our VA-VAE conversion and our `lightning` DiT at patch 1 against LightningDiT's own code (hustvl/LightningDiT, MIT).

Run: .venv/bin/python tests/bench/check_lightningdit_parity.py --repo PATH_TO_A_LIGHTNINGDIT_CHECKOUT
(LightningDiT's code is not part of this project and is never copied into it. Its modules import timm, fairscale
and einops, which this project does not use: the first two are replaced here by stand-ins written for this check
(timm's PatchEmbed is a strided convolution then flatten; its Mlp is fc1, GELU, fc2; fairscale is only imported:
tests/bench/reference_code.py),
einops must be importable (`pip install --target DIR einops` and --extra-path DIR). Its `@torch.compile`
decorators are switched off while its files load.)

1. VA-VAE: LightningDiT's tokenizer/autoencoder.py AutoencoderKL(embed_dim=32, ch_mult=(1, 1, 2, 2, 4)) with
   random weights (every tensor perturbed, so GroupNorm gains and biases are live) -> its state dict converted by
   shared/tokenizers/vavae.py into diffusers' AutoencoderKL (strict load) -> posterior mean, std and decode of the
   same input compared.
2. LightningDiT: models/lightningdit.py LightningDiT at patch 1 with the released configuration (SwiGLU, RoPE,
   RMSNorm, no QK-norm, learn_sigma False, 32 channels) and random weights -> its state dict loaded strictly by
   shared/weights/checkpoint.py's LightningDiT record: its weights in our DiT with the `lightning` block -> forward(x, t, y) compared.
Prints the largest absolute and relative differences.
"""
import argparse
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench.reference_code import load_file, perturb_, report, stand_in_modules, stand_in_timm  # noqa: E402


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


def install_stand_ins():
    """timm (PatchEmbed, Mlp), fairscale's model-parallel layers (only imported) and torchvision in sys.modules."""
    stand_in_timm()
    stand_in_modules("fairscale", "fairscale.nn", "fairscale.nn.model_parallel",
                     "fairscale.nn.model_parallel.initialize", "torchvision", "torchvision.transforms")
    layers = types.ModuleType("fairscale.nn.model_parallel.layers")
    layers.ColumnParallelLinear = layers.ParallelEmbedding = layers.RowParallelLinear = object
    sys.modules["fairscale.nn.model_parallel.layers"] = layers
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]


# ----------------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------------

def check_vavae(repo: Path, args) -> float:
    """LightningDiT's VA-VAE vs our diffusers conversion of its state dict."""
    from diffusers import AutoencoderKL

    from shared.tokenizers.vavae import convert_vavae, vavae_config

    autoencoder = load_file(repo, "tokenizer/autoencoder.py", "lightningdit_autoencoder")
    torch.manual_seed(args.seed)
    theirs = perturb_(autoencoder.AutoencoderKL(embed_dim=32, ch_mult=(1, 1, 2, 2, 4)),
                      generator=torch.Generator().manual_seed(args.seed))
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
    import tempfile

    from shared.network.models import PRESETS
    from shared.weights.checkpoint import build_sampling_model, load_sampling_weights

    lightningdit = load_file(repo, "models/lightningdit.py", "lightningdit_models")
    arch = PRESETS[args.model]
    torch.manual_seed(args.seed)
    theirs = lightningdit.LightningDiT(input_size=args.latent_size, patch_size=arch["patch_size"], in_channels=32,
                                       hidden_size=arch["hidden_size"], depth=arch["depth"],
                                       num_heads=arch["num_heads"], num_classes=1000, learn_sigma=False,
                                       use_qknorm=False, use_swiglu=True, use_rope=True, use_rmsnorm=True,
                                       wo_shift=False)
    perturb_(theirs, generator=torch.Generator().manual_seed(args.seed + 1))
    with tempfile.TemporaryDirectory() as tmp:  # read as the release is: its file name picks its record
        path = Path(tmp) / "lightningdit-xl-imagenet256-800ep.pt"
        torch.save({"ema": theirs.state_dict()}, path)
        ours = build_sampling_model(load_sampling_weights(path), "cpu")
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
