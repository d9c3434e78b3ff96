"""Extraction throughput: our batched, sharded path vs a batch-size-1, one-.npy-per-image loop (fast-DiT's way).

    .venv/bin/python tests/bench/bench_extract.py                      # tiny random VAE on this machine
    .venv/bin/python tests/bench/bench_extract.py --vae PATH --image-size 256 --num-images 2048   # a real VAE

Both paths decode with the same preprocessing and the same number of DataLoader workers and include VAE
loading and writing. The baseline encodes one image per step, draws a posterior sample and saves one .npy
per image (no mirrored copy); ours encodes --batch-size images per step (x2 with --flip both) into shards.

Then the same images as sources (issue 36): webdataset tar shards (written by webdataset's ShardWriter), the same
shards served by a 127.0.0.1 HTTP server (fsspec, Range requests), and a Hugging Face style parquet file (pyarrow),
each extracted with --flip none and timed against the folder: images/s and the ratio. A source's time includes its
listing pass (every byte read once for labels and content hashes) before the encoding reads each sample again.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.datasets.imagefolder import scan_image_folder  # noqa: E402
from shared.datasets.images import preprocess  # noqa: E402
from extract.config import ExtractConfig  # noqa: E402
from extract.run import run_extract
from shared.tokenizers.locate import load_tokenizer  # noqa: E402


class _PerImage(Dataset):
    """The baseline's dataset: one preprocessed image with a random flip frozen at extraction time."""

    def __init__(self, scan, image_size):
        self.scan, self.image_size = scan, image_size

    def __len__(self):
        return len(self.scan)

    def __getitem__(self, i):
        x = preprocess(self.scan.root / self.scan.files[i], self.image_size)  # (3, S, S)
        if torch.rand(()) < 0.5:
            x = x.flip(2)
        return x, self.scan.labels[i]


def baseline(data: Path, out: Path, vae_spec: str, image_size: int, workers: int, device) -> float:
    """Seconds for the batch-size-1 loop writing one features .npy and one labels .npy per image."""
    start = time.perf_counter()
    vae = load_tokenizer(vae_spec, device=device)
    scan = scan_image_folder(data)
    loader = DataLoader(_PerImage(scan, image_size), batch_size=1, num_workers=workers)
    (out / "features").mkdir(parents=True)
    (out / "labels").mkdir()
    for i, (x, y) in enumerate(loader):
        with torch.no_grad():
            z = vae.vae.encode(x.to(device)).latent_dist.sample() * vae.scaling_factor  # (1, C, h, w)
        np.save(out / "features" / f"{i}.npy", z.cpu().numpy())
        np.save(out / "labels" / f"{i}.npy", y.numpy())
    return time.perf_counter() - start


def ours(data: Path, out: Path, vae_spec: str, args, flip: str) -> float:
    """Seconds for `python -m extract`'s code path (in-process) into shards + index."""
    start = time.perf_counter()
    run_extract(ExtractConfig(data_path=data, out=out, vae=vae_spec, image_size=args.image_size, flip=flip,
                              batch_size=args.batch_size, num_workers=args.workers, shard_size=args.shard_size))
    return time.perf_counter() - start


