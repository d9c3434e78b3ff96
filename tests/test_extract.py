"""extract/: ImageFolder order, every PIL mode, bad input, bad files, resume, several processes, moments."""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shared.datasets.imagefolder import scan_image_folder
from shared.datasets.images import MAX_IMAGE_PIXELS, center_crop_arr, load_image, open_rgb, preprocess
from extract.config import BAD_FILES_NAME, SETTINGS_NAME, ExtractConfig
from extract.run import run_extract, sidecar_path
from shared.runtime.errors import ChoiceError, UserError, advise
from shared.runtime.fsio import stale_tmps, tmp_name
from shared.datasets.shards import FLIP_MODES, INDEX_NAME, LatentDataset, shard_name
from tests.conftest import ROOT, make_image_folder, make_tiny_vae


def _config(data, out, vae, **kw):
    """An ExtractConfig for tiny CPU runs."""
    defaults = dict(image_size=16, shard_size=4, batch_size=3, num_workers=0)
    return ExtractConfig(data_path=Path(data), out=Path(out), vae=str(vae), **{**defaults, **kw})


def _folder_bytes(out: Path) -> dict:
    """Every shard, the index, its arrays and the bad-file report, by name (the bytes a reader relies on)."""
    names = sorted(p.name for p in out.glob("shard-*.tar")) + [INDEX_NAME, "index-arrays.npz", BAD_FILES_NAME]
    return {name: (out / name).read_bytes() for name in names}


