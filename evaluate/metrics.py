"""Feature statistics, their files, the --ref and FID, sFID, IS, precision/recall, as ADM's evaluator.py.

A statistics file is ADM's npz (mu, sigma; mu_s, sigma_s for sFID) plus `pool` (N, D) float32 for precision/recall
and `meta`, a JSON string (feature network, image size, count); ADM's published batches read as is.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from evaluate.images import IMAGES_KEY, compute_features, image_files, npz_keys, open_images, open_npz_images, save_npz
from shared.runtime.errors import UserError
from shared.runtime.fsio import user_cache

STATS_VERSION = 1
ADM_KEYS = ("mu", "sigma", "mu_s", "sigma_s")
REAL_DIGITS = "sklearn-digits"  # the source name of the default --features digits reference
REAL_DIGITS_LABEL = "real digits (scikit-learn, all 1,797)"
METRICS = ("fid", "sfid", "inception_score", "precision", "recall")  # the five numbers of one evaluation
IS_SPLIT_SIZE = 5000   # ADM scores IS over consecutive chunks of 5,000 samples (the improved-GAN recipe)
PR_NEIGHBOURS = 3      # k of the k-NN manifolds (Kynkäänniemi et al. 2019, as ADM)
PR_BATCH = 10_000      # rows/columns per distance block: a 10k x 10k float32 block is 400 MB


def mean_cov(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and unbiased covariance (D, D) of features (N, D), in float64, as ADM's np.cov(rowvar=False)."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise UserError(f"a covariance needs at least 2 feature vectors (N, D); got shape {x.shape}. "
                        f"Evaluate at least 2 images.")
    return x.mean(axis=0), np.cov(x, rowvar=False)


@dataclass
class Stats:
    """Statistics of one image set in one feature space."""
    meta: dict                      # {"features": identity dict, "count": N, "image_size": [H, W] or None, ...}
    mu: np.ndarray                  # (D,) pool-feature mean
    sigma: np.ndarray               # (D, D) pool-feature covariance
    mu_s: np.ndarray | None = None  # (2023,) spatial-feature mean (Inception only)
    sigma_s: np.ndarray | None = None
    pool: np.ndarray | None = field(default=None, repr=False)  # (N, D) float32 for precision/recall

    @property
    def image_size(self):
        """(H, W) of the images the statistics describe, or None when the file does not say (ADM stats only)."""
        size = self.meta.get("image_size")
        return tuple(size) if size else None


def stats_from_features(feats: dict, meta: dict) -> Stats:
    """Stats of gathered features {"pool": (N, D), optionally "spatial": (N, S)}."""
    mu, sigma = mean_cov(feats["pool"])
    mu_s, sigma_s = mean_cov(feats["spatial"]) if "spatial" in feats else (None, None)
    return Stats(meta, mu, sigma, mu_s, sigma_s, np.asarray(feats["pool"], np.float32))


def save_stats(path, stats: Stats) -> Path:
    """Write a statistics file (atomic): ADM keys present, `pool`, and `meta` as a JSON string."""
    arrays = {k: getattr(stats, k) for k in (*ADM_KEYS, "pool") if getattr(stats, k) is not None}
    arrays["meta"] = np.array(json.dumps({"version": STATS_VERSION, **stats.meta}))
    return save_npz(path, **arrays)


def is_stats_file(path) -> bool:
    """True for an npz holding precomputed statistics (ours or ADM's `mu`/`sigma`)."""
    return Path(path).is_file() and {"mu", "sigma"} <= set(npz_keys(path))


def load_stats(path) -> Stats:
    """Read our statistics file or an ADM reference's precomputed statistics (its images are not read here)."""
    with np.load(path, allow_pickle=False) as npz:
        keys = set(npz.files)
        arrays = {k: np.asarray(npz[k], np.float64) for k in ADM_KEYS if k in keys}
        pool = np.asarray(npz["pool"], np.float32) if "pool" in keys else None
        meta = json.loads(str(npz["meta"])) if "meta" in keys else None
        images_shape = open_npz_images(path).shape if IMAGES_KEY in keys else None
    if meta is None:  # an ADM reference batch: TF Inception statistics, image size from its images if present
        meta = {"features": {"name": "inception"}, "source": "ADM reference batch",
                "count": images_shape[0] if images_shape else None,
                "image_size": list(images_shape[1:3]) if images_shape else None}
    if arrays["mu"].ndim != 1 or arrays["sigma"].shape != (arrays["mu"].size,) * 2:
        raise UserError(f"{path}: `mu` {arrays['mu'].shape} and `sigma` {arrays['sigma'].shape} are not a mean and "
                        f"its covariance; pass a statistics file written by --save-stats or an ADM reference batch.")
    return Stats(meta, arrays["mu"], arrays["sigma"], arrays.get("mu_s"), arrays.get("sigma_s"), pool)


def source_meta(net, source) -> dict:
    """The meta of statistics computed by `net` over `source`."""
    return {"features": net.identity(), "count": source.count, "image_size": list(source.size),
            "source": str(source.path)}


def cache_dir() -> Path:
    """The user cache folder of the evaluation stage."""
    return user_cache("evaluate")


def stats_cache_path(path: Path, identity: dict) -> Path:
    """Cache file of the statistics of an image npz/folder: keyed by path, its contents stamp and the feature network."""
    if path.is_dir():  # a folder's own stat misses its files: the count and a hash of every image's size and mtime
        stats = [(f.relative_to(path).as_posix(), f.stat()) for f in image_files(path)]
        listing = "".join(f"{name}\t{st.st_size}\t{st.st_mtime_ns}\n" for name, st in stats)
        stamp = [len(stats), hashlib.sha256(listing.encode()).hexdigest()]
    else:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns]
    key = json.dumps([str(path.resolve()), *stamp, identity], sort_keys=True)
    return cache_dir() / "stats" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"


