"""Reader throughput: our mmap'd shards vs one .npy per latent (fast-DiT's layout) vs plain webdataset.

Run: .venv/bin/python tests/bench/bench_reader.py [--num 20000] [--workers 0 1 2] [--feature-num 512]
--feature-num N also compares, side by side, a folder whose samples carry REPA encoder tokens (DINOv2-B at 256 px:
(F, 256, 768) fp16) with the moments-only folder (0 skips it).
All files are written fresh into a temp folder, so every method reads from a warm page cache.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import webdataset as wds

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.datasets.shards import (  # noqa: E402
    GatheredBatch, LatentDataset, ShardInfo, ShardWriter, collate, shard_name, write_index,
)
from train.latents import StreamSampler  # noqa: E402

FEATURES = (256, 768)  # REPA's DINOv2-B/14 tokens at 256 px: (T, E)

SHAPE = (2, 4, 32, 32)  # (F, C, h, w): flips stored, 256x256 images through an f8 VAE
COLUMNS = {"mean": torch.float16, "std": torch.float16}  # the posterior moments, as extract stores them
NUM_CLASSES = 1000
META = {"image_size": 256, "num_classes": NUM_CLASSES, "class_names": [f"c{i}" for i in range(NUM_CLASSES)],
        "vae": {"source": "synthetic", "scaling_factor": 0.5}}


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, default=20000, help="latents in the throughput test")
    p.add_argument("--per-shard", type=int, default=2500, help="samples per tar shard")
    p.add_argument("--batch", type=int, default=256, help="DataLoader batch size")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="num_workers values to compare")
    p.add_argument("--repeats", type=int, default=3, help="passes per measurement; the best is kept (noisy CPUs)")
    p.add_argument("--index-samples", type=int, default=1_281_167,
                   help="size of the synthetic index for the time-to-first-batch test (0 skips it)")
    p.add_argument("--feature-num", type=int, default=512,
                   help="samples in the with-features comparison (each ~768 KiB with 2 flips; 0 skips it)")
    p.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp folder, removed)")
    return p.parse_args(argv)


# -- data ---------------------------------------------------------------------------------------------------

def synthetic(i: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Deterministic fp16 moments and label for sample i."""
    rng = np.random.default_rng(i)
    mean = rng.standard_normal(SHAPE, dtype=np.float32).astype(np.float16)
    std = rng.random(SHAPE, dtype=np.float32).astype(np.float16)
    return mean, std, int(rng.integers(NUM_CLASSES))


def write_shards(root: Path, num: int, per_shard: int) -> list[ShardInfo]:
    """Write `num` samples into shards of `per_shard` plus index.json; return the shard infos."""
    root.mkdir(parents=True)
    infos = []
    for s, first in enumerate(range(0, num, per_shard)):
        with ShardWriter(root / shard_name(s), columns=COLUMNS) as writer:
            for i in range(first, min(first + per_shard, num)):
                mean, std, label = synthetic(i)
                writer.add(f"{i:07d}", {"mean": mean, "std": std}, label)
        infos.append(writer.info)
    write_index(root, infos, META)
    return infos


def write_npy(root: Path, num: int) -> np.ndarray:
    """One .npy per latent holding stacked (mean, std) (2, F, C, h, w); labels returned in memory."""
    root.mkdir(parents=True)
    labels = np.empty(num, np.int64)
    for i in range(num):
        mean, std, labels[i] = synthetic(i)
        np.save(root / f"{i:07d}.npy", np.stack([mean, std]))
    return labels


class NpyDataset(torch.utils.data.Dataset):
    """fast-DiT-style reader: np.load one file per item (fast-DiT also reads a second .npy for the label)."""

    def __init__(self, root: Path, labels: np.ndarray):
        self.files, self.labels = sorted(str(p) for p in root.glob("*.npy")), labels

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        moments = torch.from_numpy(np.load(self.files[i]))  # (2, F, C, h, w)
        return {"mean": moments[0], "std": moments[1], "label": int(self.labels[i])}