def _save(img: Image.Image, path: Path, **kw) -> Path:
    """Save an image, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height (PIL's bomb check runs on the header, before decoding)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
                     + chunk(b"IEND", b""))
    return path


# ----------------------------------------------------------------------------------------------------------
# ImageFolder order
# ----------------------------------------------------------------------------------------------------------

def test_labels_follow_imagefolder_order(tmp_path):
    root = tmp_path / "data"
    pixel = Image.new("RGB", (4, 4))
    for rel in ["b/2.png", "b/10.JPG", "b/nested/deeper/0.webp", "b/nested/1.png", "b/a.txt", "a b/x.Png",
                "a/z.jpeg", "a/sub/y.bmp", "B/q.tif", "a_b/p.ppm", "a/.hidden.png", "b/notes.JPG.txt"]:
        if rel.endswith(".txt"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("not an image")
        else:
            _save(pixel, root / rel, format="PNG")  # content format is irrelevant to the scan
    scan = scan_image_folder(root)
    # Classes sorted as strings ("B" < "a" < "a b" < "a_b" < "b"); within a class os.walk order sorted by
    # directory path, then file names sorted: torchvision's make_dataset, minus hidden names.
    assert scan.classes == ["B", "a", "a b", "a_b", "b"]
    assert list(zip(scan.files, scan.labels)) == [
        ("B/q.tif", 0),
        ("a/z.jpeg", 1), ("a/sub/y.bmp", 1),
        ("a b/x.Png", 2),
        ("a_b/p.ppm", 3),
        ("b/10.JPG", 4), ("b/2.png", 4), ("b/nested/1.png", 4), ("b/nested/deeper/0.webp", 4),
    ]
    assert scan.counts() == [1, 2, 1, 1, 4]
    # Unlike torchvision, the hidden file is not data; it and the two text files are counted as skipped.
    assert scan.skipped.counts == {"hidden": 1, "non-image": 2}


def test_limit_spreads_over_all_classes(tmp_path):
    scan = scan_image_folder(make_image_folder(tmp_path / "d", classes=("a", "b", "c"), per_class=4, size=(4, 4)))
    small = scan.limited(3)
    assert small.files == ["a/000.png", "b/002.png", "c/003.png"] and small.labels == [0, 1, 2]
    assert small.fingerprint() != scan.fingerprint() and scan.limited(100) is scan


# ----------------------------------------------------------------------------------------------------------
# Pixels: modes, EXIF, ADM crop
# ----------------------------------------------------------------------------------------------------------

def _mode_images() -> dict:
    """name -> (image in an odd mode, file suffix, expected RGB of pixel (0, 0))."""
    p = Image.new("P", (8, 8), 1)
    p.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    p_transparent = p.copy()
    p_transparent.info["transparency"] = 1
    i16 = Image.fromarray(np.full((8, 8), 32768, np.uint16))  # mid-grey: 128 when scaled, 255 when clipped
    return {
        "L": (Image.new("L", (8, 8), 77), ".png", (77, 77, 77)),
        "LA": (Image.new("LA", (8, 8), (0, 0)), ".png", (255, 255, 255)),  # transparent -> white
        "P": (p, ".png", (200, 100, 50)),
        "P-transparency": (p_transparent, ".png", (255, 255, 255)),
        "RGBA": (Image.new("RGBA", (8, 8), (255, 0, 0, 128)), ".png", (255, 127, 127)),
        "CMYK": (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), ".tif", (255, 0, 0)),
        "I;16": (i16, ".png", (128, 128, 128)),
        "I": (Image.fromarray(np.full((8, 8), 65535, np.int32)), ".tif", (255, 255, 255)),
        "F": (Image.fromarray(np.full((8, 8), 0.5, np.float32)), ".tif", (128, 128, 128)),
        "1": (Image.new("1", (8, 8), 1), ".png", (255, 255, 255)),
    }


@pytest.mark.parametrize("name", list(_mode_images()))
def test_every_mode_becomes_rgb(tmp_path, name):
    img, suffix, expected = _mode_images()[name]
    path = _save(img, tmp_path / f"img{suffix}")
    rgb = open_rgb(path)
    assert rgb.mode == "RGB" and rgb.size == (8, 8)
    assert np.abs(np.asarray(rgb)[0, 0].astype(int) - expected).max() <= 1, np.asarray(rgb)[0, 0]
    pixels = load_image(path, 4)
    assert pixels.shape == (3, 4, 4) and pixels.dtype == np.uint8


def test_exif_orientation_is_applied(tmp_path):
    arr = np.zeros((10, 20, 3), np.uint8)  # 20 wide, 10 high: left half red, right half blue
    arr[:, :10] = (255, 0, 0)
    arr[:, 10:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation 6: the stored picture must be turned 90 degrees clockwise to display
    path = _save(Image.fromarray(arr), tmp_path / "rotated.png", exif=exif)
    shown = np.asarray(open_rgb(path))
    assert shown.shape == (20, 10, 3)  # now portrait
    assert (shown[:10] == (255, 0, 0)).all() and (shown[10:] == (0, 0, 255)).all()  # left side went on top


def test_center_crop_box_then_bicubic(tmp_path):
    arr = np.zeros((600, 1200, 3), np.uint8)  # three vertical stripes; the centre one must survive
    arr[:, :400], arr[:, 400:800], arr[:, 800:] = (255, 0, 0), (0, 255, 0), (0, 0, 255)
    out = center_crop_arr(Image.fromarray(arr), 256)
    assert out.shape == (256, 256, 3)
    assert (out[:, 100:156] == (0, 255, 0)).all()
    # 1200x600 -> box 600x300 (short side 300 < 512 stops the halving) -> bicubic 512x256 -> crop the centre.
    box = Image.fromarray(arr).resize((600, 300), Image.BOX).resize((512, 256), Image.BICUBIC)
    np.testing.assert_array_equal(out, np.asarray(box)[:, 128:384])
    x = preprocess(_save(Image.fromarray(arr), tmp_path / "s.png"), 16)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert x.min() == -1 and x.max() == 1


# ----------------------------------------------------------------------------------------------------------
# Bad input: one UserError before any VAE weights load
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def no_vae_load(monkeypatch):
    """Fail loudly if a test reaches the point of loading VAE weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("the VAE was loaded before the bad input was reported")
    monkeypatch.setattr("extract.run._load_vae", refuse)


def test_missing_data_path(tmp_path, tiny_vae_dir, no_vae_load):
    with pytest.raises(UserError, match="does not exist"):
        run_extract(_config(tmp_path / "nope", tmp_path / "out", tiny_vae_dir))


def test_no_class_folders(tmp_path, tiny_vae_dir, no_vae_load):
    _save(Image.new("RGB", (4, 4)), tmp_path / "flat" / "a.png")
    with pytest.raises(UserError, match="no class folders"):
        run_extract(_config(tmp_path / "flat", tmp_path / "out", tiny_vae_dir))


