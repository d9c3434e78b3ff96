"""Which files are images: the one rule extract's ImageFolder scan and evaluate's image folders share."""
from __future__ import annotations

# The extensions torchvision's ImageFolder accepts, matched case-insensitively as it does.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_image_file(name: str) -> bool:
    """True for names ending in one of IMAGE_EXTENSIONS, case-insensitively."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def is_hidden(name: str) -> bool:
    """Names starting with a dot are tool or OS metadata (.ipynb_checkpoints, .DS_Store, ._x.jpg), never data."""
    return name.startswith(".")
