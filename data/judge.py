"""A scikit-learn judge for the digits demo: does a generated image show the digit it was asked for?

It sees images as the dataset holds them: grayscale 8x8 in 0..16, by box-downsampling (undoes the demo's upscaling).
"""
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from shared.datasets.digits import DIGIT_MAX, digit_images

FEATURE_SIZE = 8  # the judge works at load_digits' native resolution


def to_features(images: np.ndarray) -> np.ndarray:
    """Map uint8 images (N, H, W, 3) to judge features (N, 64) in the digits' 0..16 range."""
    images = np.asarray(images)
    assert images.ndim == 4 and images.shape[-1] == 3, f"expected uint8 images (N, H, W, 3), got shape {images.shape}"
    gray = torch.from_numpy(images.astype(np.float32).mean(axis=-1) / 255.0).unsqueeze(1)  # (N, 1, H, W)
    # Area averaging is the inverse of the builder's upscaling (up to bicubic overshoot).
    small = F.adaptive_avg_pool2d(gray, FEATURE_SIZE)  # (N, 1, 8, 8)
    return (small.flatten(1).numpy() * DIGIT_MAX).astype(np.float64)  # (N, 64)


def fit_judge(images: np.ndarray, labels: np.ndarray):
    """Fit the judge (RBF SVC, the classic load_digits setting) on uint8 images and labels."""
    from sklearn.svm import SVC
    return SVC(gamma=0.001, C=10.0).fit(to_features(images), labels)


@lru_cache(maxsize=1)
def default_judge():
    """The judge fitted on all 1,797 real digits as the demo writes them (cached per process)."""
    return fit_judge(*digit_images())


def class_match(images: np.ndarray, labels, judge=None) -> float:
    """Share of images (N, H, W, 3) uint8 that the judge classifies as their requested label."""
    labels = np.asarray(labels).reshape(-1)
    assert len(labels) == len(images), f"{len(images)} images but {len(labels)} labels"
    if len(labels) == 0:
        return float("nan")
    judge = default_judge() if judge is None else judge
    return float(np.mean(judge.predict(to_features(images)) == labels))
