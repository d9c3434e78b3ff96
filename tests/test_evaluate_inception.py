"""The pure-torch FID Inception: TF-style resize, padding-excluding average pool, max-pool branch, ADM's outputs,
weights lookup and refusal, and `python -m evaluate` end to end on a random-weight network in the real layout."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluate import inception
from evaluate.__main__ import main
from evaluate.inception import FIDInceptionV3, InceptionE, tf1_resize_bilinear, tf_avg_pool
from evaluate.metrics import load_stats
from shared.runtime.errors import UserError
from tests.helpers import run_main


def random_inception_state(seed: int = 0) -> dict:
    """A random FID Inception state dict: He-normal convs (activations keep their scale), identity batch norms."""
    torch.manual_seed(seed)
    net = FIDInceptionV3()
    for module in net.modules():
        if isinstance(module, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    return net.state_dict()


@pytest.fixture(scope="module")
def random_weights_file(tmp_path_factory):
    """The random state dict saved as pytorch-fid's file is (torch.save of a plain state dict)."""
    path = tmp_path_factory.mktemp("weights") / inception.WEIGHTS_NAME
    torch.save(random_inception_state(), path)
    return path


@pytest.fixture
def weights_file(random_weights_file, monkeypatch):
    """The random weights file with its hash taken as the released one's, so the real loading code accepts it."""
    monkeypatch.setattr(inception, "WEIGHTS_SHA256_PREFIX", inception.file_sha256(random_weights_file)[:8])
    return random_weights_file


# ----------------------------------------------------------------------------------------------------------
# The graph's details, against their definitions
# ----------------------------------------------------------------------------------------------------------

def tf1_resize_by_definition(image: np.ndarray, size: int) -> np.ndarray:
    """TF1 ResizeBilinear (align_corners=False, half_pixel_centers=False) for one (H, W) image, pixel by pixel."""
    h, w = image.shape
    out = np.zeros((size, size))
    for i in range(size):
        for j in range(size):
            y, x = i * h / size, j * w / size  # source = destination * scale, no half-pixel offset
            y0, x0 = int(math.floor(y)), int(math.floor(x))
            y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
            dy, dx = y - y0, x - x0
            top = image[y0, x0] + (image[y0, x1] - image[y0, x0]) * dx
            bottom = image[y1, x0] + (image[y1, x1] - image[y1, x0]) * dx
            out[i, j] = top + (bottom - top) * dy
    return out


def test_tf1_resize_follows_its_definition_not_half_pixel_centres():
    ramp = torch.tensor([[0.0, 10.0]]).expand(2, 2)[None, None]  # (1, 1, 2, 2): columns 0 and 10
    # Sources 0, 0.5, 1, 1.5 (clamped): 0, 5, 10, 10. Half-pixel centres (torch's default) would give 0, 2.5, 7.5, 10.
    assert tf1_resize_bilinear(ramp, 4)[0, 0, 0].tolist() == [0.0, 5.0, 10.0, 10.0]
    rng = np.random.default_rng(0)
    image = rng.uniform(0, 255, (5, 7))
    got = tf1_resize_bilinear(torch.from_numpy(image).float()[None, None], 11)[0, 0].double().numpy()
    np.testing.assert_allclose(got, tf1_resize_by_definition(image, 11), rtol=1e-5, atol=1e-3)


def test_preprocess_maps_pixels_like_the_graph():
    images = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 1, 3, 1).expand(1, 1, 3, 3).contiguous()
    x = inception.preprocess(images.view(1, 1, 3, 3).permute(0, 2, 3, 1).expand(1, 3, 3, 3).contiguous(), 3)
    assert x.shape == (1, 3, 3, 3)
    assert sorted(set(x.flatten().tolist())) == pytest.approx([-1.0, 0.0, 127 / 128])  # (x - 128) / 128


def test_average_pool_excludes_the_padding_from_border_averages():
    x = torch.arange(16.0).view(1, 1, 4, 4)
    pooled = tf_avg_pool(x)
    assert pooled[0, 0, 0, 0] == pytest.approx((0 + 1 + 4 + 5) / 4)  # 4 real neighbours, not / 9
    assert pooled[0, 0, 0, 1] == pytest.approx((0 + 1 + 2 + 4 + 5 + 6) / 6)
    assert pooled[0, 0, 1, 1] == pytest.approx(x[0, 0, :3, :3].mean())
    assert tf_avg_pool(torch.ones(1, 1, 5, 5)).eq(1).all()  # zero padding never dilutes a constant


