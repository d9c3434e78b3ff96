"""Image decoding and ADM/DiT preprocessing: every PIL mode to RGB, box-then-bicubic resize, centre crop; and the
datasets that decode a scan's images in DataLoader workers.

extract encodes what this produces; `python -m evaluate reference` crops real images the same way.
"""
from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset

from shared.datasets.imagefolder import ImageFolderScan
from shared.runtime.errors import UserError
from shared.tokenizers.tokenizer import to_unit_range

# Above 100 megapixels (300 MB as decoded RGB, per DataLoader worker) an image is a possible decompression bomb
# unless `--max-image-pixels` says otherwise: the one limit (PIL's own check is off while open_image opens a file).
MAX_IMAGE_PIXELS = 100_000_000
BOMB_REASON = "decompression bomb guard"  # the start of the reason recorded for a file above the limit
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS  # other PIL users in the process keep a guard of the same size

_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_HIGH_DEPTH_MODES = ("I", "F")  # plus every "I;16..." variant


class BadImage(Exception):
    """An image file that cannot be used (corrupt, truncated, not an image, too large)."""


def _high_depth_to_rgb(img: Image.Image) -> Image.Image:
    """16-bit, 32-bit integer and float images scaled (not clipped) into 8 bits, then grey -> RGB."""
    arr = np.asarray(img).astype(np.float64)  # (H, W)
    if img.mode.startswith("I;16") or (img.mode == "I" and arr.min() >= 0 and arr.max() <= 65535):
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
    if img.mode in _ALPHA_MODES or (img.mode in ("P", "L", "RGB") and "transparency" in img.info):  # alpha or tRNS
        rgba = img.convert("RGBA")  # flattened onto white: transparent pixels must not turn black
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
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


class TooLarge(BadImage):
    """An image whose header claims more pixels than the limit (a possible decompression bomb)."""


def pixel_limit(text: str) -> int | None:
    """--max-image-pixels: a positive pixel count (underscores and commas allowed) or 'none' (no limit)."""
    if text.strip().lower() == "none":
        return None
    with contextlib.suppress(ValueError):
        value = int(text.replace(",", "").replace("_", ""))
        if value > 0:
            return value
    raise argparse.ArgumentTypeError(f"expected a positive number of pixels or 'none', got {text!r}")


@contextlib.contextmanager
def _own_pixel_limit():
    """PIL's decompression-bomb check off while opening (open_image applies MAX_IMAGE_PIXELS or the flag's)."""
    saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def reduce_factor(size: tuple[int, int], image_size: int) -> int:
    """The largest power of two f with min(size) / f >= 2 * image_size: what ADM's box-halving would reach."""
    factor = 1
    while min(size) >= 4 * factor * image_size:
        factor *= 2
    return factor


