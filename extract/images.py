"""Image decoding and ADM/DiT preprocessing: every PIL mode to RGB, box-then-bicubic resize, centre crop."""
from __future__ import annotations

import warnings

import numpy as np
import torch
from PIL import Image, ImageOps

from shared.tokenizers.pixels import to_unit_range

# Anything above 100 megapixels (300 MB as decoded RGB, per DataLoader worker) is treated as a
# decompression bomb. PIL warns above MAX_IMAGE_PIXELS and raises above twice that; load_image turns the
# warning into an error too, so the limit is exactly this number.
MAX_IMAGE_PIXELS = 100_000_000
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_HIGH_DEPTH_MODES = ("I", "F")  # plus every "I;16..." variant


class BadImage(Exception):
    """An image file that cannot be used (corrupt, truncated, not an image, too large)."""


def _has_alpha(img: Image.Image) -> bool:
    """True for modes with an alpha band, and for P/L/RGB images carrying a tRNS transparency entry."""
    return img.mode in _ALPHA_MODES or (img.mode in ("P", "L", "RGB") and "transparency" in img.info)


def _composite_on_white(img: Image.Image) -> Image.Image:
    """Flatten transparency onto a white background (transparent pixels must not turn black)."""
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _high_depth_to_rgb(img: Image.Image) -> Image.Image:
    """16-bit, 32-bit integer and float images scaled (not clipped) into 8 bits, then grey -> RGB."""
    arr = np.asarray(img).astype(np.float64)  # (H, W)
    if img.mode.startswith("I;16"):
        arr = arr * (255.0 / 65535.0)
    elif img.mode == "I" and arr.min() >= 0 and arr.max() <= 65535:
        arr = arr * (255.0 / 65535.0)  # 16-bit PNGs often open as mode I
    elif img.mode == "F" and arr.min() >= 0 and arr.max() <= 1:
        arr = arr * 255.0
    else:  # values outside the usual range: stretch the image's own range instead of clipping it
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
    grey = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
    return Image.fromarray(np.stack([grey] * 3, axis=-1))  # (H, W, 3)


def to_rgb(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation, then convert any PIL mode to 8-bit RGB deliberately."""
    img = ImageOps.exif_transpose(img)
    if img.mode == "RGB" and "transparency" not in img.info:
        return img
    if img.mode.startswith("I;16") or img.mode in _HIGH_DEPTH_MODES:
        return _high_depth_to_rgb(img)
    if _has_alpha(img):
        return _composite_on_white(img)
    # L, 1, P, CMYK, YCbCr, LAB, HSV, RGBX: PIL's own conversions are the right ones here.
    return img.convert("RGB")


def center_crop_arr(img: Image.Image, image_size: int) -> np.ndarray:
    """ADM's centre crop (used by DiT): box-halve while the short side >= 2x target, bicubic, crop."""
    while min(img.size) >= 2 * image_size:
        img = img.resize(tuple(side // 2 for side in img.size), resample=Image.BOX)
    scale = image_size / min(img.size)
    img = img.resize(tuple(round(side * scale) for side in img.size), resample=Image.BICUBIC)
    arr = np.asarray(img)  # (H, W, 3) uint8
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return arr[top : top + image_size, left : left + image_size]  # (S, S, 3)


def _open(path) -> tuple[Image.Image, str, tuple[int, int]]:
    """Open and fully decode one file: (RGB image, original mode, original size); bomb warnings are errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as img:
            img.load()  # decode now: truncated or corrupt data fails here, inside the caller's try
            return to_rgb(img), img.mode, img.size


def open_image(path) -> tuple[Image.Image, str, tuple[int, int]]:
    """(RGB image, original mode, original size) of the file; BadImage with a short reason if unusable."""
    try:
        return _open(path)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise BadImage(f"decompression bomb: {err}") from None
    except Exception as err:  # noqa: BLE001 - PIL raises many types (OSError, SyntaxError, ValueError...)
        raise BadImage(f"{type(err).__name__}: {err}") from None


def open_rgb(path) -> Image.Image:
    """The image at path as RGB; BadImage with a short reason when it cannot be used."""
    return open_image(path)[0]


def load_image(path, image_size: int) -> np.ndarray:
    """Preprocessed pixels (3, S, S) uint8 of the image at path; BadImage when it cannot be used."""
    rgb = open_rgb(path)
    return np.ascontiguousarray(center_crop_arr(rgb, image_size).transpose(2, 0, 1))  # (3, S, S)


def to_model_input(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (N,3,S,S) -> float32 in [-1, 1] (ToTensor then Normalize(0.5, 0.5), as DiT does)."""
    return to_unit_range(pixels)


def preprocess(path, image_size: int) -> torch.Tensor:
    """One image as the VAE sees it: (3, S, S) float32 in [-1, 1]."""
    return to_model_input(torch.from_numpy(load_image(path, image_size)))
