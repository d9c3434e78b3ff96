"""ImageFolder scanning with torchvision's ordering: class index = position of the folder name in sorted order.

Unlike torchvision, names starting with a dot are never data (`.ipynb_checkpoints/`, `.DS_Store`, macOS
`._x.jpg`), and a symlinked folder that leads back to a folder already scanned is skipped instead of
walked again (torchvision's os.walk(followlinks=True) repeats a loop until the path is too long). Both
are counted, with the non-image files, in `ImageFolderScan.skipped`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.runtime.errors import UserError
from shared.datasets.imagefiles import IMAGE_EXTENSIONS, is_hidden, is_image_file

# Why each kind of entry was left out, as the reports phrase it (singular, plural).
SKIP_REASONS = {
    "hidden": ("hidden entry", "hidden entries"),  # names starting with a dot
    "non-image": ("non-image file", "non-image files"),
    "outside classes": ("file beside the class folders", "files beside the class folders"),
    "loop": ("folder loop or duplicate via a symlink", "folder loops or duplicates via symlinks"),
    "duplicate": ("copy of a picture found under another path", "copies of pictures found under other paths"),
}


@dataclass
class Skipped:
    """What the scan left out: a count and the first example (a path relative to the root) per reason."""

    counts: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)

    def add(self, reason: str, example: str) -> None:
        """Count one entry left out for `reason`."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, example)

    def describe(self) -> str:
        """'skipped: 3 hidden entries (...; first: cat/._1.jpg), 2 non-image files (first: cat/notes.txt)'."""
        parts = [f"{self.counts[r]} {SKIP_REASONS[r][self.counts[r] != 1]} (first: {self.first[r]})"
                 for r in SKIP_REASONS if self.counts.get(r)]
        return "skipped: " + (", ".join(parts) if parts else "nothing")


@dataclass(frozen=True)
class ImageFolderScan:
    """The sorted file list of an ImageFolder tree: relative paths, labels and class names."""

    root: Path
    classes: list[str]
    files: list[str]    # paths relative to root, POSIX separators, in sample order
    labels: list[int]   # class index of each file
    skipped: Skipped = field(default_factory=Skipped, compare=False)
    notes: tuple = field(default=(), compare=False)  # lines the reports print (e.g. extract/duplicates.py's)

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
                               [self.labels[i] for i in keep], self.skipped, self.notes)


def _entries(folder: Path) -> list[os.DirEntry]:
    """The entries of one folder, sorted by name; UserError naming the folder if it cannot be read."""
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as err:
        raise UserError(f"cannot read folder {folder} ({err.strerror or err}). Fix its permissions, or move it "
                        f"out of --data-path if it is not data.") from None


def _folder_id(path) -> tuple[int, int]:
    """(st_dev, st_ino) of the real folder behind `path` (symlinks followed): its identity on this machine."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _is_dir(entry: os.DirEntry) -> bool:
    """True for a folder or a symlink to one; a broken link counts as a file (it is reported as a bad image)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def find_classes(root: Path, skipped: Skipped | None = None) -> list[str]:
    """Sorted names of the visible sub-folders of root (torchvision's find_classes, minus hidden names)."""
    skipped = skipped if skipped is not None else Skipped()
    classes = []
    for entry in _entries(root):
        if is_hidden(entry.name):
            skipped.add("hidden", entry.name + ("/" if _is_dir(entry) else ""))
        elif _is_dir(entry):
            classes.append(entry.name)
        else:
            skipped.add("outside classes", entry.name)
    return classes


def _walk(root: Path, top: str, seen: set, skipped: Skipped) -> list[tuple[str, list[str]]]:
    """(folder, image names) for `top` and every visible folder below it, each real folder once."""
    found, stack = [], [top]
    while stack:
        rel = stack.pop()
        names, subfolders = [], []
        for entry in _entries(root / rel):
            path = f"{rel}/{entry.name}"
            if is_hidden(entry.name):
                skipped.add("hidden", path + ("/" if _is_dir(entry) else ""))
            elif _is_dir(entry):
                subfolders.append(path)
            elif is_image_file(entry.name):
                names.append(entry.name)
            else:
                skipped.add("non-image", path)
        found.append((rel, names))
        claimed = [path for path in subfolders if _claim(root / path, path, seen, skipped)]  # first name wins
        stack.extend(reversed(claimed))  # popped in name order
    return found


def _claim(folder: Path, rel: str, seen: set, skipped: Skipped) -> bool:
    """Mark a folder visited; False (and counted as a loop) if its real folder was visited already."""
    ident = _folder_id(folder)
    if ident in seen:
        skipped.add("loop", f"{rel} -> {os.readlink(folder)}" if folder.is_symlink() else rel)
        return False
    seen.add(ident)
    return True


def _class_files(root: Path, name: str, seen: set, skipped: Skipped) -> list[str]:
    """Image files under root/name, nested folders included, in torchvision's order (folders by path, then names)."""
    # torchvision sorts os.walk's (dirpath, dirnames, filenames) tuples, i.e. by folder path, then each
    # folder's file names.
    return [f"{folder}/{filename}" for folder, names in sorted(_walk(root, name, seen, skipped))
            for filename in names]


def _no_classes(root: Path, skipped: Skipped) -> UserError:
    """The refusal for a root without (visible) class folders."""
    hidden = f" ({skipped.describe()})" if skipped.counts else ""
    return UserError(
        f"--data-path {root} has no class folders{hidden}. Put each class's images in its own sub-folder "
        f"(root/cat/001.jpg, ...); for an unlabelled dataset use a single sub-folder, e.g. root/all/."
    )


def _empty_classes(root: Path, empty: list[str]) -> UserError:
    """The refusal naming class folders without images."""
    shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
    return UserError(
        f"{len(empty)} class folder(s) in {root} hold no images ({shown}). Add images with one of the "
        f"extensions {' '.join(IMAGE_EXTENSIONS)} or remove those folders (every sub-folder is a class)."
    )


def scan_image_folder(root) -> ImageFolderScan:
    """Scan root/<class>/**/<image>; UserError for a missing root, no class folders or empty classes."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(
            f"--data-path {root} does not exist or is not a folder. Pass an ImageFolder root: one sub-folder "
            f"per class holding that class's images (root/cat/001.jpg, root/dog/002.png, ...)."
        )
    skipped = Skipped()
    classes = find_classes(root, skipped)
    if not classes:
        raise _no_classes(root, skipped)
    # The root and every class folder count as visited from the start, so a link back to any of them
    # (a/up -> ..) is a loop, never a second copy of another class's images under this label.
    seen = {_folder_id(root), *(_folder_id(root / name) for name in classes)}
    files, labels, empty = [], [], []
    for index, name in enumerate(classes):
        found = _class_files(root, name, seen, skipped)
        if not found:
            empty.append(name)
        files.extend(found)
        labels.extend([index] * len(found))
    if empty:
        raise _empty_classes(root, empty)
    return ImageFolderScan(root.resolve(), classes, files, labels, skipped)
