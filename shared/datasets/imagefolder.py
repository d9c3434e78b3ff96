"""Finding the images of a folder: the one discovery of extract's ImageFolder scan and evaluate's image folders.

torchvision's order (a class is a top-level folder, nested folders folded into it), but dot-names are never data;
symlinked folders are followed, each real folder once, and a loop is refused. Everything left out is counted.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.runtime.cli import counted
from shared.runtime.errors import UserError

# The extensions torchvision's ImageFolder accepts, matched case-insensitively as it does.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_image_file(name: str) -> bool:
    """True for names ending in one of IMAGE_EXTENSIONS, case-insensitively."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def is_hidden(name: str) -> bool:
    """Names starting with a dot are tool or OS metadata (.ipynb_checkpoints, .DS_Store, ._x.jpg), never data."""
    return name.startswith(".")


LOOSE_CLASS = "."  # the group of images lying directly in a folder read with loose files (evaluate's folders)

# Why each kind of entry was left out, as the reports phrase it (singular, plural).
SKIP_REASONS = {
    "hidden": ("hidden entry", "hidden entries"),  # names starting with a dot
    "non-image": ("non-image file", "non-image files"),
    "outside classes": ("file beside the class folders", "files beside the class folders"),
    "linked folder": ("folder reached again via a symlink", "folders reached again via symlinks"),
    "duplicate": ("copy of a picture found under another path", "copies of pictures found under other paths"),
    "no image": ("sample without an image member", "samples without an image member"),  # tar shards
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
    notes: tuple = field(default=(), compare=False)  # lines the reports print (nested folders, duplicates)

    def __len__(self) -> int:
        return len(self.files)

    def image(self, pos: int):
        """What PIL opens for the image at position pos (here its path; sources.py's listings give bytes)."""
        return self.root / self.files[pos]

    def where(self, pos: int) -> str:
        """The image's full path, for messages."""
        return str(self.root / self.files[pos])

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
        return dataclasses.replace(self, files=[self.files[i] for i in keep], labels=[self.labels[i] for i in keep])


# ---- The walk: every visible folder below a class once, symlinks followed, loops refused ----

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


def _folder(root: Path, rel: str, skipped: Skipped, images: bool = True) -> tuple[list[str], list[str]]:
    """(image names, visible sub-folders) of root/rel, the rest counted in skipped; images=False takes no file."""
    names, subfolders = [], []
    try:
        with os.scandir(root / rel) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as err:
        raise UserError(f"cannot read folder {root / rel} ({err.strerror or err}). Fix its permissions, or move it "
                        f"out of the image folder if it is not data.") from None
    for entry in entries:
        path = f"{rel}/{entry.name}" if rel else entry.name
        if is_hidden(entry.name):
            skipped.add("hidden", path + ("/" if _is_dir(entry) else ""))
        elif _is_dir(entry):
            subfolders.append(path)
        elif images and is_image_file(entry.name):
            names.append(entry.name)
        else:
            skipped.add("non-image" if images else "outside classes", path)
    return names, subfolders


@dataclass
class _Walk:
    """One scan's state: the real folders claimed so far, what was left out, the nested folders seen."""
    root: Path
    seen: set
    skipped: Skipped
    nested: list = field(default_factory=list)  # nested folders holding images, relative to root

    def claim(self, rel: str, ancestors: tuple) -> tuple | None:
        """The folder's id, marked visited; None (counted) if visited already; UserError for a loop."""
        ident, link = _folder_id(self.root / rel), self.root / rel
        if ident in ancestors:  # a symlink to a folder containing it: its tree would never end
            raise UserError(
                f"{link} is a symlink to {os.readlink(link) if link.is_symlink() else '?'}, a folder that contains "
                f"the link itself: a symlink loop, whose tree never ends (torchvision would walk it until the path is "
                f"too long). Remove the link (`rm {link}`), or point it at a folder outside {self.root}; symlinks to "
                f"other folders, such as class folders kept elsewhere, are followed.")
        if ident in self.seen:
            self.skipped.add("linked folder", f"{rel} -> {os.readlink(link)}" if link.is_symlink() else rel)
            return None
        self.seen.add(ident)
        return ident

    def tree(self, top: str, ancestors: tuple) -> list[str]:
        """Image files under root/top, nested folders included, in torchvision's order (sorted os.walk tuples)."""
        found, stack = [], [(top, ancestors)]
        while stack:
            rel, above = stack.pop()
            names, subfolders = _folder(self.root, rel, self.skipped)
            found.append((rel, names))
            if names and rel != top:
                self.nested.append(rel)
            for path in reversed(subfolders):  # popped in name order; the first name to reach a folder wins
                ident = self.claim(path, above)
                if ident is not None:
                    stack.append((path, (*above, ident)))
        return [f"{folder}/{name}" for folder, names in sorted(found) for name in names]


def scan_image_folder(root, loose: bool = False) -> ImageFolderScan:
    """Scan root/<class>/**/<image>; UserError for a missing root, no class folders, empty classes or a loop."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(
            f"--data-path {root} does not exist or is not a folder. Pass an ImageFolder root: one sub-folder "
            f"per class holding that class's images (root/cat/001.jpg, root/dog/002.png, ...).")
    skipped = Skipped()
    loose_files, classes = _folder(root, "", skipped, images=loose)  # without `loose`: files beside classes left out
    if not classes and not loose:
        hidden = f" ({skipped.describe()})" if skipped.counts else ""
        raise UserError(f"--data-path {root} has no class folders{hidden}. Put each class's images in its own "
                        f"sub-folder (root/cat/001.jpg, ...); for an unlabelled dataset use a single sub-folder, e.g. "
                        f"root/all/.")
    # The root and every class folder count as visited from the start, so a link to another class (a/b -> ../b)
    # is skipped, never a second copy of that class's images under this label; a link to the root is a loop.
    top = _folder_id(root)
    walk = _Walk(root, {top, *(_folder_id(root / name) for name in classes)}, skipped)
    groups = [(LOOSE_CLASS, loose_files)] if loose_files else []
    empty = []
    for name in classes:
        found = walk.tree(name, (top, _folder_id(root / name)))
        if found or not loose:
            groups.append((name, found))
        if not found:
            empty.append(name)
    if empty and not loose:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise UserError(
            f"{counted(len(empty), 'class folder')} in {root} {'holds' if len(empty) == 1 else 'hold'} no images "
            f"({shown}). Add images with one of the extensions {' '.join(IMAGE_EXTENSIONS)} or remove those folders "
            f"(every sub-folder is a class).")
    files = [f for _, found in groups for f in found]
    labels = [index for index, (_, found) in enumerate(groups) for _ in found]
    notes, nested = (), walk.nested
    if nested:  # the report line saying nested folders were folded into their top-level class
        notes = (f"nested folders: {counted(len(nested), 'sub-folder')} below the class folders "
                 f"{'holds' if len(nested) == 1 else 'hold'} images, folded into their top-level class (first: "
                 f"{nested[0]} -> class {nested[0].split('/')[0]}); for a label per sub-folder, make each one a "
                 f"top-level folder (a folder of symlinks to them will do)",)
    return ImageFolderScan(root.resolve(), [name for name, _ in groups], files, labels, skipped, notes)
