"""What a real image collection throws at extraction (issue 29, items 7-9): huge drawings, one picture under two
labels, and an --out inside the images. Tiny folders on disk, through `python -m extract`'s own main and
run_extract."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import shared.datasets.images as images
from extract.__main__ import main as extract_main
from shared.datasets.duplicates import find_duplicates
from shared.datasets.imagefolder import scan_image_folder
from extract.config import BAD_FILES_NAME, ExtractConfig
from extract.run import format_summary, run_extract
from shared.datasets.shards import LatentDataset, load_index
from shared.runtime.errors import UserError
from tests.conftest import make_image_folder


def _run(argv, capsys) -> tuple[int, str, str]:
    """`python -m extract` in this process: (exit status, stdout, stderr as one line)."""
    try:
        rc = extract_main([str(a) for a in argv])
    except SystemExit as stop:
        rc = stop.code
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())


def _config(data, out, vae, **kw) -> ExtractConfig:
    """A tiny CPU extraction."""
    return ExtractConfig(data_path=Path(data), out=Path(out), vae=str(vae),
                         **{**dict(image_size=16, shard_size=4, batch_size=4, num_workers=0), **kw})


# ----------------------------------------------------------------------------------------------------------
# 7. Huge images: one stated limit, --max-image-pixels N|none
# ----------------------------------------------------------------------------------------------------------

def _with_big(root: Path) -> Path:
    """cat/dog folder plus dog/big.png of 64x48 = 3,072 pixels (above a limit of 2,000, below the default)."""
    make_image_folder(root, classes=("cat", "dog"), per_class=2)
    pixels = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "dog" / "big.png")
    return root


def test_check_states_one_limit_and_names_the_option(tmp_path, capsys):
    root = _with_big(tmp_path / "data")
    rc, out, _ = _run(["--data-path", root, "--check", "--num-workers", "0", "--max-image-pixels", "2000"], capsys)
    assert rc == 1
    assert "dog/big.png: decompression bomb guard: 64x48 = 3,072 pixels, above the limit of 2,000" in out
    assert "pass --max-image-pixels 3072 (or none)" in out
    rc, out, _ = _run(["--data-path", root, "--check", "--num-workers", "0", "--max-image-pixels", "none"], capsys)
    assert rc == 0 and "bad files: 0" in out and "--max-image-pixels" not in out


def test_extraction_admits_big_images_only_when_asked(tmp_path, tiny_vae_dir, capsys):
    root = _with_big(tmp_path / "data")
    summary = run_extract(_config(root, tmp_path / "limited", tiny_vae_dir, max_image_pixels=2000))
    assert summary["num_samples"] == 4 and summary["num_bad"] == 1 and summary["too_large"] == 1
    assert "--max-image-pixels" in format_summary(summary)
    reason = json.loads((tmp_path / "limited" / BAD_FILES_NAME).read_text())["reason"]
    assert reason.startswith(images.BOMB_REASON) and "2,000" in reason
    summary = run_extract(_config(root, tmp_path / "all", tiny_vae_dir, max_image_pixels=None))
    assert summary["num_samples"] == 5 and summary["num_bad"] == 0
    assert load_index(tmp_path / "all")["extract_settings"]["max_image_pixels"] == "none"
    # Another limit decides other files: the folder of one limit is not resumed with another.
    rc, _, err = _run(["--data-path", root, "--out", tmp_path / "all", "--vae", tiny_vae_dir, "--image-size", "16",
                       "--shard-size", "4", "--batch-size", "4", "--num-workers", "0"], capsys)
    assert rc == 2 and "max_image_pixels" in err


def test_bad_limit_values_are_refused_by_the_parser(tmp_path, capsys):
    for value in ("0", "-5", "lots"):
        rc, _, err = _run(["--data-path", tmp_path, "--check", "--max-image-pixels", value], capsys)
        assert rc == 2 and "--max-image-pixels" in err and "positive number of pixels or 'none'" in err


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_an_admitted_huge_image_is_decoded_reduced_and_matches_the_full_path(tmp_path, monkeypatch, fmt):
    # A 256x192 picture stands in for a 600 Mpx drawing: the "huge" threshold is lowered to 1,000 pixels.
    y, x = np.mgrid[0:192, 0:256]
    smooth = np.stack([x, y, (x + y) // 2], axis=-1).astype(np.uint8)  # (H, W, 3)
    path = tmp_path / f"big.{fmt.lower()}"
    Image.fromarray(smooth).save(path, format=fmt, quality=95)
    full = images.load_image(path, 16, max_pixels=None)  # under the real default: the unchanged ADM path
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1000)
    opened = []
    real_decode = images._decode
    monkeypatch.setattr(images, "_decode", lambda img, size, large: opened.append(large) or real_decode(img, size, large))
    rgb, mode, size = images.open_image(path, None, 16)
    assert opened == [True] and size == (256, 192) and mode == "RGB"
    assert min(rgb.size) == 48  # 192 reduced by 4: the short side stays >= 2 x 16 for the box-halving after it
    reduced = images.load_image(path, 16, max_pixels=None)
    assert reduced.shape == full.shape == (3, 16, 16)
    assert np.abs(reduced.astype(int) - full.astype(int)).mean() < 3  # same picture, another reduction filter
    with pytest.raises(images.BadImage, match="above the limit of 1,000"):
        images.load_image(path, 16, max_pixels=1000)


# ----------------------------------------------------------------------------------------------------------
# 8. One picture under two labels
# ----------------------------------------------------------------------------------------------------------

def _with_copies(root: Path) -> Path:
    """cat/dog/eel; dog/link.png -> cat/000.png (symlink), eel/copy.png = the bytes of cat/001.png,
    cat/hard.png a hard link to cat/002.png (same label)."""
    make_image_folder(root, classes=("cat", "dog", "eel"), per_class=3)
    os.symlink(root / "cat" / "000.png", root / "dog" / "link.png")
    (root / "eel" / "copy.png").write_bytes((root / "cat" / "001.png").read_bytes())
    os.link(root / "cat" / "002.png", root / "cat" / "hard.png")
    return root


def test_duplicates_are_found_by_real_file_and_by_bytes(tmp_path):
    scan = scan_image_folder(_with_copies(tmp_path / "data"))
    groups = [[scan.files[p] for p in group] for group in find_duplicates(scan)]
    assert sorted(groups) == [["cat/000.png", "dog/link.png"], ["cat/001.png", "eel/copy.png"],
                              ["cat/002.png", "cat/hard.png"]]


def test_check_reports_duplicates_and_the_policy(tmp_path, capsys):
    root = _with_copies(tmp_path / "data")
    rc, out, _ = _run(["--data-path", root, "--check", "--num-workers", "0"], capsys)
    assert rc == 0 and "3 classes, 9 images" in out
    assert "3 copies of pictures found under other paths (first: cat/hard.png = cat/002.png)" in out
    assert "3 pictures found under 6 paths" in out and "2 of them under different labels" in out
    assert "--duplicates first keeps each picture once" in out
    rc, out, _ = _run(["--data-path", root, "--check", "--num-workers", "0", "--duplicates", "all"], capsys)
    assert "3 classes, 12 images" in out and "--duplicates all keeps every copy" in out
    rc, out, _ = _run(["--data-path", root, "--check", "--num-workers", "0", "--duplicates", "none"], capsys)
    assert "3 classes, 7 images" in out  # every copy of the two pictures with two labels; one hard-linked copy


def test_extraction_encodes_each_picture_once_by_default_and_says_so(tmp_path, tiny_vae_dir):
    root = _with_copies(tmp_path / "data")
    summary = run_extract(_config(root, tmp_path / "out", tiny_vae_dir))
    assert summary["num_samples"] == 9
    text = format_summary(summary)
    assert "3 pictures found under 6 paths" in text and "copies of pictures found under other paths" in text
    assert LatentDataset(tmp_path / "out").labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    summary = run_extract(_config(root, tmp_path / "all", tiny_vae_dir, duplicates="all"))
    assert summary["num_samples"] == 12 and "--duplicates all keeps every copy" in format_summary(summary)


# ----------------------------------------------------------------------------------------------------------
# 9. --out inside --data-path, and the advice that led there
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["same", "inside", "holds"])
def test_out_and_data_path_must_be_separate(tmp_path, tiny_vae_dir, capsys, where):
    root = make_image_folder(tmp_path / "data", classes=("cat", "dog"), per_class=2)
    data, out = {"same": (root, root), "inside": (root, root / "latents"), "holds": (root / "cat", root)}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc, _, err = _run(["--data-path", data, "--out", out, "--vae", tiny_vae_dir, "--image-size", "16"], capsys)
    assert rc == 2 and err.count("error:") == 1
    assert "the shards, index and lock would be written among the images" in err and "separate output folder" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_train_names_a_separate_folder_for_an_image_folder(tmp_path, tiny_vae_dir, capsys):
    from tests.helpers import run_main
    from train.__main__ import main as train_main

    root = make_image_folder(tmp_path / "drawings", classes=("cat", "dog"), per_class=1)
    with pytest.raises(UserError) as info:
        load_index(root)
    text = str(info.value)
    assert "holds images, not latents" in text and f"--out {tmp_path / 'drawings-latents'}" in text
    rc, _, err = run_main(train_main, ["--latents", root, "--results-dir", tmp_path / "run"], capsys)
    assert rc == 2 and "separate folder" in err and "drawings-latents" in err
    # Done literally, the advice works: extraction into the named folder is accepted.
    rc, out, err = _run(["--data-path", root, "--out", tmp_path / "drawings-latents", "--vae", tiny_vae_dir,
                        "--image-size", "16", "--dry-run"], capsys)
    assert rc == 0 and "2 images in 2 classes" in out, err


def test_an_admitted_huge_palette_drawing_is_reduced_in_strips(tmp_path, monkeypatch):
    # Drawings are often palette PNGs, which Image.reduce refuses: widened strip by strip, then reduced.
    rng = np.random.default_rng(2)
    drawing = Image.fromarray(rng.integers(0, 3, (700, 520), dtype=np.uint8), "L").convert("P")
    drawing.putpalette([0, 0, 0, 255, 255, 255, 200, 30, 30] + [0] * 759)
    drawing.save(tmp_path / "drawing.png", transparency=1)  # palette entry 1 is transparent: white after flattening
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1000)
    rgb, mode, size = images.open_image(tmp_path / "drawing.png", None, 16)
    assert (mode, size, rgb.size) == ("P", (520, 700), (33, 44))  # reduced by 16: short side 33 >= 2 x 16
    whole = images.to_rgb(Image.open(tmp_path / "drawing.png").convert("RGBA").reduce(16))
    assert np.array_equal(np.asarray(rgb), np.asarray(whole))