def test_empty_class_folders_are_named(tmp_path, tiny_vae_dir, no_vae_load):
    root = make_image_folder(tmp_path / "d", classes=("cat",), per_class=1, size=(4, 4))
    (root / "dog").mkdir()
    (root / "emu" / "sub").mkdir(parents=True)
    (root / "emu" / "sub" / "readme.txt").write_text("no images here")
    with pytest.raises(UserError, match=r"2 class folders .*hold no images \(dog, emu\)"):
        run_extract(_config(root, tmp_path / "out", tiny_vae_dir))


def test_image_size_must_match_the_vae_downsample(tmp_path, image_folder, no_vae_load):
    vae = make_tiny_vae(tmp_path / "vae4", levels=3)  # downsample factor 4, read from config.json only
    with pytest.raises(UserError, match="not a multiple of the VAE's downsample factor 4.*Use 32: multiples of 32"):
        run_extract(_config(image_folder, tmp_path / "out", vae, image_size=18))
    assert not (tmp_path / "out").exists()
    # 20 px -> 5x5 latents: a multiple of the factor that only the patch-1 presets divide: a warning, not a refusal.
    from extract.dry_run import describe_plan
    text = describe_plan(_config(image_folder, tmp_path / "out", vae, image_size=20))
    warning = next(line for line in text.splitlines() if line.startswith("warning:"))
    assert "5x5 latents" in warning and "only DiT presets with patch 1" in warning and "DiT-XL/1" in warning
    assert "DiT-XL/2" not in warning.split("For any preset")[0] and "use 32" in warning
    assert not (tmp_path / "out").exists()


def test_image_size_that_only_some_presets_fit_is_a_warning(tmp_path, image_folder, no_vae_load, capsys):
    from extract.dry_run import describe_plan
    vae = make_tiny_vae(tmp_path / "vae4", levels=3)
    # 40 px -> 10x10 latents: patches 1 and 2 divide 10, patch 4 and 8 do not; every suggestion must fit patch 8.
    text = describe_plan(_config(image_folder, tmp_path / "out", vae, image_size=40))
    warning = next(line for line in text.splitlines() if line.startswith("warning:"))
    assert "only DiT presets with patch 1 or 2" in warning and "DiT-XL/2" in warning and "DiT-XL/4" not in warning
    assert "32 or 64: multiples of 32" in warning
    assert "warning:" not in describe_plan(_config(image_folder, tmp_path / "out", vae, image_size=32))


def test_unknown_vae_spec(tmp_path, image_folder, no_vae_load):
    with pytest.raises(UserError, match="Unknown VAE"):
        run_extract(_config(image_folder, tmp_path / "out", "./no/such/vae"))


def test_out_folder_of_another_run_is_refused(tmp_path, image_folder, tiny_vae_dir):
    out = tmp_path / "out"
    run_extract(_config(image_folder, out, tiny_vae_dir))
    for change in ({"flip": "none"}, {"image_size": 8}, {"dtype": "fp32"}, {"limit": 5}):
        with pytest.raises(UserError, match="different extraction.*new --out"):
            run_extract(_config(image_folder, out, tiny_vae_dir, **change))
    other = make_tiny_vae(tmp_path / "other-vae", seed=1)
    with pytest.raises(UserError, match=r"vae\.source"):
        run_extract(_config(image_folder, out, other))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "shard-000000.tar").write_bytes(b"x")
    with pytest.raises(UserError, match=f"{SETTINGS_NAME} is missing"):
        run_extract(_config(image_folder, foreign, tiny_vae_dir))


