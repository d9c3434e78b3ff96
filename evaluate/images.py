"""The images to evaluate, an npz's `arr_0` (uint8 N x H x W x 3) or an ImageFolder, streamed through a feature network.

An npz's uncompressed `arr_0` is read from the zip a batch at a time, so 50,000 images never sit in memory at once.
"""
from __future__ import annotations

import collections
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from shared.datasets.duplicates import DEFAULT_DUPLICATES, apply_duplicates
from shared.datasets.imagefolder import IMAGE_EXTENSIONS, ImageFolderScan, scan_image_folder
from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write

IMAGES_KEY = "arr_0"


def npz_keys(path: Path) -> list[str]:
    """Array names stored in an npz (without reading them); UserError if it is not an npz."""
    try:
        with zipfile.ZipFile(path) as archive:
            return [n[:-4] for n in archive.namelist() if n.endswith(".npy")]
    except (zipfile.BadZipFile, OSError) as err:
        raise UserError(f"{path} is not a readable .npz file ({err}); pass an npz written by `python -m sample "
                        f"--npz` (or np.savez) with the images as arr_0.") from err


def save_npz(path, **arrays) -> Path:
    """Write arrays as an uncompressed npz, atomically (an open handle, so numpy adds no .npz suffix)."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    return atomic_write(Path(path), write)


def _npy_header(member) -> tuple[tuple, bool, np.dtype]:
    """Shape, Fortran flag and dtype of an open .npy stream, leaving it at the first data byte."""
    fmt = np.lib.format
    return (fmt.read_array_header_1_0 if fmt.read_magic(member) == (1, 0) else fmt.read_array_header_2_0)(member)


class ImageSource:
    """Images as uint8 (N, H, W, 3) behind one interface: count, size (H, W), batches of images start..stop."""
    @property
    def count(self) -> int:
        """Number of images."""
        return self.shape[0]

    @property
    def size(self) -> tuple[int, int]:
        """(H, W) of every image."""
        return tuple(self.shape[1:3])

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
        """Yield uint8 (b, H, W, 3) batches of images start..stop."""
        stop = self.count if stop is None else min(stop, self.count)
        yield from self._read(start, stop, batch_size)


@dataclass
class NpzImages(ImageSource):
    """The uint8 (N, H, W, 3) `arr_0` of an npz, read in batches (only the bytes of those images)."""
    path: Path
    shape: tuple

    def _read(self, start: int, stop: int, batch_size: int) -> Iterator[np.ndarray]:
        row = int(np.prod(self.shape[1:]))
        with zipfile.ZipFile(self.path) as archive, archive.open(f"{IMAGES_KEY}.npy") as member:
            _npy_header(member)
            member.seek(member.tell() + start * row)  # stored members seek directly; deflated ones read forward
            for lo in range(start, stop, batch_size):
                n = min(batch_size, stop - lo)
                data = member.read(n * row)
                if len(data) != n * row:
                    raise UserError(f"{self.path} is truncated: {IMAGES_KEY} ends before image {lo + len(data) // row}"
                                    f" of {self.count}; write it again.")
                yield np.frombuffer(data, np.uint8).reshape(n, *self.shape[1:])


def open_npz_images(path) -> NpzImages:
    """The images of an npz, checked from its header: arr_0 must be uint8 (N, H, W, 3), C order, N >= 1."""
    path = Path(path)
    keys = npz_keys(path)
    if IMAGES_KEY not in keys:
        raise UserError(f"{path} holds no `{IMAGES_KEY}` array (it has: {', '.join(keys) or 'nothing'}). Pass an "
                        f"npz whose images are `{IMAGES_KEY}`, uint8 N x H x W x 3, as `python -m sample --npz` and "
                        f"the ADM reference batches store them.")
    with zipfile.ZipFile(path) as archive, archive.open(f"{IMAGES_KEY}.npy") as member:
        shape, fortran, dtype = _npy_header(member)
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or fortran or shape[0] < 1:
        raise UserError(f"{path}: `{IMAGES_KEY}` is {dtype} with shape {tuple(shape)}{' (Fortran order)' if fortran else ''}"
                        f"; the evaluator reads uint8 RGB images N x H x W x 3 (values 0..255, C order) with N >= 1. "
                        f"Convert them, e.g. np.savez(out, arr_0=np.clip(x, 0, 255).astype(np.uint8)) for an "
                        f"N x H x W x 3 array x.")
    return NpzImages(path, tuple(int(s) for s in shape))


@dataclass
class FolderImages(ImageSource):
    """Every image under a folder (ImageFolder or flat), sorted by path, all of one size, read as RGB."""
    path: Path
    files: list
    shape: tuple  # (N, H, W, 3), as an npz's arr_0

    def _read(self, start: int, stop: int, batch_size: int) -> Iterator[np.ndarray]:
        for lo in range(start, stop, batch_size):
            yield np.stack([self._image(p) for p in self.files[lo:min(lo + batch_size, stop)]])

    def _image(self, path: Path) -> np.ndarray:
        """One image as uint8 (H, W, 3); UserError if unreadable or of another size."""
        from PIL import Image
        try:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
        except OSError as err:
            raise UserError(f"{path} is not a readable image ({err}); remove it from {self.path}.") from err
        if pixels.shape[:2] != self.size:
            raise UserError(f"{path} is {pixels.shape[1]}x{pixels.shape[0]} but the first image of {self.path} is "
                            f"{self.size[1]}x{self.size[0]}; the evaluator compares images of one size. Resize or "
                            f"crop the folder's images to one size first (ADM: centre crop to the sample size).")
        return pixels


def scan_images(folder: Path, duplicates: str = DEFAULT_DUPLICATES, limit: int | None = None) -> ImageFolderScan:
    """Every image below folder as extract finds a training set, loose ones included, `limit` of them, copies ruled."""
    return apply_duplicates(scan_image_folder(folder, loose=True).limited(limit), duplicates)


def image_files(folder: Path, duplicates: str = DEFAULT_DUPLICATES) -> list[Path]:
    """The image files of scan_images below `folder`, in its order (the loose images first)."""
    return [Path(folder) / name for name in scan_images(folder, duplicates).files]


def open_folder_images(path) -> FolderImages:
    """Every image under a folder, found as extract finds them; UserError if it holds none or several sizes."""
    from PIL import Image
    path = Path(path)
    # Every copy kept: identical samples are what a collapsed model draws, and FID must see all of them.
    files = image_files(path, "all")
    if not files:
        raise UserError(f"{path} holds no images ({' '.join(IMAGE_EXTENSIONS)}); pass an image folder or an npz.")
    sizes = collections.Counter()  # (H, W) of every image, from the headers
    for file in files:
        try:
            with Image.open(file) as image:
                sizes[(image.height, image.width)] += 1
        except (OSError, Image.DecompressionBombError) as err:
            raise UserError(f"{file} is not a readable image ({err}); remove it from {path}.") from err
    if len(sizes) == 1:
        return FolderImages(path, files, (len(files), *next(iter(sizes)), 3))
    common = ", ".join(f"{w}x{h}: {n}" for (h, w), n in sizes.most_common(3))
    raise UserError(f"{path} holds {len(files)} images of {len(sizes)} different sizes ({common}"
                    f"{', ...' if len(sizes) > 3 else ''}); the evaluator compares images of one size. Write a "
                    f"reference at the samples' size from it: `python -m evaluate reference {path} --image-size S "
                    f"--out {path.resolve().parent / 'reference.npz'}` (ADM's centre crop, as extract), and pass that "
                    f"npz as --ref.")


def open_images(path):
    """An npz's arr_0 or a folder's images; UserError naming what is wrong with the path."""
    path = Path(path)
    if path.is_dir():
        return open_folder_images(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass an .npz of images (arr_0 uint8 N x H x W x 3) or an image folder.")
    return open_npz_images(path)


def compute_features(source, net, batch_size: int, rank: int = 0, world: int = 1, desc: str = "features") -> dict:
    """Features of every image of `source`: this process does its slice, then all are gathered in rank order."""
    lo, hi = source.count * rank // world, source.count * (rank + 1) // world  # sizes differ by at most 1
    chunks: dict = {k: [] for k in net.outputs}
    with tqdm(total=hi - lo, desc=desc, unit="img", disable=rank != 0 or hi - lo == 0) as bar:
        for batch in source.batches(batch_size, lo, hi):
            for k, v in net(batch).items():
                chunks[k].append(v.astype(np.float32))  # float32 on the wire and in memory, as ADM's activations
            bar.update(len(batch))
    feats = {k: (np.concatenate(v) if v else np.zeros((0, 0), np.float32)) for k, v in chunks.items()}
    if world == 1:
        return feats
    import torch.distributed as dist
    parts = [None] * world
    dist.all_gather_object(parts, feats)  # gloo and NCCL alike; a few hundred MB at 50K x 2048 float32
    return {k: np.concatenate([p[k] for p in parts]) for k in feats}
