"""One discovery of image files for extract and `python -m evaluate reference` (issue 38.1, 38.9): symlinked class
folders followed, copies under the same --duplicates rule, loops refused in one paragraph, nested folders folded
into their class and said so."""
import shutil

import numpy as np
import pytest

from evaluate.__main__ import main as evaluate_main
from evaluate.images import image_files
from extract.__main__ import main as extract_main
from shared.datasets.duplicates import DUPLICATE_POLICIES, apply_duplicates
from shared.datasets.imagefolder import scan_image_folder
from tests.conftest import make_image_folder
from tests.helpers import run_main


def _linked(tmp_path):
    """data/cat and data/dog are symlinks to class folders kept elsewhere; the dog folder holds a symlinked copy
    of a cat picture and the cat folder a byte-identical copy of one of its own."""
    store = make_image_folder(tmp_path / "store", classes=("cat", "dog", "eel"), per_class=3)
    (store / "dog" / "003.png").symlink_to(store / "cat" / "000.png")   # one picture under two labels
    shutil.copyfile(store / "cat" / "001.png", store / "cat" / "010.png")  # identical bytes, one label
    data = tmp_path / "data"  # a subset of the classes: a folder of symlinks to the chosen class folders
    data.mkdir()
    for name in ("cat", "dog"):
        (data / name).symlink_to(store / name)
    return data


@pytest.mark.parametrize("policy", list(DUPLICATE_POLICIES))
def test_extract_and_evaluate_list_the_same_files(tmp_path, policy):
    data = _linked(tmp_path)
    extract_files = apply_duplicates(scan_image_folder(data), policy).files
    evaluate_files = [p.relative_to(data).as_posix() for p in image_files(data, policy)]
    expected = {"first": ["cat/000.png", "cat/001.png", "cat/002.png", "dog/000.png", "dog/001.png", "dog/002.png"],
                "all": ["cat/000.png", "cat/001.png", "cat/002.png", "cat/010.png", "dog/000.png", "dog/001.png",
                        "dog/002.png", "dog/003.png"],
                "none": ["cat/001.png", "cat/002.png", "dog/000.png", "dog/001.png", "dog/002.png"]}[policy]
    assert extract_files == expected
    assert evaluate_files == extract_files


def test_reference_command_reads_a_folder_of_symlinked_classes_as_extract(tmp_path, capsys):
    data, out = _linked(tmp_path), tmp_path / "ref.npz"
    code, text, err = run_main(extract_main, ["--data-path", data, "--check", "--num-workers", 0], capsys)
    assert code == 0 and "2 classes, 6 images" in text, err
    code, text, err = run_main(evaluate_main, ["reference", data, "--image-size", 16, "--out", out], capsys)
    assert code == 0, err
    assert "6 images, 16x16" in text and "2 copies of pictures found under other paths" in text
    assert np.load(out)["arr_0"].shape == (6, 16, 16, 3)


@pytest.mark.parametrize("link", ["..", "."])
def test_a_symlink_loop_is_refused_in_one_paragraph(tmp_path, capsys, link):
    data = make_image_folder(tmp_path / "data", classes=("a", "b"), per_class=2)
    (data / "a" / "deeper").mkdir()
    (data / "a" / "deeper" / "loop").symlink_to(link)  # back to a folder that contains the link
    for main, argv in ((extract_main, ["--data-path", data, "--check", "--num-workers", 0]),
                       (evaluate_main, ["reference", data, "--image-size", 16, "--out", tmp_path / "r.npz"])):
        code, _, err = run_main(main, argv, capsys)
        assert code == 2 and err.count("error:") == 1 and "Traceback" not in err
        assert f"{data / 'a' / 'deeper' / 'loop'} is a symlink to {link}, a folder that contains the link" in err
    assert not (tmp_path / "r.npz").exists()


def test_nested_folders_are_folded_into_their_class_and_check_says_so(tmp_path, capsys):
    data = make_image_folder(tmp_path / "data", classes=("cat", "dog"), per_class=2)
    make_image_folder(data / "cat", classes=("indoor", "outdoor"), per_class=1)
    scan = scan_image_folder(data)
    assert scan.classes == ["cat", "dog"] and scan.counts() == [4, 2]
    code, text, err = run_main(extract_main, ["--data-path", data, "--check", "--num-workers", 0], capsys)
    assert code == 0, err
    assert ("nested folders: 2 sub-folders below the class folders hold images, folded into their top-level class "
            "(first: cat/indoor -> class cat)") in text
    make_image_folder(tmp_path / "flat", classes=("cat",), per_class=2)
    code, text, _ = run_main(extract_main, ["--data-path", tmp_path / "flat", "--check", "--num-workers", 0], capsys)
    assert code == 0 and "nested folders" not in text
