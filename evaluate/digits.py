"""The digits yardstick: a Fréchet distance in the feature space of a small CNN fitted to scikit-learn's digits.

Inception features mean nothing on 32x32 digits, so a 3-block CNN is fitted (fixed seed, one thread, ~5 s) to the
1,797 real digits; its 64 pre-ReLU penultimate features play pool_3's role, the full real set is the reference, and
the weights are cached by a hash of recipe and data. `digits_fd(images)`: uint8 (N, 32, 32, 3) -> float.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.datasets.digits import IMAGE_SIZE, NUM_CLASSES, digit_images
from evaluate.metrics import cache_dir, frechet_distance_to, mean_cov
from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write

FEATURES = "digits"


@dataclass(frozen=True)
class DigitsRecipe:
    """Everything that decides the fitted weights; its hash names the cache file."""
    version: int = 1
    widths: tuple = (16, 32, 64)   # conv channels of the three blocks (32 -> 16 -> 8 -> 4 pixels)
    feature_dim: int = 64          # penultimate width: the feature vector
    epochs: int = 12
    batch_size: int = 64
    lr: float = 2e-3
    max_shift: int = 2             # random translation in pixels: features tolerate off-centre strokes
    seed: int = 0
    image_size: int = IMAGE_SIZE


RECIPE = DigitsRecipe()


class DigitsNet(nn.Module):
    """Three conv-ReLU-maxpool blocks, a 64-wide hidden layer (the features) and a 10-way classifier."""
    def __init__(self, recipe: DigitsRecipe = RECIPE):
        super().__init__()
        layers, c_in = [], 3
        for width in recipe.widths:
            layers += [nn.Conv2d(c_in, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c_in = width
        self.body = nn.Sequential(*layers)
        side = recipe.image_size // 2 ** len(recipe.widths)
        self.hidden = nn.Linear(c_in * side * side, recipe.feature_dim)
        self.head = nn.Linear(recipe.feature_dim, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (N, 3, S, S) in [0, 1] -> pre-activation features (N, feature_dim)."""
        return self.hidden(self.body(x).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (N, 3, S, S) in [0, 1] -> class logits (N, 10)."""
        return self.head(F.relu(self.features(x)))


def check_size(height: int, width: int, size: int = IMAGE_SIZE) -> None:
    """UserError unless images of height x width are the size x size the network is fitted to."""
    if (height, width) != (size, size):
        raise UserError(f"the digits features are fitted to {size}x{size} images (the demo's size); these are "
                        f"{height}x{width}. Sample at --image-size {size}, or use the Inception "
                        f"features (--features inception) for other images.")


def to_input(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, H, W) in [0, 1]."""
    return torch.from_numpy(np.array(images, np.uint8)).permute(0, 3, 1, 2).float() / 255.0  # a copy: npz rows are read-only


def shifted(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image (N, C, S, S) by its own integer offset in [-max_shift, max_shift], black filled."""
    n, _, s, _ = x.shape
    padded = F.pad(x, (max_shift,) * 4)  # (N, C, S + 2m, S + 2m); the background is black
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator)
    return torch.stack([padded[i, :, dy:dy + s, dx:dx + s] for i, (dy, dx) in enumerate(offsets.tolist())])


def fit(recipe: DigitsRecipe = RECIPE, images=None, labels=None) -> DigitsNet:
    """Train the network on the real digits, deterministically: fixed seeds, one thread, a seeded shuffle."""
    if images is None:
        images, labels = real_digits(recipe.image_size)
    x, y = to_input(images), torch.from_numpy(np.asarray(labels, dtype=np.int64))
    gen = torch.Generator().manual_seed(recipe.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread: bitwise-repeatable CPU reductions
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():  # the first call may come from a no_grad pass
            torch.manual_seed(recipe.seed)  # initial weights
            net = DigitsNet(recipe)
            opt = torch.optim.Adam(net.parameters(), lr=recipe.lr)
            net.train()
            for _ in range(recipe.epochs):
                order = torch.randperm(len(x), generator=gen)
                for start in range(0, len(x), recipe.batch_size):
                    idx = order[start:start + recipe.batch_size]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(net(shifted(x[idx], recipe.max_shift, gen)), y[idx]).backward()
                    opt.step()
    finally:
        torch.set_num_threads(threads)
    return net.eval()


def recipe_key(recipe: DigitsRecipe, data_hash: str) -> str:
    """Short hash of the recipe and the data: the cache file's name and the network's identity."""
    text = json.dumps({"recipe": asdict(recipe), "data": data_hash}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def weights_path(key: str) -> Path:
    """Where the network fitted by recipe `key` is cached."""
    return cache_dir() / f"digits-{key}.safetensors"


def load_or_fit(recipe: DigitsRecipe = RECIPE) -> tuple[DigitsNet, str]:
    """The fitted network and its key: read from the cache, or fitted and cached (atomic write, safe to race)."""
    from safetensors.torch import load_file, save_file
    images, labels = real_digits(recipe.image_size)
    data = hashlib.sha256(np.ascontiguousarray(images).tobytes())  # a new scikit-learn or upscaling: a new network
    data.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    key = recipe_key(recipe, data.hexdigest())
    path = weights_path(key)
    net = DigitsNet(recipe)
    if path.is_file():
        with contextlib.suppress(Exception):  # a damaged cache file is refitted and replaced, never trusted
            net.load_state_dict(load_file(path))
            return net.eval(), key
    net = fit(recipe, images, labels)
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    with contextlib.suppress(OSError):  # an unwritable cache only costs the refit next time
        atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata={"recipe": json.dumps(asdict(recipe))}))
    return net, key


_LOCK = threading.RLock()  # reentrant: network() reads real_digits() inside, real_features() both
_CACHE: dict = {}


def _once(key, make):
    """_CACHE[key], made by make() on first use: once per process, thread-safe."""
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


def real_digits(size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Every real digit (1797, size, size, 3) uint8 and its label, read once per process: the fit's data, the reference."""
    return _once(("digits", size), lambda: digit_images(size))


def network() -> tuple[DigitsNet, str]:
    """The process-wide fitted network and its key (fitted or loaded once; thread-safe)."""
    return _once("net", lambda: load_or_fit(RECIPE))


def digits_features(images, batch_size: int = 512) -> np.ndarray:
    """uint8 images (N, 32, 32, 3) -> penultimate features (N, 64) float64; UserError for other images."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise UserError(f"the digits features take uint8 RGB images (N, H, W, 3) as `python -m sample --npz` "
                        f"writes them; got {images.dtype} {images.shape}.")
    check_size(*images.shape[1:3])
    net, _ = network()
    out = [net_features(net, images[i:i + batch_size]) for i in range(0, len(images), batch_size)]
    return np.concatenate(out) if out else np.zeros((0, RECIPE.feature_dim))


@torch.no_grad()
def net_features(net: DigitsNet, images: np.ndarray, device="cpu") -> np.ndarray:
    """uint8 images (b, 32, 32, 3) through `net` on `device` -> penultimate features (b, 64) float64 on the CPU."""
    return net.features(to_input(images).to(device)).double().cpu().numpy()


def real_features() -> np.ndarray:
    """Features (1797, 64) of all real digits, the reference (computed once per process)."""
    return _once("real", lambda: digits_features(real_digits(RECIPE.image_size)[0]))


def real_stats() -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of the real digits' features."""
    return mean_cov(real_features())


def digits_fd(images) -> float:
    """Fréchet distance between uint8 images (N, 32, 32, 3), N >= 2, and the real digits, in digits features."""
    return frechet_distance_to(digits_features(images), *real_stats())


def real_floor(count: int, draws: int = 5, seed: int = 0) -> float:
    """Mean digits FD of `draws` random sets of `count` real digits: what a perfect model scores at that count."""
    images = real_digits(RECIPE.image_size)[0]
    count = min(int(count), len(images))
    rng = np.random.default_rng(seed)
    return float(np.mean([digits_fd(images[rng.permutation(len(images))[:count]]) for _ in range(draws)]))


class DigitsFeatures:
    """The yardstick behind the feature-network interface (evaluate/evaluation.py build_features)."""
    name = FEATURES
    outputs = ("pool",)

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def identity(self) -> dict:
        """Name, recipe hash and sizes: recorded with every result and statistics file."""
        return {"name": FEATURES, "recipe": network()[1], "feature_dim": RECIPE.feature_dim,
                "image_size": RECIPE.image_size}

    def __call__(self, images: np.ndarray) -> dict:
        """uint8 (b, 32, 32, 3) -> {"pool": (b, 64) float64}; the network is fitted or loaded on first use."""
        return {"pool": net_features(network()[0].to(self.device), images, self.device)}

    def real_features(self) -> np.ndarray:
        """The features (1797, 64) of every real digit, the yardstick's reference (computed once per process)."""
        return real_features()
