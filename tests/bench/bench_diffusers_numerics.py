"""How far diffusers' DiT forward is from the official function on the same weights, and from which difference.

Run: .venv/bin/python tests/bench/bench_diffusers_numerics.py [--model DiT-S/2 --input-size 32 --batch 2]
Random weights of a preset (official init, every trainable tensor perturbed by N(0, 0.05^2) so adaLN-Zero
layers are not zero), mapped exactly into a DiTTransformer2DModel (shared/network/diffusers_dit.py). Prints the
relative L2 difference ||ours - diffusers|| / ||ours|| of the model output at a few timesteps for:
diffusers as the Hub's configs build it (norm_eps 1e-5), as `python -m sample export` writes it
(norm_eps 1e-6), and with the official timestep features switched in too (must print 0 or float noise).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.network.diffusers_dit import diffusers_config, dit_to_diffusers  # noqa: E402
from shared.network.models import DiT_models, ModelConfig  # noqa: E402


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(DiT_models), default="DiT-S/2", help="DiT preset")
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256x256 images)")
    p.add_argument("--batch", type=int, default=2, help="latents per timestep")
    p.add_argument("--timesteps", type=int, nargs="+", default=[0, 250, 500, 999], help="timesteps measured")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    return p.parse_args(argv)


def build(args):
    """(our model, the same weights as a diffusers DiTTransformer2DModel with the Hub's default norm_eps)."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(args.seed)
    config = ModelConfig(args.model, input_size=args.input_size)
    ours = config.build().eval()
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    theirs = DiTTransformer2DModel(**{**diffusers_config(config), "norm_eps": 1e-5}).eval()
    theirs.load_state_dict(dit_to_diffusers(ours.state_dict()), strict=True)
    return ours, theirs


@torch.no_grad()
def relative_differences(ours, theirs, args) -> list[float]:
    """||ours - theirs|| / ||ours|| per timestep, on the same noise and labels."""
    size = args.input_size
    x = torch.randn(args.batch, 4, size, size, generator=torch.Generator().manual_seed(args.seed + 1))
    y = torch.arange(args.batch) * 7 % 1000
    out = []
    for step in args.timesteps:
        t = torch.full((args.batch,), float(step))
        a, b = ours(x, t, y), theirs(x, timestep=t, class_labels=y).sample
        out.append(((a - b).norm() / a.norm()).item())
    return out


def main(argv=None):
    """Print one row per diffusers variant."""
    args = parse_args(argv)
    ours, theirs = build(args)
    print(f"{args.model}, latent 4x{args.input_size}x{args.input_size}, batch {args.batch}, seed {args.seed}; "
          f"relative L2 output difference vs the official function at t = {args.timesteps}")
    rows = [("diffusers as the Hub builds it (norm_eps 1e-5)", None)]
    rows.append(("as `python -m sample export` writes it (norm_eps 1e-6)", "eps"))
    rows.append(("+ official timestep features (downscale_freq_shift 0)", "time"))
    for label, change in rows:
        for block in theirs.transformer_blocks:
            if change == "eps":
                block.norm3.eps = 1e-6
            if change == "time":
                block.norm1.emb.time_proj.downscale_freq_shift = 0
        diffs = relative_differences(ours, theirs, args)
        print(f"  {label:58s} " + "  ".join(f"{d:.3g}" for d in diffs) + f"   mean {sum(diffs) / len(diffs):.3g}")


if __name__ == "__main__":
    main()