@dataclass
class Reference:
    """A resolved --ref before any network is loaded: precomputed stats and/or images, and their image size."""
    label: str
    stats: Stats | None = None
    images: object = None          # an image source (for statistics or for the pool features of PR)
    size: tuple | None = None      # (H, W) of a reference known without reading it: the real digits

    @property
    def image_size(self):
        """(H, W) of the reference images, or None if unknown."""
        if self.images is not None:
            return tuple(self.images.size)
        return self.stats.image_size if self.stats is not None else self.size


def open_reference(ref, features: str) -> Reference:
    """Resolve --ref: a statistics file, an ADM reference batch, an images npz or folder; None with digits = real digits."""
    if ref is None:
        if features != "digits":
            raise UserError("--ref is required with the Inception features: pass an ADM reference batch (e.g. "
                            "VIRTUAL_imagenet256_labeled.npz), a statistics file from --save-stats, or an images npz "
                            "or folder of real images. (--features digits compares with the real digits by default.)")
        from shared.datasets.digits import IMAGE_SIZE
        return Reference(REAL_DIGITS_LABEL, size=(IMAGE_SIZE, IMAGE_SIZE))  # the yardstick's own, read by it
    path = Path(ref)
    if is_stats_file(path):
        images = open_npz_images(path) if IMAGES_KEY in npz_keys(path) else None
        return Reference(str(path), stats=load_stats(path), images=images)
    return Reference(str(path), images=open_images(path))


def check_reference(reference: Reference, features: str, sample_size) -> None:
    """UserError if the reference was made by another feature network or from images of another size."""
    if reference.stats is not None:
        made_by = reference.stats.meta.get("features", {}).get("name")
        if made_by != features:
            raise UserError(f"--ref {reference.label} holds statistics of the {made_by} features, but this evaluation "
                            f"uses --features {features}; pass --features {made_by} or a reference made with "
                            f"--features {features}.")
    size = reference.image_size
    if size is not None and tuple(size) != tuple(sample_size):
        raise UserError(f"--ref {reference.label} describes {size[1]}x{size[0]} images but the samples are "
                        f"{sample_size[1]}x{sample_size[0]}: FID across resolutions measures the resize, not the "
                        f"model. Pass a reference at the samples' resolution (ADM publishes one per size, e.g. "
                        f"VIRTUAL_imagenet256_labeled.npz for 256x256), or write one from real images: "
                        f"`python -m evaluate reference IMAGES --image-size {sample_size[0]} --out REF.npz`.")


def reference_stats(reference: Reference, net, batch_size: int, rank: int, world: int, need_pool: bool) -> Stats:
    """The reference's statistics: precomputed ones (plus pool features from its images for PR) or computed, cached."""
    stats = reference.stats
    if stats is not None:
        if need_pool and stats.pool is None and reference.images is not None:
            stats.pool = compute_features(reference.images, net, batch_size, rank, world, "reference")["pool"]
        return stats
    images = reference.images
    if images is None:  # the real digits: their features computed once per process by evaluate/digits.py
        real = net.real_features()  # (1797, 64)
        return stats_from_features({"pool": real}, {"features": net.identity(), "count": len(real),
                                                    "image_size": list(reference.size), "source": REAL_DIGITS})
    cache = stats_cache_path(Path(images.path), net.identity()) if Path(str(images.path)).exists() else None
    if cache is not None and cache.is_file():
        with contextlib.suppress(UserError, OSError, ValueError, KeyError):  # a damaged entry is recomputed, replaced
            return load_stats(cache)
    stats = stats_from_features(compute_features(images, net, batch_size, rank, world, "reference"),
                                source_meta(net, images))
    if cache is not None and rank == 0:
        with contextlib.suppress(OSError):  # an unwritable cache only costs the recomputation next time
            save_stats(cache, stats)
    return stats


