"""The digits demo: dataset builder, judge, the committed VAE, and `python -m data.demo --quick` end to end."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shared.datasets.digits import NUM_CLASSES, build_digits, digit_images, load_digit_arrays
from data.judge import class_match, fit_judge
from data.make_vae import DEFAULT_OUT as VAE_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits():
    """All digits as 32x32 RGB uint8 and their labels."""
    return digit_images()


def test_build_digits_is_an_imagefolder_with_digit_labels(tmp_path, digits):
    from shared.datasets.imagefolder import scan_image_folder

    out = build_digits(tmp_path / "digits", progress=False)
    _, raw_labels = load_digit_arrays()
    scan = scan_image_folder(out)
    # The extract stage's own scanner: folder index == digit, every image counted.
    assert scan.classes == [str(d) for d in range(NUM_CLASSES)]
    assert scan.counts() == np.bincount(raw_labels, minlength=NUM_CLASSES).tolist()
    assert sum(scan.counts()) == 1797
    assert all(label == int(Path(f).parent.name) for f, label in zip(scan.files, scan.labels))
    first = Path(out) / scan.files[0]
    with Image.open(first) as img:
        assert img.size == (32, 32) and img.mode == "RGB"
        pixels = np.asarray(img)
    index = int(first.stem)
    np.testing.assert_array_equal(pixels, digits[0][index])  # the PNG holds exactly the built image
    assert pixels.max() > 200 and pixels[0, 0].max() == 0  # white digit on a black border


def test_build_digits_is_deterministic_and_resumes(tmp_path):
    a = build_digits(tmp_path / "a", progress=False)
    b = tmp_path / "b"
    build_digits(b, progress=False)
    victim = b / "3" / sorted(os.listdir(b / "3"))[0]
    victim.unlink()  # an interrupted build: rerunning fills the gap
    build_digits(b, progress=False)
    for name in ("3", "7"):
        files = sorted(os.listdir(a / name))
        assert files == sorted(os.listdir(b / name))
        assert all((a / name / f).read_bytes() == (b / name / f).read_bytes() for f in files[:20])


def test_judge_recognises_held_out_digits_and_not_noise(digits):
    images, labels = digits
    order = np.random.default_rng(0).permutation(len(labels))
    train, held = order[:900], order[900:]
    judge = fit_judge(images[train], labels[train])
    assert class_match(images[held], labels[held], judge) > 0.9
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, size=(400, 32, 32, 3), dtype=np.uint8)
    asked = rng.integers(0, NUM_CLASSES, size=400)
    assert class_match(noise, asked, judge) < 0.25  # chance is 0.1
    assert class_match(images[held], (labels[held] + 1) % NUM_CLASSES, judge) < 0.1  # wrong labels fail


def test_judge_works_at_other_resolutions(digits):
    images, labels = digits
    small = images[:, ::2, ::2]  # 16x16: the judge box-averages any size to 8x8
    assert class_match(small[:300], labels[:300]) > 0.9


def test_committed_vae_loads_and_reconstructs_recognisable_digits(digits):
    from shared.datasets.shards import draw_latents
    from shared.tokenizers.locate import load_tokenizer

    images, labels = digits
    images, labels = images[:300], labels[:300]
    assert (VAE_DIR / "config.json").is_file()
    assert sum(f.stat().st_size for f in VAE_DIR.iterdir()) < 2 * 1024 * 1024
    vae = load_tokenizer(str(VAE_DIR))
    assert (vae.latent_channels, vae.downsample_factor) == (4, 4)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (N, 3, 32, 32) in [-1, 1]
    with torch.no_grad():
        mean, std = vae.encode_moments(x)  # (N, 4, 8, 8)
        assert mean.shape == (300, 4, 8, 8)
        z = draw_latents(mean, std, vae.norm, generator=torch.Generator().manual_seed(0))
        # The committed scaling factor gives the DiT latents of about unit spread.
        assert 0.8 < float(z.std()) < 1.25
        recon = vae.decode(vae.norm.apply(mean))  # (N, 3, 32, 32)
    pixels = ((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert class_match(pixels, labels) > 0.95
    assert float(torch.mean((recon.clamp(-1, 1) - x) ** 2)) < 0.05


def run_quick_demo(out: Path) -> subprocess.CompletedProcess:
    """`python -m data.demo --quick --out OUT` as users run it; fails the test on a non-zero exit."""
    proc = subprocess.run(
        [sys.executable, "-m", "data.demo", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_quick_demo_runs_every_stage_and_resumes(tmp_path):
    out = tmp_path / "demo"
    proc = run_quick_demo(out)
    grid = re.search(r"^grid: (.+\.png)$", proc.stdout, re.MULTILINE)
    assert grid and Path(grid.group(1)).is_file(), proc.stdout[-3000:]
    for line in ("preview grid", "curves"):  # the decoded training preview and the curves it points to
        picture = re.search(rf"^{line}: (.+\.png)$", proc.stdout, re.MULTILINE)
        assert picture and Path(picture.group(1)).is_file(), proc.stdout[-3000:]
    match = re.search(r"^class match: (\d+\.\d)% \((\d+) images, cfg ([\d.]+)\)$", proc.stdout, re.MULTILINE)
    assert match, proc.stdout[-3000:]
    # The printed verdict is the judge's reading of the images on disk (recomputed here from the npz).
    from data.judge import class_match

    with np.load(out / "samples-quick" / "samples.npz") as npz:
        expected, count = 100 * class_match(npz["arr_0"], npz["labels"]), len(npz["labels"])
    assert f"{expected:.1f}" == match.group(1) and int(match.group(2)) == count > 0
    # Every stage left its artefacts on disk.
    assert (out / "latents" / "index.json").is_file()
    assert list((out / "run-quick" / "exports").glob("ema-step-*.safetensors"))
    with np.load(out / "samples-quick" / "samples.npz") as npz:
        assert npz["arr_0"].shape == (int(match.group(2)), 32, 32, 3)
        assert npz["arr_0"].dtype == np.uint8
    # Rerunning the same command resumes every stage: nothing is redrawn, the verdict is unchanged.
    pngs = {p: p.read_bytes() for p in (out / "samples-quick").glob("*.png")}
    stamps = {p: p.stat().st_mtime_ns for p in pngs}
    again = run_quick_demo(out)
    assert "resumed from" in again.stdout
    assert match.group(0) in again.stdout
    assert {p: p.stat().st_mtime_ns for p in pngs if p.name != "grid.png"} == {
        p: t for p, t in stamps.items() if p.name != "grid.png"}
    assert all(p.read_bytes() == b for p, b in pngs.items())
