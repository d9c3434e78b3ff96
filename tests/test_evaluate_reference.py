"""The reference of an evaluation (issue 29.10): checked before any sampling, a folder's size stated truly, and
`python -m evaluate reference` writing one from the user's own images at the training size."""
import numpy as np
import pytest
from PIL import Image

from evaluate.__main__ import main
from evaluate.images import open_npz_images
from evaluate.metrics import check_reference, open_reference
from shared.datasets.images import load_image
from shared.network.models import ModelConfig
from shared.runtime import rundir
from shared.weights.export import save_weights
from tests.conftest import make_image_folder
from tests.helpers import run_main, space_of


def _mixed(root):
    """Four drawings of three sizes; the first file (a/0.png) is 40x30, unlike most of the folder."""
    make_image_folder(root, classes=("b",), per_class=2, size=(48, 64))
    make_image_folder(root, classes=("c",), per_class=1, size=(50, 50))
    root.joinpath("a").mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(root / "a" / "0.png")
    return root


def _run_with_export(tmp_path, image_size=32):
    """RUN/exports/ema-step-100 of a DiT-T/2 whose metadata says image_size (never sampled by these tests)."""
    run = tmp_path / "run"
    config = ModelConfig("DiT-T/2", input_size=image_size // 8, in_channels=4, num_classes=10)
    save_weights(rundir.export_path(run, 100), config.build().state_dict(), config,
                 space_of({"image_size": image_size, "latent_shape": [4, image_size // 8, image_size // 8]}), 100)
    return run


def test_a_mixed_size_folder_is_described_by_all_its_sizes(tmp_path):
    root = _mixed(tmp_path / "drawings")
    with pytest.raises(Exception) as info:
        open_reference(str(root), "inception")
    text = str(info.value)
    assert "4 images of 3 different sizes (48x64: 2, 40x30: 1, 50x50: 1)" in text
    assert f"python -m evaluate reference {root} --image-size S" in text


@pytest.mark.parametrize("ref", ["missing", "mixed", "small"])
def test_run_checks_the_reference_before_any_sampling(tmp_path, capsys, ref):
    run = _run_with_export(tmp_path)
    paths = {"missing": None, "mixed": _mixed(tmp_path / "drawings"), "small": tmp_path / "small.npz"}
    np.savez(tmp_path / "small.npz", arr_0=np.zeros((4, 16, 16, 3), np.uint8))
    flags = ["--num-samples", 4, "--cpu", *(["--ref", paths[ref]] if paths[ref] else [])]
    code, _, err = run_main(main, ["run", run, *flags], capsys)
    assert code == 2 and err.count("error:") == 1
    expected = {"missing": "--ref is required with the Inception features", "mixed": "3 different sizes",
                "small": "describes 16x16 images but the samples are 32x32"}[ref]
    assert expected in err
    assert not (run / rundir.EVAL_SAMPLES).exists() and not rundir.eval_path(run).exists()  # nothing sampled


def test_reference_command_crops_as_extract_and_is_a_valid_ref(tmp_path, capsys):
    root = _mixed(tmp_path / "drawings")
    (root / "b" / "broken.png").write_bytes(b"not a picture")
    out = tmp_path / "ref-32.npz"
    code, stdout, err = run_main(main, ["reference", root, "--image-size", 32, "--out", out], capsys)
    assert code == 0, err
    assert "4 images, 32x32" in stdout and "1 unreadable file(s) skipped" in stdout and "broken.png" in stdout
    images = open_npz_images(out)
    assert images.shape == (4, 32, 32, 3)
    arr = np.load(out)["arr_0"]
    files = [root / "a" / "0.png", root / "b" / "000.png", root / "b" / "001.png", root / "c" / "000.png"]
    for row, path in zip(arr, files):  # sorted by path, each exactly extract's crop
        assert np.array_equal(row, load_image(path, 32).transpose(1, 2, 0))
    reference = open_reference(str(out), "inception")
    check_reference(reference, "inception", (32, 32))  # the run's samples at 32 px accept it
    assert not list(tmp_path.glob(".tmp-*"))


def test_reference_command_refusals(tmp_path, capsys):
    root = make_image_folder(tmp_path / "imgs", classes=("a",), per_class=2)
    for argv, expected in [
        (["reference", tmp_path / "nope", "--image-size", 32, "--out", tmp_path / "r.npz"], "is not a folder"),
        (["reference", root, "--image-size", 32, "--out", root / "r.npz"], "is inside"),
        (["reference", root, "--image-size", 32, "--out", tmp_path / "r.png"], "must end in .npz"),
        (["reference", root, "--image-size", 0, "--out", tmp_path / "r.npz"], "positive number of pixels"),
    ]:
        code, _, err = run_main(main, argv, capsys)
        assert code == 2 and expected in err, err
    assert not (tmp_path / "r.npz").exists()


def test_a_folder_reference_cache_follows_the_images_inside_it(tmp_path):
    from evaluate.metrics import stats_cache_path

    root = make_image_folder(tmp_path / "real", classes=("a",), per_class=2)
    before = stats_cache_path(root, {"name": "inception"})
    Image.new("RGB", (20, 24), (1, 2, 3)).save(root / "a" / "001.png")  # replaced inside a sub-folder
    assert stats_cache_path(root, {"name": "inception"}) != before  # the folder's own stat did not change