# ---- Fréchet distance (Heusel et al. 2017, Eq. in Sec. 3; Dowson & Landau 1982) ----

def _psd_sqrt(sigma: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric PSD matrix via its eigendecomposition (tiny negative eigenvalues -> 0)."""
    vals, vecs = np.linalg.eigh(sigma)
    return (vecs * np.sqrt(np.clip(vals, 0, None))) @ vecs.T


def _sum_sqrt_eigvals(m: np.ndarray) -> float:
    """sum_i sqrt(lambda_i) of a symmetric PSD matrix (rounding asymmetry and tiny negative eigenvalues removed)."""
    m = (m + m.T) / 2
    return float(np.sqrt(np.clip(np.linalg.eigvalsh(m), 0, None)).sum())


def trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """tr((S1 S2)^1/2) as the eigenvalues of a symmetric PSD matrix similar to S1 S2."""
    # S1 = L L^T gives sum sqrt(eig(L^T S2 L)): one Cholesky and one eigvalsh, ~4x faster than eigh at D = 2048, and
    # real where ADM's scipy sqrtm(S1 @ S2) turns complex on near-singular covariances. Singular S1: S2's factor.
    for a, b in ((sigma1, sigma2), (sigma2, sigma1)):
        try:
            chol = np.linalg.cholesky(a)
        except np.linalg.LinAlgError:
            continue
        return _sum_sqrt_eigvals(chol.T @ b @ chol)
    root = _psd_sqrt(sigma1)
    return _sum_sqrt_eigvals(root @ sigma2 @ root)


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^1/2): the Fréchet distance of two Gaussians."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.size, mu1.size):
        raise UserError(f"the two statistics have different feature sizes (mean {mu1.shape} vs {mu2.shape}, "
                        f"covariance {sigma1.shape} vs {sigma2.shape}): they come from different feature networks "
                        f"or layers; compute both with the same --features.")
    diff = mu1 - mu2
    value = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_sqrt_product(sigma1, sigma2)
    return float(max(value, 0.0))  # the exact value is >= 0; clip float rounding of identical sets


def frechet_distance_to(features: np.ndarray, mu, sigma) -> float:
    """Fréchet distance between the Gaussian fitted to features (N, D) and (mu, sigma)."""
    mu_x, sigma_x = mean_cov(features)  # N <= D: singular covariance, the exact low-rank route costs O(N D^2)
    sigma = np.asarray(sigma, np.float64)
    if len(features) > mu_x.size or sigma.shape != sigma_x.shape:
        return frechet_distance(mu_x, sigma_x, mu, sigma)
    # tr((S_x S)^1/2) through the N x N matrix A^T S A: S_x = A A^T, and A A^T S shares its nonzero eigenvalues
    a = (np.asarray(features, np.float64) - mu_x).T / np.sqrt(len(features) - 1)  # (D, N)
    diff = mu_x - np.asarray(mu, np.float64)
    value = diff @ diff + np.trace(sigma_x) + np.trace(sigma) - 2 * _sum_sqrt_eigvals(a.T @ sigma @ a)
    return float(max(value, 0.0))


def frechet_distance_of(features1: np.ndarray, features2: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets (N1, D) and (N2, D)."""
    if len(features1) > len(features2):
        features1, features2 = features2, features1  # the smaller set takes the low-rank route when it can
    return frechet_distance_to(features1, *mean_cov(features2))


# ---- Inception Score (Salimans et al. 2016), split as ADM / improved-GAN ----

def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax (N, K) in float64, shifted by the row maximum for stability."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def check_split_size(split_size: int = IS_SPLIT_SIZE) -> None:
    """UserError for a split size below 1."""
    if split_size < 1:
        raise UserError(f"the Inception Score split size must be at least 1; got {split_size}.")


def is_comparable(count: int, split_size: int = IS_SPLIT_SIZE) -> bool:
    """Whether an IS over `count` samples in splits of `split_size` compares with published ones."""
    return split_size == IS_SPLIT_SIZE and count >= split_size  # published IS: at least one full split of 5,000


def comparability_note(count: int, split_size: int) -> str:
    """Why an IS is not comparable, for the table (empty when it is)."""
    if is_comparable(count, split_size):
        return ""
    if count < split_size:
        return f"not comparable: {count} samples, fewer than one split of {split_size}; published IS use 5,000+"
    return f"not comparable: splits of {split_size}; published IS use splits of {IS_SPLIT_SIZE}"


def inception_score(logits: np.ndarray, split_size: int = IS_SPLIT_SIZE) -> float:
    """exp(E_x KL(p(y|x) || p(y))) averaged over consecutive splits of `split_size` rows of logits (N, K)."""
    probs = softmax(logits)
    check_split_size(split_size)
    scores = []
    for start in range(0, len(probs), split_size):
        part = probs[start:start + split_size]  # (n, K)
        marginal = part.mean(axis=0, keepdims=True)  # p(y) over this split, (1, K)
        # 0 * log 0 = 0: where p(y|x) underflows to 0 the term vanishes
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = np.where(part > 0, part * (np.log(part) - np.log(marginal)), 0.0).sum(axis=1)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores))


