"""Known answers for the metrics (Fréchet distance, IS, k-NN precision/recall) and the statistics files."""
import json

import numpy as np
import pytest
import scipy.linalg

from evaluate.metrics import Stats, _psd_sqrt, _sum_sqrt_eigvals, comparability_note, frechet_distance, \
    frechet_distance_of, frechet_distance_to, inception_score, is_comparable, is_stats_file, load_stats, manifold_radii, \
    mean_cov, precision_recall, save_stats, trace_sqrt_product
from shared.runtime.errors import UserError


def test_frechet_distance_of_diagonal_gaussians_is_the_closed_form():
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    v1, v2 = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 6)
    # For commuting (diagonal) covariances tr((S1 S2)^1/2) = sum sqrt(v1 v2): FD = |dmu|^2 + sum (sqrt v1 - sqrt v2)^2
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(v1) - np.sqrt(v2)) ** 2).sum()
    assert frechet_distance(mu1, np.diag(v1), mu2, np.diag(v2)) == pytest.approx(expected, rel=1e-10)


def test_frechet_distance_matches_scipy_sqrtm_on_full_covariances():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(300, 20)), rng.normal(size=(250, 20)) @ rng.normal(size=(20, 20)) + 0.5
    mu1, s1 = mean_cov(a)
    mu2, s2 = mean_cov(b)
    # The TTUR/ADM computation: scipy's sqrtm of the (non-symmetric) product.
    reference = ((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(scipy.linalg.sqrtm(s1 @ s2).real)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(reference, rel=1e-8)
    assert frechet_distance_of(a, b) == pytest.approx(reference, rel=1e-8)


def test_the_three_routes_to_the_trace_term_agree():
    rng = np.random.default_rng(6)
    full = mean_cov(rng.normal(size=(200, 12)) @ rng.normal(size=(12, 12)))[1]  # positive definite
    few = rng.normal(size=(7, 12)) * 2  # 7 points in 12 dims: a singular covariance
    mu_few, singular = mean_cov(few)
    root = _psd_sqrt(singular)
    by_eigh = _sum_sqrt_eigvals(root @ full @ root)
    by_scipy = np.trace(scipy.linalg.sqrtm(singular @ full).real)
    assert trace_sqrt_product(singular, full) == pytest.approx(by_eigh, rel=1e-7)  # Cholesky of the other one
    assert by_eigh == pytest.approx(by_scipy, rel=1e-6)  # sqrtm of a singular product is the least exact
    mu = np.zeros(12)
    assert frechet_distance_to(few, mu, full) == pytest.approx(frechet_distance(mu_few, singular, mu, full), rel=1e-7)


def test_identical_sets_give_zero_even_with_a_singular_covariance():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 30))  # 10 points in 30 dims: rank-9 covariance
    assert frechet_distance_of(x, x) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance_of(x, x + 1.0) == pytest.approx(30.0, abs=1e-5)  # a pure mean shift: |dmu|^2


