"""Feature statistics: of an image source's features, their files, ADM reference batches, the --ref resolved.

A statistics file is an npz in ADM's layout (mu, sigma; mu_s, sigma_s for sFID) plus `pool` (N, D) float32 for
precision/recall and `meta`, a JSON string (feature network, image size, count); ADM's published batches read as is.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from evaluate.images import IMAGES_KEY, compute_features, npz_keys, open_images, open_npz_images, save_npz
from shared.runtime.errors import UserError
from shared.runtime.fsio import user_cache

STATS_VERSION = 1
ADM_KEYS = ("mu", "sigma", "mu_s", "sigma_s")
REAL_DIGITS = "sklearn-digits"  # the source name of the default --features digits reference
REAL_DIGITS_LABEL = "real digits (scikit-learn, all 1,797)"


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
    arrays = {k: getattr(stats, k) for k in ADM_KEYS if getattr(stats, k) is not None}
    if stats.pool is not None:
        arrays["pool"] = stats.pool
    arrays["meta"] = np.array(json.dumps({"version": STATS_VERSION, **stats.meta}))
    return save_npz(path, **arrays)


def is_stats_file(path) -> bool:
    """True for an npz holding precomputed statistics (ours or ADM's `mu`/`sigma`)."""
    path = Path(path)
    return path.is_file() and {"mu", "sigma"} <= set(npz_keys(path))


def load_stats(path) -> Stats:
    """Read our statistics file or an ADM reference's precomputed statistics (its images are not read here)."""
    path = Path(path)
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


# ---- References ----

def _contents_stamp(path: Path) -> tuple:
    """(bytes, newest mtime) of a file, or of every image below a folder (a folder's own stat misses its files)."""
    if not path.is_dir():
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    from evaluate.images import image_files
    stats = [(f.relative_to(path).as_posix(), f.stat()) for f in image_files(path)]
    listing = hashlib.sha256("".join(f"{name}\t{st.st_size}\t{st.st_mtime_ns}\n" for name, st in stats).encode())
    return len(stats), listing.hexdigest()


def cache_dir() -> Path:
    """The user cache folder of the evaluation stage."""
    return user_cache("evaluate")


def stats_cache_path(path: Path, identity: dict) -> Path:
    """Cache file of the statistics of an image npz/folder: keyed by path, its contents stamp and the feature network."""
    key = json.dumps([str(path.resolve()), *_contents_stamp(path), identity], sort_keys=True)
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
    if path.is_file() and is_stats_file(path):
        stats = load_stats(path)
        images = open_npz_images(path) if IMAGES_KEY in npz_keys(path) else None
        return Reference(str(path), stats=stats, images=images)
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