class PerItem(torch.utils.data.Dataset):
    """Our reader without the batched `__getitems__` path: per-sample views + default collate."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def decode_wds(sample: dict) -> dict:
    """Plain webdataset decoding: parse each sample's safetensors bytes."""
    tensors = safetensors.torch.load(sample["latent.safetensors"])
    return {"mean": tensors["mean"], "std": tensors["std"], "label": int(sample["cls"])}


# -- timing -------------------------------------------------------------------------------------------------

def time_loader(make_loader, args) -> float:
    """Best samples/s over `args.repeats` epochs' worth of batches, each after a first batch (start-up excluded)."""
    best = 0.0
    for _ in range(args.repeats):
        it = iter(make_loader())
        next(it)
        steps = max(1, args.num // args.batch - 1)
        t0 = time.perf_counter()
        seen = sum(len(next(it)["label"]) for _ in range(steps))
        best = max(best, seen / (time.perf_counter() - t0))
        del it  # shut the workers down before the next pass
    return best


def map_loader(ds, args, workers, collate_fn=None):
    """A shuffled map-style DataLoader as train builds it."""
    return torch.utils.data.DataLoader(ds, batch_size=args.batch, sampler=StreamSampler(len(ds), seed=0),
                                       num_workers=workers, collate_fn=collate_fn)


def wds_loader(urls, args, workers):
    """A plain webdataset pipeline (sequential shard streaming, batched in the workers)."""
    pipe = wds.WebDataset(urls, shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False)
    pipe = pipe.map(decode_wds).batched(args.batch, collation_fn=collate, partial=False).repeat()
    return torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=workers)


def throughput(args, work: Path, infos: list[ShardInfo], labels: np.ndarray) -> None:
    """Print samples/s for every reader and worker count, with ratios to the per-file .npy baseline."""
    ds = LatentDataset(work / "shards")
    npy = NpyDataset(work / "npy", labels)
    urls = [str(work / "shards" / info.name) for info in infos]
    print(f"\n{'num_workers':>11} | {'npy files':>10} | {'ours (batched)':>14} {'ratio':>6} | "
          f"{'ours (per item)':>15} {'ratio':>6} | {'webdataset':>10} {'ratio':>6}")
    for w in args.workers:
        base = time_loader(lambda: map_loader(npy, args, w), args)
        ours = time_loader(lambda: map_loader(ds, args, w, collate), args)
        item = time_loader(lambda: map_loader(PerItem(ds), args, w), args)
        stream = time_loader(lambda: wds_loader(urls, args, w), args)
        print(f"{w:>11} | {base:>10.0f} | {ours:>14.0f} {ours / base:>5.1f}x | {item:>15.0f} {item / base:>5.1f}x | "
              f"{stream:>10.0f} {stream / base:>5.1f}x")
    print(f"(samples/s, best of {args.repeats}, warm page cache; npy, ours: shuffled order from StreamSampler, "
          f"npy labels held in memory (fast-DiT also opens a label .npy per sample); webdataset: sequential "
          f"streaming + safetensors decode per sample; ours (per item): __getitem__ + default_collate)")


class Reading(torch.utils.data.Dataset):
    """A LatentDataset batch fetch reading the moments and the named extra columns (() = moments only, as
    non-REPA runs), of the drawn flip only, as train does."""

    def __init__(self, ds: LatentDataset, extra: tuple, one_frame: bool = True):
        self.ds, self.columns, self.one_frame = ds, ("mean", "std", *extra), one_frame

    def __len__(self):
        return len(self.ds)

    def __getitems__(self, indices):
        frames = [i % SHAPE[0] for i in indices] if self.one_frame else None  # as train's draw
        return GatheredBatch(self.ds.gather(indices, self.columns, frames))


def write_feature_shards(root: Path, num: int, per_shard: int, features: bool) -> None:
    """`num` samples of the throughput data, with or without (F, T, E) fp16 encoder tokens beside the moments."""
    root.mkdir(parents=True)
    infos = []
    for s, first in enumerate(range(0, num, per_shard)):
        with ShardWriter(root / shard_name(s), columns=COLUMNS | ({"repr": torch.float16} if features else {})) as writer:
            for i in range(first, min(first + per_shard, num)):
                mean, std, label = synthetic(i)
                extra = {"repr": torch.randn((SHAPE[0], *FEATURES), dtype=torch.float16)} if features else {}
                writer.add(f"{i:07d}", {"mean": mean, "std": std, **extra}, label)
        infos.append(writer.info)
    write_index(root, infos, META)


