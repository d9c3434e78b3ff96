"""`python -m evaluate reference IMAGES --image-size S --out REF.npz`: the user's own real images as a reference.

Every image below IMAGES, found as extract finds a training set, centre-cropped to S x S as extraction does (ADM's
crop), written as an images npz usable as --ref; unreadable files are skipped and listed.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from evaluate.images import save_npz, scan_images
from shared.datasets.duplicates import DEFAULT_DUPLICATES, DUPLICATE_POLICIES
from shared.datasets.imagefolder import ImageFolderScan
from shared.datasets.images import MAX_IMAGE_PIXELS, BadImage, load_image, pixel_limit
from shared.runtime.cli import HelpFormatter, add_flags, from_args, option
from shared.runtime.errors import UserError, cli_errors

PROG = "python -m evaluate reference"


@dataclass
class ReferenceOptions:
    """Everything `python -m evaluate reference` accepts (one field per flag: its default and help)."""
    images: str = option(help="folder of real images: an ImageFolder or a flat folder (every image below it)",
                         positional=True, metavar="IMAGES")
    image_size: int = option(help="side of the square centre crop, as extract's --image-size: the size of the "
                                  "samples the reference is compared with", min=1, hint="a positive number of pixels")
    out: str = option(help="the reference to write: an npz of arr_0 uint8 N x S x S x 3, usable as --ref",
                      metavar="REF.npz")
    limit: int | None = option(None, "use only N images, spread evenly over the sorted list (default: all)", min=2,
                               hint="FID needs a covariance")
    duplicates: str = option(DEFAULT_DUPLICATES, "files that are one picture (symlinks, hard links, identical "
                                                 "bytes), as extract's --duplicates: first keeps each picture once; "
                                                 "all keeps every copy; none drops pictures whose copies lie in "
                                                 "different top-level folders", choices=tuple(DUPLICATE_POLICIES))
    max_image_pixels: int | None = option(MAX_IMAGE_PIXELS, f"images with more pixels are skipped as possible "
                                                            f"decompression bombs; 'none' admits any size "
                                                            f"(default: {MAX_IMAGE_PIXELS:,})",
                                          type=pixel_limit, metavar="N|none")


def write_reference(o: ReferenceOptions) -> tuple[int, list[str], ImageFolderScan]:
    """Crop every image into o.out (atomic); returns (images written, bad files, the scan)."""
    folder = Path(o.images)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; pass the folder of real images to crop into a reference.")
    if not str(o.out).endswith(".npz"):
        raise UserError(f"--out {o.out} must end in .npz (the reference is an images npz).")
    if Path(o.out).resolve().is_relative_to(folder.resolve()):
        raise UserError(f"--out {o.out} is inside {folder}: a later run would read it as one of the images. "
                        f"Write the reference beside the folder, e.g. --out {folder.resolve().parent / 'reference.npz'}.")
    scan = scan_images(folder, o.duplicates, o.limit)  # as extract: the limit first, then the copies
    if len(scan) < 2:
        raise UserError(f"{folder} holds {len(scan)} image(s); a reference needs at least 2.")
    files = [folder / name for name in scan.files]
    out = Path(o.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(f".tmp-{out.stem}-rows.npy")  # on disk: a big folder never sits in memory
    rows = np.lib.format.open_memmap(scratch, mode="w+", dtype=np.uint8,
                                     shape=(len(files), o.image_size, o.image_size, 3))
    n, bad = 0, []  # rows[:n]: the readable images, cropped, in order; bad: 'path: reason'
    try:
        for path in tqdm(files, unit="img", desc="reference", dynamic_ncols=True):
            try:
                rows[n] = load_image(path, o.image_size, o.max_image_pixels).transpose(1, 2, 0)  # (S, S, 3)
                n += 1
            except BadImage as err:
                bad.append(f"{path}: {err}")
        if n < 2:
            raise UserError(f"only {n} of the {len(files)} images in {o.images} could be read ({'; '.join(bad[:3])}).")
        save_npz(out, arr_0=rows[:n])  # uncompressed: the reader seeks into it
    finally:
        del rows
        scratch.unlink(missing_ok=True)
    return n, bad, scan


def reference_parser() -> argparse.ArgumentParser:
    """Parser of `python -m evaluate reference`."""
    return add_flags(argparse.ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Write a reference npz from a folder of real images at the samples' size (ADM's centre crop, "
                    "as extract), for --ref of `python -m evaluate` and `python -m evaluate run`."), ReferenceOptions)


def main_reference(argv) -> None:
    """Entry point of `python -m evaluate reference`: UserErrors become one paragraph (exit status 2)."""
    with cli_errors(PROG):
        o = from_args(ReferenceOptions, reference_parser().parse_args(argv))
        n, bad, scan = write_reference(o)
        for line in (f"{o.images}: {scan.skipped.describe()}", *scan.notes):
            print(f"reference: {line}")
        print(f"{o.out}: {n} images, {o.image_size}x{o.image_size} (ADM centre crop); {len(bad)} unreadable "
              f"file(s) skipped{': ' + '; '.join(bad[:5]) if bad else ''}. Pass it as --ref.")
