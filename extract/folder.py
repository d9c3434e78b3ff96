"""ImageFolder scanning with torchvision's ordering: class index = position of the folder name in sorted order."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import UserError

# The extensions torchvision's ImageFolder accepts, matched case-insensitively as it does.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class ImageFolderScan:
    """The sorted file list of an ImageFolder tree: relative paths, labels and class names."""

    root: Path
    classes: list[str]
    files: list[str]    # paths relative to root, POSIX separators, in sample order
    labels: list[int]   # class index of each file

    def __len__(self) -> int:
        return len(self.files)

    def counts(self) -> list[int]:
        """Number of files per class, by class index."""
        return np.bincount(np.asarray(self.labels, dtype=np.int64), minlength=len(self.classes)).tolist()

    def fingerprint(self) -> str:
        """sha256 of the class names and (path, label) list: the dataset's identity for resume checks."""
        digest = hashlib.sha256()
        for name in self.classes:
            digest.update(f"class\t{name}\n".encode("utf-8", "surrogateescape"))
        for path, label in zip(self.files, self.labels):
            digest.update(f"{label}\t{path}\n".encode("utf-8", "surrogateescape"))
        return digest.hexdigest()

    def limited(self, limit: int | None) -> "ImageFolderScan":
        """Keep `limit` files spread evenly over the sorted list, so every class shows up when limit >= classes."""
        if limit is None or limit >= len(self.files):
            return self
        keep = np.unique(np.linspace(0, len(self.files) - 1, num=limit).round().astype(np.int64))
        return ImageFolderScan(self.root, self.classes, [self.files[i] for i in keep],
                               [self.labels[i] for i in keep])


def is_image_file(name: str) -> bool:
    """True for names ending in one of IMAGE_EXTENSIONS, case-insensitively."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def find_classes(root: Path) -> list[str]:
    """Sorted names of the sub-folders of root (torchvision's find_classes)."""
    with os.scandir(root) as entries:
        return sorted(entry.name for entry in entries if entry.is_dir())


def _class_files(root: Path, name: str) -> list[str]:
    """Image files under root/name, nested folders included, in torchvision's walk order."""
    found = []
    # torchvision sorts the (dirpath, dirnames, filenames) tuples of os.walk, then the names in each.
    for dirpath, _, filenames in sorted(os.walk(root / name, followlinks=True)):
        for filename in sorted(filenames):
            if is_image_file(filename):
                found.append(Path(dirpath, filename).relative_to(root).as_posix())
    return found


def scan_image_folder(root) -> ImageFolderScan:
    """Scan root/<class>/**/<image>; UserError for a missing root, no class folders or empty classes."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(
            f"--data-path {root} does not exist or is not a folder. Pass an ImageFolder root: one sub-folder "
            f"per class holding that class's images (root/cat/001.jpg, root/dog/002.png, ...)."
        )
    classes = find_classes(root)
    if not classes:
        raise UserError(
            f"--data-path {root} has no class folders. Put each class's images in its own sub-folder "
            f"(root/cat/001.jpg, ...); for an unlabelled dataset use a single sub-folder, e.g. root/all/."
        )
    files, labels, empty = [], [], []
    for index, name in enumerate(classes):
        found = _class_files(root, name)
        if not found:
            empty.append(name)
        files.extend(found)
        labels.extend([index] * len(found))
    if empty:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise UserError(
            f"{len(empty)} class folder(s) in {root} hold no images ({shown}). Add images with one of the "
            f"extensions {' '.join(IMAGE_EXTENSIONS)} or remove those folders (every sub-folder is a class)."
        )
    return ImageFolderScan(root.resolve(), classes, files, labels)