def with_features(args, work: Path) -> None:
    """Samples/s and MB/s: moments only, moments + tokens, and moments only from the folder holding tokens."""
    plain, feats = work / "plain", work / "features"
    write_feature_shards(plain, args.feature_num, 256, False)
    write_feature_shards(feats, args.feature_num, 256, True)
    a, b = LatentDataset(plain, progress=False), LatentDataset(feats, progress=False)
    small = argparse.Namespace(**{**vars(args), "num": args.feature_num, "batch": min(args.batch, 64)})
    moment_bytes = 2 * int(np.prod(SHAPE[1:])) * 2  # one flip's mean and std are read per sample
    token_bytes = int(np.prod(FEATURES)) * 2  # one flip's tokens are read per sample
    print(f"\n{args.feature_num} samples, batch {small.batch}: moments {SHAPE[0] * moment_bytes / 1024:.0f} KiB + tokens "
          f"{SHAPE[0] * token_bytes / 1024:.0f} KiB stored per sample ({SHAPE[0]} flips x {FEATURES[0]}x{FEATURES[1]} "
          f"fp16)")
    print(f"{'num_workers':>11} | {'moments only':>12} | {'+ tokens':>9} {'ratio':>6} {'MB/s':>7} | "
          f"{'moments from the token folder':>29} {'ratio':>6}")
    for w in args.workers:
        base = time_loader(lambda: map_loader(Reading(a, ()), small, w, collate), small)
        both = time_loader(lambda: map_loader(Reading(b, ("repr",)), small, w, collate), small)
        skip = time_loader(lambda: map_loader(Reading(b, ()), small, w, collate), small)
        print(f"{w:>11} | {base:>12.0f} | {both:>9.0f} {both / base:>5.2f}x {both * (moment_bytes + token_bytes) / 1e6:>7.0f}"
              f" | {skip:>29.0f} {skip / base:>5.2f}x")
    print("(samples/s, best of the repeats, warm page cache; '+ tokens' reads the drawn flip's tokens only, as "
          "train does; MB/s counts one flip's moments and tokens)")


def first_batch(args, work: Path, base: ShardInfo) -> None:
    """Time LatentDataset(root) + first shuffled batch on an index of args.index_samples real entries."""
    root = work / "big"
    root.mkdir()
    infos, total = [], 0
    for s in range((args.index_samples + base.num_samples - 1) // base.num_samples):
        n = min(base.num_samples, args.index_samples - total)
        os.link(work / "shards" / base.name, root / shard_name(s))  # the same real bytes under many names
        infos.append(ShardInfo.from_dict({**base.to_dict(), "name": shard_name(s), "num_samples": n,
                                          "keys": base.keys[:n], "labels": base.labels[:n],
                                          "offsets": base.offsets[:n]}))
        total += n
    write_index(root, infos, META)
    for w in (0, 2):
        t0 = time.perf_counter()
        ds = LatentDataset(root)
        t1 = time.perf_counter()
        batch = next(iter(map_loader(ds, args, w, collate)))
        t2 = time.perf_counter()
        print(f"index of {len(ds):,} samples in {len(infos)} shards (hard links to one real shard): "
              f"LatentDataset() {t1 - t0:.3f}s, first shuffled batch of {len(batch['label'])} with "
              f"num_workers={w} {t2 - t1:.3f}s, total {t2 - t0:.3f}s (warm page cache)")


def main(argv=None) -> None:
    """Run both benchmarks in a work folder."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-reader-"))
    try:
        t0 = time.perf_counter()
        infos = write_shards(work / "shards", args.num, args.per_shard)
        labels = write_npy(work / "npy", args.num)
        print(f"wrote {args.num} latents {SHAPE} fp16 twice (shards + .npy files) in {time.perf_counter() - t0:.1f}s")
        throughput(args, work, infos, labels)
        if args.feature_num:
            with_features(args, work)
        if args.index_samples:
            first_batch(args, work, infos[0])
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
