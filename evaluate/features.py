"""Feature networks behind one interface: uint8 image batches in, named feature arrays out.

`pool` (N, D) feeds FID and precision/recall; the Inception network adds `spatial` (N, 2023) for sFID and
`logits` (N, 1008) for IS.
"""
from __future__ import annotations

import numpy as np
import torch

from shared.runtime.errors import ChoiceError

FEATURE_NETWORKS = ("inception", "digits")


class DigitsFeatures:
    """The digits yardstick network (evaluate/digits.py): 64 features of 32x32 digit images."""
    name = "digits"
    outputs = ("pool",)

    def __init__(self, device="cpu"):
        from evaluate import digits
        self._digits = digits
        self.net, _ = digits.network()
        self.device = torch.device(device)
        self.net.to(self.device)

    def identity(self) -> dict:
        """Name, recipe hash and sizes: recorded with every result and statistics file."""
        return self._digits.identity()

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> dict:
        """uint8 (b, 32, 32, 3) -> {"pool": (b, 64) float64}."""
        return {"pool": self._digits.net_features(self.net, images, self.device)}

    def real_features(self) -> np.ndarray:
        """The features (1797, 64) of every real digit, the yardstick's reference (computed once per process)."""
        return self._digits.real_features()


def check_image_size(name: str, size) -> None:
    """UserError if network `name` cannot take images of `size` (H, W); loads no network."""
    if name == "digits":
        from evaluate.digits import check_images
        check_images(np.zeros((1, *size, 3), np.uint8))


def build_features(name: str, device="cpu", weights=None):
    """The feature network `name` on `device` (`weights`: the Inception weights file, if given)."""
    if name == "digits":
        return DigitsFeatures(device)
    if name == "inception":
        from evaluate.inception import InceptionFeatures
        return InceptionFeatures(device, weights)
    raise ChoiceError("feature network", name, FEATURE_NETWORKS)
