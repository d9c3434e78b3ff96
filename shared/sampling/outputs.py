"""The --out folder: atomic PNGs, settings.json guarding resume, the grid and the streamed samples.npz."""
from __future__ import annotations

import json
import math
import re
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from shared.runtime.errors import UserError
from shared.runtime.rerun import differences, listed
from shared.runtime.fsio import TMP_PREFIX, atomic_write, atomic_write_text

SETTINGS_NAME = "settings.json"
GRID_NAME = "grid.png"
NPZ_NAME = "samples.npz"
# A grid of 50,000 ImageNet samples would be a 57,000-pixel square: show at most this many cells.
GRID_MAX_ROWS = 16
GRID_MAX_CELLS = 256
_PNG_RE = re.compile(r"^(\d{6,})-class(\d+)(-[\w.-]+)?\.png$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
NAME_CHARS = 40  # longest class name kept in a file name
MIN_CELL = 96  # grid pixels: smaller images (digits: 32) are enlarged by an integer factor so captions fit
PAD = 4


def image_name(index: int, label: int, class_name: str | None = None) -> str:
    """File name of image `index`: `{index:06d}-class{label}.png`, or `...-class{label}-{name}.png` with a name."""
    name = safe_name(class_name) if class_name is not None else ""
    return f"{index:06d}-class{label}-{name}.png" if name and name != str(label) else f"{index:06d}-class{label}.png"


def safe_name(text: str) -> str:
    """A class name usable in a file name on any system: runs of other characters become '_'."""
    return _UNSAFE.sub("_", str(text)).strip("._-")[:NAME_CHARS].strip("._-")


def remove_stale_temps(out: Path) -> int:
    """Delete temp files a killed run left behind (call before any process starts writing)."""
    stale = list(Path(out).glob(f"{TMP_PREFIX}*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def save_png(path: Path, pixels: np.ndarray) -> None:
    """Write one uint8 (H,W,3) image atomically as PNG."""
    atomic_write(path, lambda tmp: Image.fromarray(pixels).save(tmp, format="PNG"))


def write_json(path: Path, data: dict) -> None:
    """Write indented JSON atomically."""
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def check_out_path(out: Path, what: str) -> None:
    """UserError unless --out can be a folder: not an existing file, not a name ending like an image file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, but {what} writes a folder (one PNG per image plus {GRID_NAME}); "
                        f"pass a folder path to --out, e.g. {out.with_suffix('')}.")
    if not out.exists() and out.suffix.lower() in IMAGE_SUFFIXES:
        raise UserError(f"--out {out} names an image file, but {what} writes a folder (one PNG per image plus "
                        f"{GRID_NAME}, which is the picture of them all); pass a folder path to --out, e.g. "
                        f"{out.with_suffix('')}, and open {out.with_suffix('') / GRID_NAME}.")


def check_out_dir(out: Path, settings: dict) -> None:
    """UserError if `out` cannot be a folder or holds images of a run whose settings.json identity differs from ours."""
    out = Path(out)
    check_out_path(out, "sampling")
    if not out.exists():
        return
    path = out / SETTINGS_NAME
    if not path.exists():
        if any(_PNG_RE.match(p.name) for p in out.iterdir()):
            raise UserError(f"--out {out} already holds sample PNGs but no {SETTINGS_NAME}, so they cannot be "
                            f"resumed safely; pass a new --out folder or empty this one.")
        return
    try:
        previous = json.loads(path.read_text())["identity"]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a settings file written by `python -m sample` ({err}); "
                        f"pass a new --out folder or delete it.") from err
    mine = settings["identity"]
    differ = differences(previous, mine, nested=False)
    if differ:
        raise UserError(
            f"--out {out} holds images of another run ({listed(differ)}). Resuming would mix two runs' images: "
            f"pass a new --out folder, or rerun with the settings recorded in {path}.")


def missing_indices(out: Path, indices, names) -> list[int]:
    """The indices whose PNG (file `names[k]` for `indices[k]`) is not on disk yet (written PNGs are whole: renamed in)."""
    out = Path(out)
    return [i for i, name in zip(indices, names) if not (out / name).exists()]


def grid_layout(labels) -> list[list[int | None]]:
    """Rows of image indices: one row per class when classes repeat, else a near-square in index order."""
    labels = list(labels)
    if len(set(labels)) < len(labels):
        rows: dict[int, list[int]] = {}
        for i, y in enumerate(labels):
            rows.setdefault(y, []).append(i)
        kept = list(rows.values())[:GRID_MAX_ROWS]
        width = min(max(len(r) for r in kept), GRID_MAX_CELLS // len(kept))
        return [r[:width] + [None] * (width - len(r[:width])) for r in kept]
    count = min(len(labels), GRID_MAX_CELLS)
    width = math.ceil(math.sqrt(count))
    cells = list(range(count)) + [None] * (width * math.ceil(count / width) - count)
    return [cells[r:r + width] for r in range(0, len(cells), width)]


def _font(size: int):
    """PIL's bundled font at `size` pixels (Pillow >= 10.1); the fixed-size bitmap font on older Pillow."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def _fit(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> str:
    """`text`, shortened with an ellipsis until it fits `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def labelled_grid(load_image, labels, captions: list[str], title: str) -> np.ndarray:
    """The images of grid_layout (load_image(i) -> uint8 HxWx3), each captioned, under a title -> uint8 (H',W',3)."""
    layout = grid_layout(labels)
    h, w = load_image(next(i for row in layout for i in row if i is not None)).shape[:2]
    scale = max(1, math.ceil(MIN_CELL / min(h, w)))
    cell_w, cell_h = w * scale, h * scale
    size = min(16, max(10, cell_w // 8))  # caption pixels: readable under a 96 px cell, modest under 256 px
    font, line = _font(size), size + 6
    canvas = Image.new("RGB", (PAD + len(layout[0]) * (cell_w + PAD), line + PAD + len(layout) * (cell_h + line + PAD)),
                       "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((PAD, 3), _fit(draw, title, font, canvas.width - 2 * PAD), fill="black", font=font)
    for r, row in enumerate(layout):
        for c, i in enumerate(row):
            if i is None:
                continue
            x, y = PAD + c * (cell_w + PAD), line + PAD + r * (cell_h + line + PAD)
            canvas.paste(Image.fromarray(load_image(i)).resize((cell_w, cell_h), Image.NEAREST), (x, y))
            text = _fit(draw, captions[i], font, cell_w)
            draw.text((x + (cell_w - draw.textlength(text, font=font)) / 2, y + cell_h + 2), text, fill="black",
                      font=font)
    return np.asarray(canvas)


def captions_for(labels, class_names) -> list[str]:
    """The caption of each image: its class name when the latents record names, else 'class N'."""
    names = list(class_names or [])
    return [names[y] if 0 <= y < len(names) and str(names[y]) else f"class {y}" for y in map(int, labels)]


def write_grid(path: Path, load_image, labels, captions: list[str], title: str) -> None:
    """The labelled grid of the images (load_image(i) -> uint8 HxWx3) as one PNG: the same picture as the previews'."""
    save_png(Path(path), labelled_grid(load_image, labels, captions, title))


def write_png_grid(path: Path, image_paths, labels, captions: list[str], title: str) -> None:
    """write_grid of PNGs on disk: only the images the grid shows are read, one at a time."""
    write_grid(path, lambda i: read_png(image_paths[i]), labels, captions, title)


def read_png(path: Path) -> np.ndarray:
    """One PNG as uint8 (H,W,3)."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _write_npy_member(archive: zipfile.ZipFile, name: str, shape, dtype, chunks) -> None:
    """Stream one .npy member into the zip: header, then the raw C-order bytes chunk by chunk."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    with archive.open(name, "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, header)
        for chunk in chunks:
            member.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())


def write_npz(path: Path, image_paths, labels) -> None:
    """samples.npz (arr_0 uint8 N x H x W x 3, labels int64 N), streamed so 50k images fit in memory."""
    image_paths = list(image_paths)
    h, w = read_png(image_paths[0]).shape[:2]

    def write(tmp):
        """arr_0.npy then labels.npy, stored uncompressed as np.savez does."""
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            images = (_checked(read_png(p), (h, w, 3), p) for p in image_paths)
            _write_npy_member(archive, "arr_0.npy", (len(image_paths), h, w, 3), np.uint8, images)
            _write_npy_member(archive, "labels.npy", (len(labels),), np.int64, [np.asarray(labels)])

    atomic_write(Path(path), write)


def _checked(pixels: np.ndarray, shape, path) -> np.ndarray:
    """Refuse an image whose size differs from the first one (the npz holds one array)."""
    if pixels.shape != shape:
        raise UserError(f"{path} is {pixels.shape}, unlike the other samples {shape}; delete it and rerun.")
    return pixels
