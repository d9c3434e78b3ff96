"""The digits yardstick: deterministic fit, cache, digits_fd, and `python -m evaluate --features digits`."""
import json
import os

import numpy as np
import pytest
import torch

from shared.datasets.digits import digit_images
from evaluate import digits
from evaluate.__main__ import main


pytestmark = pytest.mark.usefixtures("private_digits_cache")


@pytest.fixture(scope="module")
def real():
    """All real digits, uint8 (1797, 32, 32, 3), and labels."""
    return digit_images()


def test_fit_is_deterministic_whatever_the_thread_count(real):
    recipe = digits.DigitsRecipe(epochs=1)
    images, labels = real[0][:256], real[1][:256]
    before = torch.get_num_threads()
    first = digits.fit(recipe, images, labels).state_dict()
    torch.set_num_threads(2)
    try:
        second = digits.fit(recipe, images, labels).state_dict()
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    assert all(torch.equal(first[k], second[k]) for k in first)
    third = digits.fit(digits.DigitsRecipe(epochs=1, seed=1), images, labels).state_dict()
    assert not torch.equal(first["hidden.weight"], third["hidden.weight"])


def test_network_is_cached_by_recipe_hash_and_classifies_digits(real):
    net, key = digits.network()
    path = digits.weights_path(key)
    assert path.is_file() and key in path.name
    with torch.no_grad():
        accuracy = (net(digits.to_input(real[0])).argmax(1).numpy() == real[1]).mean()
    assert accuracy > 0.97
    digits._CACHE.clear()
    again, key2 = digits.network()  # loaded from the file, not refitted
    assert key2 == key and all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))
    assert digits.recipe_key(digits.DigitsRecipe(epochs=3), "x") != digits.recipe_key(digits.RECIPE, "x")


def test_digits_fd_orders_real_subsets_before_noise(real):
    images = real[0]
    assert digits.digits_fd(images) == pytest.approx(0.0, abs=1e-6)  # the reference itself
    rng = np.random.default_rng(0)
    subset = digits.digits_fd(images[rng.permutation(len(images))[:300]])
    blurred = images.astype(np.float32)
    blurred = ((blurred + np.roll(blurred, 1, 1) + np.roll(blurred, 1, 2) + np.roll(blurred, (1, 1), (1, 2))) / 4)
    blurred_fd = digits.digits_fd(blurred.astype(np.uint8)[:300])
    noise = digits.digits_fd(rng.integers(0, 256, (300, 32, 32, 3), dtype=np.uint8))
    assert 0 < subset < blurred_fd < noise


def test_digits_fd_refuses_other_sizes_and_dtypes(real):
    from shared.runtime.errors import UserError

    with pytest.raises(UserError, match="32x32"):
        digits.digits_fd(np.zeros((4, 64, 64, 3), np.uint8))
    with pytest.raises(UserError, match="uint8"):
        digits.digits_fd(real[0][:4].astype(np.float32))


def test_cli_features_digits_writes_the_result_beside_the_samples(real, tmp_path, capsys):
    samples = tmp_path / "samples.npz"
    np.savez(samples, arr_0=real[0][:120], labels=real[1][:120])
    main([str(samples), "--features", "digits"])
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    saved = [json.loads(line) for line in (tmp_path / "samples.eval.jsonl").read_text().splitlines()]
    assert saved == [record]
    assert record["features"]["name"] == "digits" and record["num_samples"] == 120 and record["ref_count"] == 1797
    assert record["fid"] == pytest.approx(digits.digits_fd(real[0][:120]))
    assert 0 < record["precision"] <= 1 and 0 < record["recall"] <= 1
    assert record["sfid"] is None and record["inception_score"] is None
    assert "fid" in out and "precision" in out