def test_dry_run_checks_and_writes_nothing(tmp_path, image_folder, tiny_vae_dir, no_vae_load, capsys):
    from extract.__main__ import main

    out = tmp_path / "out"
    args = ["--data-path", str(image_folder), "--out", str(out), "--vae", str(tiny_vae_dir), "--image-size", "16",
            "--shard-size", "4", "--dry-run"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "9 images in 3 classes" in text and "3 shards of 4 images, 0 already finished" in text
    assert not out.exists()


@pytest.mark.slow
def test_cli_prints_one_paragraph_and_exits_2(tmp_path, tiny_vae_dir):
    cmd = [sys.executable, "-m", "extract", "--data-path", str(tmp_path / "missing"), "--out",
           str(tmp_path / "out"), "--vae", str(tiny_vae_dir)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("python -m extract: error: --data-path") and "Traceback" not in result.stderr
    assert "diffusers" not in result.stderr


# ----------------------------------------------------------------------------------------------------------
# Bad files
# ----------------------------------------------------------------------------------------------------------

def _add_bad_files(root: Path) -> dict:
    """Plant one bad file of each kind in root/dog; returns path -> expected reason fragment."""
    dog = root / "dog"
    (dog / "a-zero.png").write_bytes(b"")
    (dog / "b-text.jpg").write_text("this is not a picture")
    good = (dog / "000.png").read_bytes()
    (dog / "c-truncated.png").write_bytes(good[: len(good) // 2])
    _png_header_only(dog / "d-bomb.png", 12_000, MAX_IMAGE_PIXELS // 12_000 + 10)  # just above the limit
    os.symlink(dog / "gone.png", dog / "e-broken-link.png")
    return {"dog/a-zero.png": "cannot identify", "dog/b-text.jpg": "cannot identify",
            "dog/c-truncated.png": "", "dog/d-bomb.png": "decompression bomb",
            "dog/e-broken-link.png": "No such file"}


def test_bad_files_are_skipped_and_reported(tmp_path, image_folder, tiny_vae_dir):
    expected = _add_bad_files(image_folder)
    out = tmp_path / "out"
    summary = run_extract(_config(image_folder, out, tiny_vae_dir, num_workers=1))
    assert summary["num_bad"] == 5 and summary["num_samples"] == 9
    report = [json.loads(line) for line in (out / BAD_FILES_NAME).read_text().splitlines()]
    assert [r["path"] for r in report] == sorted(expected)
    for r in report:
        assert expected[r["path"]] in r["reason"], r
    ds = LatentDataset(out)
    assert len(ds) == 9 and ds.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert json.loads((out / INDEX_NAME).read_text())["dataset"]["num_bad_files"] == 5


def test_strict_stops_at_the_first_bad_file(tmp_path, image_folder, tiny_vae_dir):
    _add_bad_files(image_folder)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"dog/a-zero\.png.*--strict"):
        run_extract(_config(image_folder, out, tiny_vae_dir, strict=True))
    assert not (out / INDEX_NAME).exists() and not list(out.glob(".tmp-*"))


def test_check_counts_and_finds_bad_files(tmp_path, image_folder, capsys):
    from extract.__main__ import main

    _add_bad_files(image_folder)
    assert main(["--data-path", str(image_folder), "--check", "--num-workers", "0", "--image-size", "16"]) == 1
    text = capsys.readouterr().out
    assert "3 classes, 14 images" in text and "dog  8 images" in text
    assert "first image: cat/000.png (20x24, mode RGB)" in text
    assert "bad files: 5" in text and "dog/d-bomb.png: decompression bomb" in text


# ----------------------------------------------------------------------------------------------------------
# What is stored, and resume
# ----------------------------------------------------------------------------------------------------------

def test_stored_moments_equal_direct_encoding(tmp_path, image_folder, tiny_vae_dir):
    from shared.tokenizers.locate import load_tokenizer

    out = tmp_path / "out"
    run_extract(_config(image_folder, out, tiny_vae_dir, dtype="fp32"))
    ds, vae = LatentDataset(out), load_tokenizer(tiny_vae_dir)
    assert ds.flips == 2 and ds.latent_shape == (4, 8, 8) and ds.scaling_factor == vae.scaling_factor
    assert ds.vae == vae.identity and ds.class_names == ["cat", "dog", "eel"]
    scan = scan_image_folder(image_folder)
    for i in (0, 4, 8):
        x = preprocess(image_folder / scan.files[i], 16)[None]  # (1, 3, 16, 16)
        mean, std = vae.encode_moments(torch.cat([x, x.flip(3)]))  # (2, 4, 8, 8): original, mirror
        item = ds[i]
        torch.testing.assert_close(item["mean"], mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(item["std"], std, atol=1e-5, rtol=1e-5)
        assert item["label"] == scan.labels[i]


def test_out_of_memory_halves_the_encoder_batch(tiny_vae_dir):
    from extract.run import Progress, encode_pixels
    from shared.tokenizers.locate import load_tokenizer

    vae = load_tokenizer(tiny_vae_dir)
    pixels = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    expected = encode_pixels(vae, pixels, True, Progress())

    class SmallGPU:
        """The same VAE, but any call with more than 2 images runs out of memory."""
        device, calls = vae.device, []

        def encode_moments(self, x):
            self.calls.append(len(x))
            if len(x) > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return vae.encode_moments(x)

    progress, small = Progress(), SmallGPU()
    mean, std = encode_pixels(small, pixels, True, progress)
    assert progress.chunk == 1 and small.calls[:2] == [6, 3]  # 2B=6 fails, 3 fails, then 1 at a time
    assert mean.shape == (3, 2, 4, 8, 8)
    torch.testing.assert_close(mean, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(std, expected[1], atol=1e-5, rtol=1e-5)


def test_flip_none_and_fp16_storage(tmp_path, image_folder, tiny_vae_dir):
    out = tmp_path / "out"
    run_extract(_config(image_folder, out, tiny_vae_dir, flip="none", limit=4))
    ds = LatentDataset(out)
    assert len(ds) == 4 and ds.flips == 1 and ds.dtype == torch.float16
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["flips"] == FLIP_MODES["none"] and "flip" not in index  # one record of the flip mode: F
    (out / INDEX_NAME).write_text(json.dumps({**index, "flip": "none"}))  # as the previous version wrote it
    assert LatentDataset(out).flips == 1


def test_unknown_flip_or_dtype_is_a_choice_error_with_flag_advice(tmp_path, image_folder, tiny_vae_dir):
    from extract.__main__ import FLAGS
    from extract.config import check_choices

    for change, setting, flag in (({"flip": "mirror"}, "flip mode", "--flip"), ({"dtype": "int8"}, "storage dtype",
                                                                                  "--dtype")):
        with pytest.raises(ChoiceError) as caught:
            check_choices(_config(image_folder, tmp_path / "out", tiny_vae_dir, **change))
        assert caught.value.setting == setting and FLAGS[setting] == flag
        assert str(advise(caught.value, FLAGS)).startswith(f"{flag} ")


def test_rerun_skips_finished_shards_and_redoes_partial_ones(tmp_path, image_folder, tiny_vae_dir):
    out, ref = tmp_path / "out", tmp_path / "ref"
    run_extract(_config(image_folder, ref, tiny_vae_dir))
    run_extract(_config(image_folder, out, tiny_vae_dir))
    assert _folder_bytes(out) == _folder_bytes(ref)
    sidecar_path(out, 1).unlink()                                  # shard 1: tar written, sidecar missing
    tmp_name(out / shard_name(2)).write_bytes(b"half a shard")  # shard 2: a leftover temp file
    (out / ".tmp-shard-000002.tar").write_bytes(b"half a shard")  # ... and one named as older versions did
    sidecar_path(out, 2).unlink()
    (out / INDEX_NAME).unlink()
    before = (out / "shard-000000.tar").stat().st_mtime_ns
    time.sleep(0.01)
    summary = run_extract(_config(image_folder, out, tiny_vae_dir))
    assert summary["shards_here"] == 2 and summary["encoded_here"] == 5  # shards 1 (4 images) and 2 (1)
    assert (out / "shard-000000.tar").stat().st_mtime_ns == before
    assert not list(out.glob(".tmp-*"))
    assert _folder_bytes(out) == _folder_bytes(ref)
    again = run_extract(_config(image_folder, out, tiny_vae_dir))  # all finished: nothing to encode
    assert again["shards_here"] == 0 and _folder_bytes(out) == _folder_bytes(ref)


# ----------------------------------------------------------------------------------------------------------
# Real processes: SIGKILL + rerun, and two processes under accelerate launch
# ----------------------------------------------------------------------------------------------------------

def _cli(data, out, vae, *extra) -> list:
    """The extract command line used by the subprocess tests."""
    return ["-m", "extract", "--data-path", str(data), "--out", str(out), "--vae", str(vae), "--image-size",
            "16", "--shard-size", "4", "--batch-size", "2", "--num-workers", "0", *extra]


def _wait_for(conditions, proc, timeout=180.0) -> None:
    """Poll until every condition holds (a path exists, a callable returns true); fail if the process ends first
    or the time runs out."""
    deadline = time.monotonic() + timeout
    while not all(c() if callable(c) else c.exists() for c in conditions):
        assert proc.poll() is None, f"extract exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the first shard"
        time.sleep(0.05)


# Same thread count in every run: CPU kernels may sum in another order with another count.
_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_vae_dir):
    """(data, out) of one plain `python -m extract` run over 12 images (shards of 4: 0-3, 4-7, 8-11)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    data, ref = make_image_folder(root / "data", per_class=4), root / "ref"
    subprocess.run([sys.executable, *_cli(data, ref, tiny_vae_dir)], cwd=ROOT, env=_ENV, check=True,
                   capture_output=True, timeout=300)
    return data, ref


@pytest.mark.slow
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path, tiny_vae_dir, uninterrupted):
    data, ref = uninterrupted
    out = tmp_path / "out"
    # Position 6 (dog/002.png, second batch of shard 1) becomes a FIFO: opening it blocks, so the process
    # is reliably mid-shard when it is killed, with shard 0 finished and shard 1's temp tar half written.
    blocker, saved = data / "dog" / "002.png", (data / "dog" / "002.png").read_bytes()
    blocker.unlink()
    os.mkfifo(blocker)
    try:
        _kill_mid_shard(data, out, tiny_vae_dir)
    finally:
        blocker.unlink()
        blocker.write_bytes(saved)  # the module's other tests share this folder
    result = subprocess.run([sys.executable, *_cli(data, out, tiny_vae_dir)], cwd=ROOT, env=_ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "this run encoded 8 images" in result.stdout  # shards 1 and 2 only
    assert not list(out.glob(".tmp-*"))
    assert _folder_bytes(out) == _folder_bytes(ref)


@pytest.mark.slow
def test_ctrl_c_mid_shard_leaves_no_temp_file_and_resumes(tmp_path, tiny_vae_dir, uninterrupted):
    """Issue 38: SIGINT where SIGKILL leaves shard 1's temp tar: the one line, exit 130, the temp tar removed."""
    from shared.runtime.interrupt import EXIT_STATUS, MESSAGE

    data, ref = uninterrupted
    out = tmp_path / "out"
    blocker, saved = data / "dog" / "002.png", (data / "dog" / "002.png").read_bytes()
    blocker.unlink()
    os.mkfifo(blocker)  # as above: opening it blocks, mid-shard
    try:
        proc = subprocess.Popen([sys.executable, *_cli(data, out, tiny_vae_dir)], cwd=ROOT, env=_ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for([sidecar_path(out, 0), lambda: stale_tmps(out / shard_name(1))], proc)
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
    finally:
        blocker.unlink()
        blocker.write_bytes(saved)
    assert proc.returncode == EXIT_STATUS, err
    assert "Traceback" not in err and err.rstrip().splitlines()[-1] == f"python -m extract: {MESSAGE}"
    assert not list(out.glob(".tmp-*")) and not (out / INDEX_NAME).exists()
    result = subprocess.run([sys.executable, *_cli(data, out, tiny_vae_dir)], cwd=ROOT, env=_ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "this run encoded 8 images" in result.stdout  # shard 0 was kept
    assert _folder_bytes(out) == _folder_bytes(ref)


def _kill_mid_shard(data, out, vae) -> None:
    """Start extract and SIGKILL it once shard 0 is finished and shard 1 is half written."""
    proc = subprocess.Popen([sys.executable, *_cli(data, out, vae)], cwd=ROOT, env=_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for([sidecar_path(out, 0), lambda: stale_tmps(out / shard_name(1))], proc)  # shard 1 half written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert not (out / INDEX_NAME).exists() and not (out / "shard-000001.tar").exists()


def _free_port() -> int:
    """A TCP port nobody listens on right now (for the process group rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_write_disjoint_shards_under_one_index(tmp_path, tiny_vae_dir, uninterrupted):
    data, ref = uninterrupted
    out = tmp_path / "out"
    # torchrun (what `accelerate launch --multi_gpu` runs underneath) with a CPU/gloo process group.
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
              "127.0.0.1", "--master_port", str(_free_port())]
    result = subprocess.run([*launch, *_cli(data, out, tiny_vae_dir)], cwd=ROOT, env=_ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process 0 of 2" in result.stdout and result.stdout.count("index written") == 1
    writers = [json.loads(sidecar_path(out, j).read_text())["written_by"] for j in range(3)]
    assert writers == [{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}, {"rank": 0, "world_size": 2}]
    assert _folder_bytes(out) == _folder_bytes(ref)
    assert len(LatentDataset(out, verify=True)) == 12
