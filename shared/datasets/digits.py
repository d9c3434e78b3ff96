"""The digits dataset, scikit-learn's 8x8 handwritten digits as 32x32 RGB: the demo's data and the digits FD reference.

Shipped inside scikit-learn (1,797 images, no download); written as OUT/<digit>/<i>.png, so class index = digit.
"""
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

from shared.runtime.fsio import atomic_write

DIGIT_MAX = 16.0  # load_digits pixel values lie in 0..16
IMAGE_SIZE = 32
NUM_CLASSES = 10


def load_digit_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Return the raw digits (N, 8, 8) float in 0..16 and their labels (N,) int64."""
    from sklearn.datasets import load_digits
    bunch = load_digits()
    return bunch.images.astype(np.float32), bunch.target.astype(np.int64)


def digit_images(size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Every digit smoothly upscaled to white-on-black RGB uint8 (N, size, size, 3) and its label (N,), in order."""
    digits, labels = load_digit_arrays()
    x = torch.from_numpy(digits / DIGIT_MAX).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
    # Bicubic keeps strokes smooth; it overshoots slightly, so clamp before quantising.
    x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False).clamp(0, 1)  # (N, 1, S, S)
    gray = (x.squeeze(1).numpy() * 255.0).round().astype(np.uint8)  # (N, S, S)
    return np.repeat(gray[..., None], 3, axis=-1), labels  # (N, S, S, 3)


def build_digits(out_dir, size: int = IMAGE_SIZE, progress: bool = True) -> Path:
    """Write the ImageFolder OUT/<digit>/<i>.png (skipping files already present) and return OUT."""
    out_dir = Path(out_dir)
    images, labels = digit_images(size)
    for label in range(NUM_CLASSES):
        (out_dir / str(label)).mkdir(parents=True, exist_ok=True)
    for i in tqdm(range(len(labels)), desc="digits", unit="img", disable=not progress):
        path = out_dir / str(int(labels[i])) / f"{i:04d}.png"  # i: the image's position in load_digits
        if not path.exists():  # atomic: an interrupted build never leaves a half-written PNG
            atomic_write(path, lambda tmp: Image.fromarray(images[i]).save(tmp, format="PNG"), durable=False)
    return out_dir