def test_the_last_block_pools_with_max_and_the_one_before_with_the_tf_average():
    net = FIDInceptionV3()
    assert net.Mixed_7c.max_pool and not net.Mixed_7b.max_pool
    torch.manual_seed(0)
    block = InceptionE(4, max_pool=True).eval()
    x = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        out = block(x)
        pooled_branch = out[:, -192:]  # the pool branch is the last 192 channels
        assert torch.allclose(pooled_branch, block.branch_pool(F.max_pool2d(x, 3, 1, 1)))
        block.max_pool = False
        assert torch.allclose(block(x)[:, -192:], block.branch_pool(tf_avg_pool(x)))


def test_outputs_are_adm_s_pool_spatial_and_bias_free_logits(weights_file):
    net = inception.load_inception(weights_file)
    seen = {}
    net.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: seen.setdefault("mixed_6/conv", o))
    with torch.no_grad():
        net.fc.bias.fill_(100.0)  # ADM multiplies by the softmax weight only: the bias must not matter
        images = torch.randint(0, 256, (2, 40, 40, 3), dtype=torch.uint8)
        out = net(inception.preprocess(images))
    assert out["pool"].shape == (2, 2048) and out["logits"].shape == (2, 1008)
    conv = seen["mixed_6/conv"]
    assert conv.shape == (2, 192, 17, 17)
    expected = conv[:, :7].permute(0, 2, 3, 1).reshape(2, -1)  # NHWC order, 17 * 17 * 7 = 2023
    assert out["spatial"].shape == (2, 2023) and torch.equal(out["spatial"], expected)
    assert torch.allclose(out["logits"], out["pool"] @ net.fc.weight.T)
    assert out["pool"].abs().mean() > 1e-3  # the random network keeps a usable scale


# ----------------------------------------------------------------------------------------------------------
# Weights: the file, the hub cache, offline, another network
# ----------------------------------------------------------------------------------------------------------