def _decode(img: Image.Image, image_size: int | None, large: bool) -> Image.Image:
    """Decode the pixels; an image above the default limit is decoded at reduced size where PIL can."""
    factor = reduce_factor(img.size, image_size) if (large and image_size) else 1
    if factor > 1:
        img.draft(None, (-(-img.size[0] // factor), -(-img.size[1] // factor)))
    img.load()  # decode now: truncated or corrupt data fails here, inside the caller's try
    factor = reduce_factor(img.size, image_size) if (large and image_size) else 1
    return _reduce(img, factor) if factor > 1 else img


# Modes Image.reduce refuses, and the mode each is widened to (strip by strip) before reducing.
_WIDER_MODE = {"1": "L", "I;16": "I", "I;16L": "I", "I;16B": "I", "I;16N": "I"}
_STRIP_ROWS = 256  # rows per strip, times the factor: a few MB of widened pixels at a time


def _reduce(img: Image.Image, factor: int) -> Image.Image:
    """Image.reduce(factor); palette, bilevel and 16-bit images are widened strip by strip, then reduced."""
    with contextlib.suppress(ValueError):
        return img.reduce(factor)
    mode = ("RGBA" if "transparency" in img.info else "RGB") if img.mode == "P" else _WIDER_MODE.get(img.mode, "RGB")
    width, height = img.size
    out = Image.new(mode, (-(-width // factor), -(-height // factor)))
    step = _STRIP_ROWS * factor  # a multiple of the factor: the strips reduce exactly as the whole image would
    for top in range(0, height, step):
        strip = img.crop((0, top, width, min(top + step, height))).convert(mode).reduce(factor)
        out.paste(strip, (0, top // factor))
    out.info = {k: v for k, v in img.info.items() if k != "transparency"}  # EXIF orientation and the like
    return out


def open_image(path, max_pixels: int | None = MAX_IMAGE_PIXELS,
               image_size: int | None = None) -> tuple[Image.Image, str, tuple[int, int]]:
    """(RGB image, original mode, original size) of the file; BadImage with a short reason if unusable."""
    try:
        with _own_pixel_limit():
            img = Image.open(path)  # reads the header only
        with img:
            size, mode = img.size, img.mode
            pixels = size[0] * size[1]
            if max_pixels is not None and pixels > max_pixels:
                raise TooLarge(f"{BOMB_REASON}: {size[0]}x{size[1]} = {pixels:,} pixels, above the limit of "
                               f"{max_pixels:,} (--max-image-pixels)")
            return to_rgb(_decode(img, image_size, pixels > MAX_IMAGE_PIXELS)), mode, size
    except BadImage:
        raise
    except Exception as err:  # noqa: BLE001 - PIL raises many types (OSError, SyntaxError, ValueError...)
        raise BadImage(f"{type(err).__name__}: {err}") from None


def open_rgb(path, max_pixels: int | None = MAX_IMAGE_PIXELS) -> Image.Image:
    """The image at path as RGB; BadImage with a short reason when it cannot be used."""
    return open_image(path, max_pixels)[0]


def load_image(path, image_size: int, max_pixels: int | None = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Preprocessed pixels (3, S, S) uint8 of the image at path; BadImage when it cannot be used."""
    rgb = open_image(path, max_pixels, image_size)[0]
    return np.ascontiguousarray(center_crop_arr(rgb, image_size).transpose(2, 0, 1))  # (3, S, S)


def preprocess(path, image_size: int) -> torch.Tensor:
    """One image as the VAE sees it: (3, S, S) float32 in [-1, 1]."""
    return to_unit_range(load_image(path, image_size))


def fetch(scan: ImageFolderScan, pos: int) -> tuple[object, str]:
    """(what PIL opens, "") or (None, the paragraph) when a source's shard cannot be read: a worker's exception
    would reach the main process wrapped in its traceback, so the paragraph travels as data (raise_fatal)."""
    try:
        return scan.image(pos), ""
    except UserError as err:
        return None, str(err)


def raise_fatal(messages) -> None:
    """The first unreadable shard's paragraph of a batch's "fatal" messages, as the UserError it was in the worker."""
    for message in messages:
        if message:
            raise UserError(message)


class ImageFileDataset(Dataset):
    """Item i = the preprocessed image at sorted position i, or a zero image plus the reason it is bad."""

    def __init__(self, scan: ImageFolderScan, image_size: int, max_pixels: int | None = MAX_IMAGE_PIXELS):
        self.scan, self.labels, self.image_size, self.max_pixels = scan, scan.labels, image_size, max_pixels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, pos: int) -> dict:
        image, fatal = fetch(self.scan, pos)  # a path, or a source's bytes (unreadable: the run ends, a rerun resumes)
        pixels, error = np.zeros((3, self.image_size, self.image_size), np.uint8), ""
        if image is not None:
            try:
                pixels = load_image(image, self.image_size, self.max_pixels)
            except BadImage as err:
                error = str(err)
        # uint8 crosses the worker pipe (4x less than float32); scaling to [-1, 1] happens on the device.
        return {"pos": pos, "pixels": torch.from_numpy(pixels), "label": self.labels[pos], "error": error,
                "fatal": fatal}


class ImageInfoDataset(Dataset):
    """Item i = size and mode of the image at position i after a decode as extraction does it (for --check)."""

    def __init__(self, scan: ImageFolderScan, image_size: int | None = None, max_pixels: int | None = MAX_IMAGE_PIXELS):
        self.scan, self.image_size, self.max_pixels = scan, image_size, max_pixels

    def __len__(self) -> int:
        return len(self.scan.files)

    def __getitem__(self, pos: int) -> dict:
        too_large, (image, fatal) = False, fetch(self.scan, pos)
        try:
            if fatal:
                raise BadImage(fatal)  # ends the check (run_check), not recorded as a bad file
            _, mode, size = open_image(image, self.max_pixels, self.image_size)
            error = ""
        except TooLarge as err:  # the size is known from the header: reported, so the user can pick a limit
            with _own_pixel_limit(), Image.open(self.scan.image(pos)) as img:  # the header only, whatever the limit
                mode, size, error, too_large = "", img.size, str(err), True
        except BadImage as err:
            mode, size, error = "", (0, 0), str(err)
        return {"pos": pos, "width": size[0], "height": size[1], "mode": mode, "error": error,
                "too_large": too_large, "fatal": fatal}


def make_loader(dataset: Dataset, batch_sampler, num_workers: int, pin_memory: bool = False) -> DataLoader:
    """A DataLoader decoding in `num_workers` processes with a few batches prefetched each."""
    extra = {"prefetch_factor": 4, "persistent_workers": False} if num_workers > 0 else {}
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers, pin_memory=pin_memory, **extra)