def test_frechet_distance_refuses_statistics_of_other_sizes():
    with pytest.raises(UserError, match="different feature sizes"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(UserError, match="at least 2"):
        mean_cov(np.zeros((1, 3)))


def onehot_logits(classes, n_classes=1008, scale=50.0):
    """Logits whose softmax is (almost exactly) one-hot on the given class of each row."""
    logits = np.zeros((len(classes), n_classes))
    logits[np.arange(len(classes)), classes] = scale
    return logits


def test_inception_score_of_constructed_logits():
    # Confident and uniform over K classes: KL(p(y|x) || p(y)) = log K for every x, so IS = K.
    assert inception_score(onehot_logits(np.arange(100) % 10), split_size=100) == pytest.approx(10.0, rel=1e-6)
    # One class for all: p(y|x) = p(y), IS = 1.
    assert inception_score(onehot_logits(np.zeros(50, int)), split_size=50) == pytest.approx(1.0, abs=1e-9)
    # Uniform predictions carry no information either.
    assert inception_score(np.zeros((20, 1008)), split_size=20) == pytest.approx(1.0, abs=1e-12)
    # Splits are consecutive chunks, averaged: 4 classes in the first, 2 in the second -> (4 + 2) / 2.
    classes = np.concatenate([np.arange(40) % 4, np.arange(40) % 2])
    assert inception_score(onehot_logits(classes), split_size=40) == pytest.approx(3.0, rel=1e-6)


def test_fewer_samples_than_one_split_score_one_split_marked_not_comparable():
    logits = onehot_logits(np.arange(30) % 3)
    assert inception_score(logits) == pytest.approx(3.0, rel=1e-6) == inception_score(logits, split_size=30)
    assert not is_comparable(30) and not is_comparable(10000, split_size=1000) and is_comparable(5000)
    assert "30 samples, fewer than one split of 5000" in comparability_note(30, 5000)
    assert comparability_note(5000, 5000) == ""
    with pytest.raises(UserError, match="split size must be at least 1; got 0"):
        inception_score(logits, split_size=0)


def brute_force_pr(real, fake, k=3):
    """Precision and recall straight from the definition, all distances at once."""
    def radii(x):
        d = ((x[:, None] - x[None]) ** 2).sum(-1)
        return np.sort(d, axis=1)[:, k]

    d = ((fake[:, None] - real[None]) ** 2).sum(-1)  # (fake, real)
    precision = (d <= radii(real)[None]).any(1).mean()
    recall = (d.T <= radii(fake)[None]).any(1).mean()
    return precision, recall


def test_precision_recall_on_constructed_point_sets():
    line = np.stack([np.arange(100.0), np.zeros(100)], 1)  # real: 100 points, spacing 1, on a line
    assert precision_recall(line, line) == (1.0, 1.0)
    assert precision_recall(line, line + 1000.0) == (0.0, 0.0)
    # Half the modes: every fake point is real (precision 1); fake radii are 2 (end points: 3), so reals
    # 0..49 and 50, 51, 52 are covered -> recall 53/100.
    precision, recall = precision_recall(line, line[:50], batch=7)
    assert (precision, recall) == (1.0, pytest.approx(0.53))
    np.testing.assert_allclose(manifold_radii(line[:50], batch=7), [9.0] + [4.0] * 48 + [9.0])


def test_blocked_precision_recall_matches_the_definition():
    rng = np.random.default_rng(3)
    real, fake = rng.normal(size=(90, 5)), rng.normal(size=(70, 5)) * 1.3 + 0.2
    expected = brute_force_pr(real, fake)
    assert precision_recall(real, fake, batch=16) == pytest.approx(expected)
    assert precision_recall(real, fake, batch=1000) == pytest.approx(expected)


def test_statistics_file_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    stats = Stats({"features": {"name": "inception"}, "count": 5, "image_size": [32, 32]}, rng.normal(size=4),
                  np.eye(4), rng.normal(size=3), np.eye(3) * 2, rng.normal(size=(5, 4)).astype(np.float32))
    path = save_stats(tmp_path / "stats.npz", stats)
    assert is_stats_file(path)
    back = load_stats(path)
    for key in ("mu", "sigma", "mu_s", "sigma_s", "pool"):
        np.testing.assert_array_equal(getattr(back, key), getattr(stats, key))
    assert back.meta["features"] == {"name": "inception"} and back.image_size == (32, 32)
    with np.load(path) as npz:  # the ADM layout: the four arrays by their names, meta a JSON string
        assert {"mu", "sigma", "mu_s", "sigma_s"} <= set(npz.files)
        assert json.loads(str(npz["meta"]))["count"] == 5


def test_adm_reference_batch_is_read_as_inception_statistics(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "VIRTUAL_tiny.npz"
    np.savez(path, arr_0=rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8), mu=np.zeros(4), sigma=np.eye(4),
             mu_s=np.zeros(2), sigma_s=np.eye(2))
    stats = load_stats(path)
    assert stats.meta["features"]["name"] == "inception" and stats.image_size == (16, 16)
    assert stats.meta["count"] == 6 and stats.pool is None


def test_an_image_source_that_holds_nothing_usable_is_one_clear_error(tmp_path):
    from evaluate.images import open_images

    (tmp_path / "empty" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "empty" / ".ipynb_checkpoints" / "x.png").write_bytes(b"")  # hidden: never data
    with pytest.raises(UserError, match="holds no images"):
        open_images(tmp_path / "empty")
    with pytest.raises(UserError, match="does not exist"):
        open_images(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(UserError, match="not a readable .npz"):
        open_images(tmp_path / "text.npz")