def test_weights_are_found_in_the_torch_hub_cache(weights_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = inception.hub_checkpoints() / inception.WEIGHTS_NAME
    cached.parent.mkdir(parents=True)
    cached.symlink_to(weights_file)
    assert inception.resolve_weights() == cached


def test_offline_without_weights_is_one_paragraph_naming_file_url_and_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(inception, "WEIGHTS_URL", (tmp_path / "offline" / inception.WEIGHTS_NAME).as_uri())
    with pytest.raises(UserError) as info:
        inception.resolve_weights()
    text = str(info.value)
    assert inception.WEIGHTS_NAME in text and "--inception-weights" in text
    assert str(inception.hub_checkpoints() / inception.WEIGHTS_NAME) in text and "offline" in text
    assert not list(inception.hub_checkpoints().glob("*"))  # no partial file left in the cache


def test_a_download_with_the_wrong_hash_is_refused_and_not_kept(tmp_path, monkeypatch):
    page = tmp_path / "page.html"
    page.write_text("<html>a captive portal</html>")
    target = tmp_path / "cache" / inception.WEIGHTS_NAME
    with pytest.raises(UserError, match="not .*6726825d"):
        inception.download_weights(target, page.as_uri())
    assert not target.exists() and not list(target.parent.glob("*"))


def test_a_state_dict_of_another_network_is_refused(tmp_path):
    from evaluate.digits import DigitsNet

    other = tmp_path / "digits.pth"
    torch.save(DigitsNet().state_dict(), other)
    with pytest.raises(UserError, match="not the FID Inception state dict.*missing.*unexpected"):
        inception.load_inception(other)
    imagenet_like = tmp_path / "inception_v3_google.pth"
    state = FIDInceptionV3().state_dict()
    state["fc.weight"], state["fc.bias"] = torch.zeros(1000, 2048), torch.zeros(1000)
    state["AuxLogits.fc.weight"] = torch.zeros(1000, 768)
    torch.save(state, imagenet_like)
    with pytest.raises(UserError, match="torchvision's ImageNet inception_v3"):
        inception.load_inception(imagenet_like)


def test_a_local_file_whose_sha256_is_the_known_one_is_accepted(random_weights_file, monkeypatch):
    digest = inception.file_sha256(random_weights_file)
    monkeypatch.setattr(inception, "WEIGHTS_SHA256_PREFIX", digest[:8])
    features = inception.InceptionFeatures(weights=random_weights_file, input_size=75)
    assert features.identity()["weights_sha256"] == digest[:16]
    out = features(np.zeros((1, 8, 8, 3), np.uint8))
    assert out["pool"].shape == (1, 2048)


def test_a_file_of_the_right_layout_with_another_sha256_is_refused(random_weights_file, tmp_path, monkeypatch):
    # The released hash prefix, unpatched: the random weights have the layout but not the values.
    with pytest.raises(UserError) as info:
        inception.InceptionFeatures(weights=random_weights_file, input_size=75)
    text = str(info.value)
    assert f"sha256 {inception.file_sha256(random_weights_file)[:16]}..., not 6726825d..." in text
    assert "--inception-weights" in text and inception.WEIGHTS_URL in text
    # A copy put by hand in the torch hub cache is held to the same hash.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = inception.hub_checkpoints() / inception.WEIGHTS_NAME
    cached.parent.mkdir(parents=True)
    cached.symlink_to(random_weights_file)
    with pytest.raises(UserError, match="not 6726825d"):
        inception.load_inception()


def test_the_cli_refuses_weights_with_another_sha256_in_one_paragraph(random_weights_file, tmp_path, capsys):
    samples = write_images(tmp_path / "samples.npz", 4, seed=1)
    ref = write_images(tmp_path / "ref.npz", 4, seed=2)
    code, out, err = run_main(main, [samples, "--ref", ref, "--inception-weights", random_weights_file], capsys)
    assert code == 2 and "Traceback" not in err
    assert "not 6726825d" in err and "--inception-weights FILE" in err
    assert not (tmp_path / "samples.eval.jsonl").exists()


# ----------------------------------------------------------------------------------------------------------
# The CLI end to end, and its clear errors
# ----------------------------------------------------------------------------------------------------------

def write_images(path, n, size=32, seed=0, dtype=np.uint8, key="arr_0"):
    """An npz of n random images under `key`."""
    rng = np.random.default_rng(seed)
    np.savez(path, **{key: rng.integers(0, 256, (n, size, size, 3)).astype(dtype)}, labels=np.arange(n) % 10)
    return path


def test_cli_end_to_end_on_a_random_weight_network(weights_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    samples = write_images(tmp_path / "samples.npz", 5, seed=1)
    ref = write_images(tmp_path / "ref.npz", 6, seed=2)
    code, out, err = run_main(main, [samples, "--ref", ref, "--inception-weights", weights_file, "--is-split-size", 2,
                              "--batch-size", 4, "--save-stats", tmp_path / "samples-stats.npz"], capsys)
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert all(math.isfinite(record[k]) for k in ("fid", "sfid", "inception_score", "precision", "recall"))
    assert record["fid"] > 0 and record["inception_score"] >= 1 and record["num_samples"] == 5
    assert record["features"]["name"] == "inception" and record["features"]["weights_sha256"]
    assert json.loads((tmp_path / "samples.eval.jsonl").read_text()) == record
    stats = load_stats(tmp_path / "samples-stats.npz")
    assert stats.mu.shape == (2048,) and stats.mu_s.shape == (2023,) and stats.pool.shape == (5, 2048)
    assert list(tmp_path.joinpath("cache").rglob("*.npz"))  # the reference's statistics were cached
    # The samples against their own statistics file: FID and sFID 0, precision and recall 1.
    code, out, err = run_main(main, [samples, "--ref", tmp_path / "samples-stats.npz", "--inception-weights", weights_file,
                              "--is-split-size", 2, "--no-save"], capsys)
    again = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and again["fid"] == pytest.approx(0, abs=1e-3) and again["sfid"] == pytest.approx(0, abs=1e-3)
    assert again["precision"] == 1.0 and again["recall"] == 1.0
    assert again["inception_score"] == pytest.approx(record["inception_score"])
    assert len((tmp_path / "samples.eval.jsonl").read_text().splitlines()) == 1  # --no-save appended nothing


def test_fewer_samples_than_one_is_split_compute_everything_and_mark_is(weights_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    samples = write_images(tmp_path / "samples.npz", 5, seed=1)
    ref = write_images(tmp_path / "ref.npz", 6, seed=2)
    code, out, err = run_main(main, [samples, "--ref", ref, "--inception-weights", weights_file, "--no-save"], capsys)
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert all(math.isfinite(record[k]) for k in ("fid", "sfid", "inception_score", "precision", "recall"))
    assert record["is_comparable"] is False and record["is_split_size"] == 5000
    table = out.strip().splitlines()[:-1]
    assert any(line.startswith("inception_score") and "not comparable: 5 samples, fewer than one split of 5000"
               in line for line in table), table
    # One short split is the whole set: the same IS as a split of exactly 5.
    code, out, _ = run_main(main, [samples, "--ref", ref, "--inception-weights", weights_file, "--no-save",
                            "--is-split-size", 5], capsys)
    assert json.loads(out.strip().splitlines()[-1])["inception_score"] == pytest.approx(record["inception_score"])


@pytest.mark.parametrize("case, needle", [
    ("no_arr_0", "holds no `arr_0` array (it has: images"),
    ("float", "`arr_0` is float32"),
    ("gray", "with shape (4, 32, 32)"),
    ("split_zero", "the Inception Score split size must be at least 1; got 0"),
    ("other_resolution", "describes 64x64 images but the samples are 32x32"),
    ("other_network", "is not the FID Inception state dict"),
])
def test_cli_mistakes_are_one_paragraph_and_leave_nothing(case, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    samples = tmp_path / "samples.npz"
    ref = write_images(tmp_path / "ref.npz", 4)
    extra = ["--is-split-size", 2]
    if case == "no_arr_0":
        write_images(samples, 4, key="images")
    elif case == "float":
        write_images(samples, 4, dtype=np.float32)
    elif case == "gray":
        np.savez(samples, arr_0=np.zeros((4, 32, 32), np.uint8))
    elif case == "split_zero":
        write_images(samples, 4)
        extra = ["--is-split-size", 0]
    elif case == "other_resolution":
        write_images(samples, 4)
        ref = write_images(tmp_path / "ref64.npz", 4, size=64)
    elif case == "other_network":
        write_images(samples, 4)
        torch.save({"conv.weight": torch.zeros(3, 3)}, tmp_path / "other.pth")
        extra += ["--inception-weights", tmp_path / "other.pth"]
    code, out, err = run_main(main, [samples, "--ref", ref, *extra], capsys)
    assert code == 2 and "Traceback" not in err
    assert needle in " ".join(err.split())
    assert not (tmp_path / "samples.eval.jsonl").exists()
    assert not (tmp_path / "torch").exists()  # refused before any weights were looked for or downloaded


def test_an_adm_reference_batch_uses_its_statistics_and_its_images(weights_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    samples = write_images(tmp_path / "samples.npz", 5, seed=3)
    ref = write_images(tmp_path / "ref.npz", 6, seed=4)
    common = ["--inception-weights", weights_file, "--is-split-size", 5, "--no-save"]
    code, out, err = run_main(main, [ref, "--ref", samples, "--save-stats", tmp_path / "ref-stats.npz", *common], capsys)
    assert code == 0, err
    direct = json.loads(run_main(main, [samples, "--ref", ref, *common], capsys)[1].strip().splitlines()[-1])
    # The ADM layout: the images as arr_0 beside precomputed statistics, and nothing else (no meta, no pool).
    stats = load_stats(tmp_path / "ref-stats.npz")
    with np.load(ref) as npz:
        images = npz["arr_0"]
    adm = tmp_path / "VIRTUAL_tiny.npz"
    np.savez(adm, arr_0=images, mu=stats.mu, sigma=stats.sigma, mu_s=stats.mu_s, sigma_s=stats.sigma_s)
    via_adm = json.loads(run_main(main, [samples, "--ref", adm, *common], capsys)[1].strip().splitlines()[-1])
    for key in ("fid", "sfid", "inception_score", "precision", "recall"):
        assert via_adm[key] == pytest.approx(direct[key], rel=1e-5, abs=1e-6), key
    assert via_adm["ref_count"] == 6
    np.savez(adm, mu=stats.mu, sigma=stats.sigma, mu_s=stats.mu_s, sigma_s=stats.sigma_s)  # statistics only
    stats_only = json.loads(run_main(main, [samples, "--ref", adm, *common], capsys)[1].strip().splitlines()[-1])
    assert stats_only["fid"] == pytest.approx(direct["fid"], rel=1e-5)
    assert stats_only["precision"] is None and stats_only["recall"] is None  # PR needs the reference's images