# ---- Precision and recall (Kynkäänniemi et al. 2019, "Improved precision and recall metric") ----

def _squared_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise squared Euclidean distances (n, m) of rows of a (n, D) and b (m, D), clipped at 0 (as ADM)."""
    d = (a * a).sum(1)[:, None] - 2.0 * (a @ b.T) + (b * b).sum(1)[None, :]
    return np.maximum(d, 0.0)


def manifold_radii(features: np.ndarray, k: int = PR_NEIGHBOURS, batch: int = PR_BATCH) -> np.ndarray:
    """Squared distance (N,) from each point to its k-th nearest other point, in blocks of batch x batch."""
    x = np.asarray(features, np.float32)
    if len(x) <= k:
        raise UserError(f"precision and recall need more than k = {k} feature vectors per set; got {len(x)}.")
    radii = np.empty(len(x), np.float32)
    for r0 in range(0, len(x), batch):
        rows = x[r0:r0 + batch]
        best = np.full((len(rows), 0), np.inf, np.float32)  # (rows, <= k+1) smallest distances so far
        for c0 in range(0, len(x), batch):
            block = np.concatenate([best, _squared_distances(rows, x[c0:c0 + batch])], axis=1)
            keep = min(k + 1, block.shape[1])
            best = np.partition(block, keep - 1, axis=1)[:, :keep]
        radii[r0:r0 + batch] = np.sort(best, axis=1)[:, k]
    return radii


def _covered(points: np.ndarray, centres: np.ndarray, radii: np.ndarray, batch: int) -> np.ndarray:
    """(N,) bool: is each point within radius (squared, inclusive) of some centre? Blocked over both sets."""
    inside = np.zeros(len(points), bool)
    for p0 in range(0, len(points), batch):
        rows = points[p0:p0 + batch]
        for c0 in range(0, len(centres), batch):
            d = _squared_distances(rows, centres[c0:c0 + batch])  # (rows, centres)
            inside[p0:p0 + batch] |= (d <= radii[None, c0:c0 + batch]).any(axis=1)
    return inside


def precision_recall(real: np.ndarray, fake: np.ndarray, k: int = PR_NEIGHBOURS,
                     batch: int = PR_BATCH) -> tuple[float, float]:
    """Precision = share of fake points inside the real k-NN manifold; recall = share of real inside the fake one."""
    real, fake = np.asarray(real, np.float32), np.asarray(fake, np.float32)
    real_radii, fake_radii = manifold_radii(real, k, batch), manifold_radii(fake, k, batch)
    return float(_covered(fake, real, real_radii, batch).mean()), float(_covered(real, fake, fake_radii, batch).mean())


def sample_metrics(feats: dict, ref_stats, split_size: int = IS_SPLIT_SIZE) -> dict:
    """The METRICS of the samples' features {"pool", maybe "spatial", "logits"} against the reference's Stats."""
    # None where not defined: sFID without spatial features, IS without logits, PR without the reference's pool.
    out = dict.fromkeys(METRICS)
    out["fid"] = frechet_distance_to(feats["pool"], ref_stats.mu, ref_stats.sigma)
    if "spatial" in feats and ref_stats.mu_s is not None:
        out["sfid"] = frechet_distance_to(feats["spatial"], ref_stats.mu_s, ref_stats.sigma_s)
    if "logits" in feats:
        out["inception_score"] = inception_score(feats["logits"], split_size)
    if ref_stats.pool is not None:
        out["precision"], out["recall"] = precision_recall(ref_stats.pool, feats["pool"], PR_NEIGHBOURS)
    return out


def score(feats: dict, reference: Reference, net, batch_size: int, rank: int, world: int,
          split_size: int = IS_SPLIT_SIZE) -> tuple[dict, Stats]:
    """(METRICS of the samples' features against `reference`, its Stats: read, cached or computed with `net`)."""
    ref_stats = reference_stats(reference, net, batch_size, rank, world, need_pool=True)
    return sample_metrics(feats, ref_stats, split_size), ref_stats
