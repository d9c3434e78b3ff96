"""DataLoader plumbing: images decoded in worker processes, batches that never straddle a shard."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from shared.datasets.imagefolder import ImageFolderScan
from shared.datasets.images import MAX_IMAGE_PIXELS, BadImage, TooLarge, image_header_size, load_image, open_image
from shared.runtime.errors import UserError


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
        self.scan, self.labels = scan, scan.labels
        self.image_size, self.max_pixels = image_size, max_pixels

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
        self.scan = scan
        self.image_size, self.max_pixels = image_size, max_pixels

    def __len__(self) -> int:
        return len(self.scan.files)

    def __getitem__(self, pos: int) -> dict:
        too_large, (image, fatal) = False, fetch(self.scan, pos)
        try:
            if fatal:
                raise BadImage(fatal)  # ends the check (inspect_all), not recorded as a bad file
            _, mode, size = open_image(image, self.max_pixels, self.image_size)
            error = ""
        except TooLarge as err:  # the size is known from the header: reported, so the user can pick a limit
            mode, size, error, too_large = "", image_header_size(self.scan.image(pos)), str(err), True
        except BadImage as err:
            mode, size, error = "", (0, 0), str(err)
        return {"pos": pos, "width": size[0], "height": size[1], "mode": mode, "error": error,
                "too_large": too_large, "fatal": fatal}


class ShardBatches(Sampler):
    """Batches of positions, shard by shard; a batch never crosses a shard boundary.

    Batch composition then depends only on the shard, so a resumed run encodes exactly the batches an
    uninterrupted run would (bitwise-equal shards even where kernels differ by batch size).
    """

    def __init__(self, shards: list[int], shard_size: int, num_files: int, batch_size: int):
        self.shards, self.shard_size = list(shards), shard_size
        self.num_files, self.batch_size = num_files, batch_size

    def shard_positions(self, shard: int) -> range:
        """Sorted positions held by one shard."""
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, self.num_files))

    def __iter__(self):
        for shard in self.shards:
            positions = list(self.shard_positions(shard))
            for start in range(0, len(positions), self.batch_size):
                yield positions[start : start + self.batch_size]

    def __len__(self) -> int:
        return sum(-(-len(self.shard_positions(s)) // self.batch_size) for s in self.shards)


def make_loader(dataset: Dataset, batch_sampler, num_workers: int, pin_memory: bool = False) -> DataLoader:
    """A DataLoader decoding in `num_workers` processes with a few batches prefetched each."""
    extra = {"prefetch_factor": 4, "persistent_workers": False} if num_workers > 0 else {}
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                      pin_memory=pin_memory, **extra)
