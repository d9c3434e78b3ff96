"""Pixel ranges: uint8 images on disk and in npz files <-> the [-1, 1] floats the VAE encodes and decodes."""
from __future__ import annotations

import numpy as np
import torch


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