def test_cli_digits_refuses_other_resolutions_in_one_paragraph(tmp_path, capsys):
    samples = tmp_path / "big.npz"
    np.savez(samples, arr_0=np.zeros((4, 64, 64, 3), np.uint8))
    with pytest.raises(SystemExit) as exit_info:
        main([str(samples), "--features", "digits"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "32x32" in err and "Traceback" not in err
    assert not (tmp_path / "big.eval.jsonl").exists()


@pytest.mark.slow
def test_two_processes_split_the_images_and_agree_with_one(real, tmp_path):
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT

    digits.network()  # fitted into the private cache before the processes start
    samples = tmp_path / "samples.npz"
    np.savez(samples, arr_0=real[0][::7][:101])  # 101 images: ranks take 50 and 51
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port), "-m", "evaluate", str(samples), "--features", "digits",
                           "--cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "samples.eval.jsonl").read_text().splitlines()
    assert len(lines) == 1  # written once, by the main process
    record = json.loads(lines[0])
    assert record["num_samples"] == 101
    assert record["fid"] == pytest.approx(digits.digits_fd(real[0][::7][:101]), rel=1e-6)


def test_floor_prints_real_digit_distances_and_refuses_impossible_counts(real, capsys):
    from evaluate.floor import main as floor_main

    floor_main(["--counts", "50", "1000", "--draws", "2"])
    rows = {line.split(" digits FD ")[0].strip(): float(line.split(" digits FD ")[1].split()[0])
            for line in capsys.readouterr().out.splitlines()}
    assert set(rows) == {"50 real vs all 1797", "1000 real vs all 1797", "half vs half (898 / 899)"}
    assert rows["50 real vs all 1797"] > rows["1000 real vs all 1797"] > 0  # the small-sample bias
    with pytest.raises(SystemExit) as info:
        floor_main(["--counts", "5000"])
    assert info.value.code == 2 and "2..1797" in capsys.readouterr().err


def test_vae_round_trip_keeps_the_digits(real):
    from data.make_vae import DEFAULT_OUT
    from evaluate.floor import vae_round_trip

    images = real[0][:16]
    back = vae_round_trip(images, str(DEFAULT_OUT), batch_size=5)
    assert back.dtype == np.uint8 and back.shape == images.shape
    assert np.abs(back.astype(int) - images.astype(int)).mean() < 12  # of 255: a faithful reconstruction


def test_the_vae_floor_goes_through_the_normalisation_record_as_sampling_does(real, monkeypatch):
    """The floor's latents are normalised by the tokenizer's record and decoded through Tokenizer.decode, which
    inverts it: the path a trained model's samples take, not the raw posterior mean straight into the decoder."""
    from data.make_vae import DEFAULT_OUT
    from evaluate.floor import vae_round_trip
    from shared.tokenizers.tokenizer import LatentNorm
    from shared.tokenizers.locate import load_tokenizer

    used = []
    for name in ("apply", "invert"):
        original = getattr(LatentNorm, name)

        def spy(self, x, _original=original, _name=name):
            """The record's method, observed."""
            used.append((_name, self.kind, self.scale))
            return _original(self, x)

        monkeypatch.setattr(LatentNorm, name, spy)
    vae_round_trip(real[0][:4], str(DEFAULT_OUT), batch_size=4)
    scale = load_tokenizer(str(DEFAULT_OUT)).scaling_factor
    assert used == [("apply", "scale", scale), ("invert", "scale", scale)], used


def test_an_image_folder_reference_matches_the_same_images_as_npz_and_is_cached(real, tmp_path, capsys):
    from PIL import Image

    images = real[0][:60]
    folder = tmp_path / "ref"
    for i, pixels in enumerate(images):
        (folder / str(real[1][i])).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / str(real[1][i]) / f"{i:03d}.png")
    order = sorted(range(60), key=lambda i: f"{real[1][i]}/{i:03d}.png")  # the folder is read in path order
    np.savez(tmp_path / "ref.npz", arr_0=images[order])
    np.savez(tmp_path / "samples.npz", arr_0=real[0][100:140])
    results = []
    for ref in (folder, tmp_path / "ref.npz", folder):
        main([str(tmp_path / "samples.npz"), "--features", "digits", "--ref", str(ref), "--no-save"])
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["fid"] == pytest.approx(results[1]["fid"], rel=1e-9) and results[0]["ref_count"] == 60
    assert results[2] == {**results[0], "seconds": results[2]["seconds"]}
    assert len(list(digits.cache_dir().joinpath("stats").glob("*.npz"))) >= 2  # folder and npz statistics cached


def test_inception_statistics_are_refused_as_a_digits_reference(tmp_path, capsys):
    np.savez(tmp_path / "samples.npz", arr_0=np.zeros((4, 32, 32, 3), np.uint8))
    np.savez(tmp_path / "VIRTUAL.npz", mu=np.zeros(2048), sigma=np.eye(2048))  # an ADM batch: Inception statistics
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "samples.npz"), "--features", "digits", "--ref", str(tmp_path / "VIRTUAL.npz")])
    err = " ".join(capsys.readouterr().err.split())
    assert info.value.code == 2 and "statistics of the inception features" in err and "--features inception" in err
