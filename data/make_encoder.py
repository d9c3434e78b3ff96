"""A tiny DINOv2-architecture encoder for REPA on the digits demo: `python -m data.make_encoder --out DIR`.

A transformers Dinov2Model (4 layers, width 64, patch 8: the demo's 4x4 token grid) trained to classify the digits
from its mean patch token, saved with save_pretrained so extract loads it as a released DINOv2. Not the digits FD
network (another architecture, seed and recipe), though both learn from the labels.
"""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shared.datasets.digits import IMAGE_SIZE, NUM_CLASSES, digit_images
from shared.tokenizers.repr_encoder import IMAGENET_MEAN, IMAGENET_STD

DEFAULT_OUT = Path("demo-out/encoder-digits")
SEED = 1234  # not the digits FD network's seed


def build(seed: int = SEED):
    """A random Dinov2Model sized for 32x32 digits, and a linear class head on its mean patch token."""
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(seed)
    config = Dinov2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, mlp_ratio=2, patch_size=8,
                          image_size=IMAGE_SIZE)
    return Dinov2Model(config), torch.nn.Linear(64, NUM_CLASSES)


def to_unit(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (N, S, S, 3) -> float (N, 3, S, S) in [0, 1] (the AutoencoderRAE's image range)."""
    return pixels.permute(0, 3, 1, 2).float() / 255.0


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (N, S, S, 3) -> (N, 3, S, S) normalised as the extract stage feeds the encoder."""
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (to_unit(pixels) - mean) / std


def patch_tokens(encoder, x: torch.Tensor) -> torch.Tensor:
    """Patch tokens (B, N, C) of a DINOv2, with or without registers: the CLS and register tokens dropped."""
    skip = 1 + getattr(encoder.config, "num_register_tokens", 0)  # Dinov2WithRegisters: 1 CLS + 4 registers
    return encoder(pixel_values=x).last_hidden_state[:, skip:]


def fit(encoder, head, x_all: torch.Tensor, y_all: torch.Tensor, steps: int = 150, batch: int = 64,
        seed: int = SEED) -> float:
    """Fit encoder + head to classify x_all (N, 3, S, S), normalised, from its mean patch token; training accuracy."""
    params = list(encoder.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x_all), (batch,), generator=g)
        dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
        x = torch.roll(x_all[idx], shifts=(dy, dx), dims=(2, 3))  # a small random shift
        opt.zero_grad()
        F.cross_entropy(head(patch_tokens(encoder, x).mean(1)), y_all[idx]).backward()  # tokens (B, 16, 64)
        opt.step()
    encoder.eval()
    return accuracy(encoder, head, x_all, y_all)


@torch.no_grad()
def accuracy(encoder, head, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of x (N, 3, S, S), normalised, whose mean patch token the head reads as its label y."""
    return float((head(patch_tokens(encoder, x).mean(1)).argmax(1) == y).float().mean())


@interruptible("python -m data.make_encoder")
def main(argv=None) -> None:
    """Train and save the encoder."""
    p = argparse.ArgumentParser(prog="python -m data.make_encoder", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder to save it in (default: {DEFAULT_OUT})")
    p.add_argument("--steps", type=int, default=150, help="training steps of batch 64 (default: 150)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: one thread wastes nothing on a shared machine
    np.random.seed(SEED)
    images, labels = digit_images()  # the encoder + head fitted on all digits
    encoder, head = build(SEED)
    accuracy = fit(encoder, head, normalise(torch.from_numpy(images)), torch.from_numpy(labels), args.steps, 64, SEED)
    encoder.save_pretrained(args.out)
    print(f"encoder saved to {args.out} (training accuracy {accuracy:.1%})")


if __name__ == "__main__":
    main()
