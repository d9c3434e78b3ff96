"""What verifying shards against index.json costs: a first full hash vs a start that trusts its record.

Writes SHARDS files of SIZE MiB of random bytes into a temp folder, then times shared.datasets.integrity.damaged_files
(the check every training start and every extract rerun makes) three ways: the first check (hashes all),
a second check (the verification record vouches for unchanged files: stat only), and a forced rehash (what
`python -m extract --verify` does). It extrapolates the first and second figures to ImageNet-1k at 256x256:
1,281,167 images x 4x32x32 latents x (mean, std) x 2 flips in fp16 = 32 KiB per image, 313 shards of 4096.

    python tests/bench/bench_verify.py [--shards 16] [--size-mib 64]
"""
import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.datasets.integrity import damaged_files  # noqa: E402

IMAGENET_BYTES = 1_281_167 * 4 * 32 * 32 * 2 * 2 * 2  # images x C*H*W x (mean, std) x flips x fp16 bytes
IMAGENET_SHARDS = -(-1_281_167 // 4096)


def make_folder(root: Path, shards: int, size: int) -> list[dict]:
    """Random shard files and their index entries (name, size, sha256)."""
    entries = []
    for j in range(shards):
        data = os.urandom(size)
        name = f"shard-{j:06d}.tar"
        (root / name).write_bytes(data)
        entries.append({"name": name, "size": size, "sha256": hashlib.sha256(data).hexdigest()})
    return entries


def timed(fn) -> float:
    """Seconds one call takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    """Print the three timings and the ImageNet extrapolation."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=16, help="number of shard files (default: 16)")
    p.add_argument("--size-mib", type=int, default=64, help="MiB per shard file (default: 64)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        entries = make_folder(root, args.shards, args.size_mib << 20)
        total = args.shards * (args.size_mib << 20)
        first = timed(lambda: damaged_files(root, entries, progress=False))
        again = timed(lambda: damaged_files(root, entries, progress=False))
        rehash = timed(lambda: damaged_files(root, entries, rehash=True, progress=False))
    rate = total / first
    print(f"{args.shards} shards, {total / 2**30:.2f} GiB, {os.cpu_count()} CPUs (page cache warm: files just written)")
    print(f"first check (hash all):       {first:8.3f} s  ({rate / 2**30:.2f} GiB/s)")
    print(f"second check (record, stat):  {again * 1e3:8.2f} ms  ({first / again:,.0f}x faster)")
    print(f"--verify (rehash all):        {rehash:8.3f} s")
    per_file = again / args.shards
    print(f"ImageNet-1k 256px ({IMAGENET_BYTES / 2**30:.1f} GiB, {IMAGENET_SHARDS} shards): first check "
          f"~{IMAGENET_BYTES / rate:.0f} s at this hashing rate (more if the disk reads slower), each later "
          f"start ~{per_file * IMAGENET_SHARDS * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