def write_sources(data: Path, root: Path, per_shard: int) -> dict:
    """The folder's images as tar shards and as one parquet file; {name: --data-path} (http added by the caller)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    scan = scan_image_folder(data)
    (root / "wds").mkdir(parents=True)
    with wds.ShardWriter(str(root / "wds" / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (rel, label) in enumerate(zip(scan.files, scan.labels)):
            sink.write({"__key__": f"{i:08d}", "png": (data / rel).read_bytes(), "cls": label})
    shards = sorted(p.name for p in (root / "wds").glob("*.tar"))
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": scan.classes}}
    table = pa.table({"image": [{"bytes": (data / f).read_bytes(), "path": f} for f in scan.files],
                      "label": scan.labels})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    (root / "hf" / "data").mkdir(parents=True)
    pq.write_table(table, root / "hf" / "data" / "train-00000-of-00001.parquet", row_group_size=100)  # as `datasets`
    return {"tar": f"{root}/wds/train-{{000000..{len(shards) - 1:06d}}}.tar", "parquet": str(root / "hf"),
            "shards": shards}


def serve(folder: Path):
    """A 127.0.0.1 HTTP server for folder answering Range requests, from a thread; (base URL, server)."""
    import functools
    import http.server
    import threading

    from tests.test_extract_sources import _RangeHandler

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_RangeHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def bench_sources(data: Path, tmp: Path, vae: str, args, n: int) -> None:
    """Extraction images/s from the folder, tar shards (local, http) and parquet; ratios against the folder."""
    paths = write_sources(data, tmp / "sources", args.tar_size)
    url, server = serve(tmp / "sources" / "wds")
    try:
        last = len(paths["shards"]) - 1
        runs = [("folder", str(data)), ("tar shards, local", paths["tar"]),
                ("tar shards, http://127.0.0.1", f"{url}/train-{{000000..{last:06d}}}.tar"),
                ("parquet (HF folder), local", paths["parquet"])]
        times = {name: float("inf") for name, _ in runs}
        for repeat in range(args.repeat):  # interleaved, best of --repeat: fixed costs dominate at tiny sizes
            for k, (name, source) in enumerate(runs):
                times[name] = min(times[name], ours(source, tmp / f"src-{k}-{repeat}", vae, args, "none"))
    finally:
        server.shutdown()
    print(f"sources: {n} images, --flip none, {args.tar_size} images per tar shard, workers {args.workers}, best of "
          f"{args.repeat}")
    print(f"{'source':<36}{'images/s':>10}{'vs folder':>11}")
    for name, seconds in times.items():
        print(f"{name:<36}{n / seconds:>10.1f}{times['folder'] / seconds:>10.2f}x")


def make_data(root: Path, args) -> tuple[Path, str]:
    """Random JPEG-free PNG ImageFolder and (unless --vae) a tiny random VAE."""
    from tests.conftest import make_image_folder, make_tiny_vae

    per_class = -(-args.num_images // args.classes)
    data = make_image_folder(root / "data", classes=tuple(f"c{i:03d}" for i in range(args.classes)),
                             per_class=per_class, size=(args.src_size, args.src_size))
    vae = args.vae or str(make_tiny_vae(root / "vae", levels=args.levels))
    return data, vae


def main() -> None:
    """Run both paths on the same images and print images/s side by side with the ratio."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-images", type=int, default=256, help="Images in the generated dataset.")
    p.add_argument("--classes", type=int, default=4, help="Class folders in the generated dataset.")
    p.add_argument("--src-size", type=int, default=96, help="Side of the generated source images.")
    p.add_argument("--image-size", type=int, default=64, help="Extraction --image-size.")
    p.add_argument("--batch-size", type=int, default=64, help="Our --batch-size.")
    p.add_argument("--shard-size", type=int, default=4096, help="Our --shard-size.")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers for both paths.")
    p.add_argument("--levels", type=int, default=2, help="Levels of the tiny random VAE (ignored with --vae).")
    p.add_argument("--vae", default=None, help="A real VAE (folder/file/hub id) instead of the tiny random one.")
    p.add_argument("--tar-size", type=int, default=64, help="Images per generated tar shard (sources part).")
    p.add_argument("--repeat", type=int, default=3, help="Runs per source (sources part); the fastest counts.")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, vae = make_data(tmp, args)
        n = len(scan_image_folder(data))
        t_base = baseline(data, tmp / "npy", vae, args.image_size, args.workers, device)
        t_none = ours(data, tmp / "ours-none", vae, args, "none")
        t_both = ours(data, tmp / "ours-both", vae, args, "both")
        files = sum(1 for _ in (tmp / "npy").rglob("*.npy"))
        ours_files = sum(1 for _ in (tmp / "ours-both").iterdir())
        bench_sources(data, tmp, vae, args, n)
    print(f"device {device}, {n} images {args.src_size}px -> {args.image_size}px, workers {args.workers}")
    rows = [("baseline: batch 1, one .npy per image", t_base, files),
            (f"ours: batch {args.batch_size}, shards, --flip none", t_none, ours_files),
            (f"ours: batch {args.batch_size}, shards, --flip both (2x encodes)", t_both, ours_files)]
    print(f"{'path':<56}{'images/s':>10}{'vs baseline':>13}{'files':>8}")
    for name, seconds, count in rows:
        print(f"{name:<56}{n / seconds:>10.1f}{t_base / seconds:>12.2f}x{count:>8}")


if __name__ == "__main__":
    main()
