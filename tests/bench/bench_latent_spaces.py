"""Per tokenizer class, on tiny random models: extraction images/s, bytes per image, the normalisation round trip.

Run: python tests/bench/bench_latent_spaces.py [--images 96] [--image-size 32]

For each tiny tokenizer of tests/tiny_tokenizers.py (made by diffusers' own class and save_pretrained) this runs the
real `python -m extract` (in this process, fp16 storage, both flips) on a random ImageFolder, then reads back:
  images/s   the extraction's own rate line (decode + encode + write, without loading the model)
  bytes      the shard bytes per image (tar headers included) and the stored payload per image
  round trip for stored latents z: max |decode(norm.apply(z), norm) - decode_raw(z)| with the tokenizer's own
             normalisation and with the folder's per-channel statistics (what training's draw applies and every
             decode inverts), in [-1, 1] pixel units
Numbers depend on the machine and its load; the ratios between classes are what carries over.
"""
import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from extract.__main__ import main as extract_main  # noqa: E402
from shared.datasets.shards import LatentDataset  # noqa: E402
from shared.tokenizers.tokenizer import LatentNorm, Tokenizer  # noqa: E402
from shared.tokenizers.locate import load_tokenizer
from tests.conftest import make_image_folder  # noqa: E402
from tests.tiny_tokenizers import MAKERS  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=96, help="images in the random ImageFolder (3 classes)")
    p.add_argument("--image-size", type=int, default=32, help="extraction size")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


def extract(images: Path, vae: Path, out: Path, size: int) -> float:
    """Run python -m extract; return its images/s."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            extract_main([str(a) for a in ("--data-path", images, "--out", out, "--vae", vae, "--image-size", size,
                                           "--num-workers", 0, "--batch-size", 32)])
        except SystemExit as stop:
            if stop.code:
                raise
    return float(re.search(r"\(([\d.]+) images/s", buffer.getvalue()).group(1))


def round_trip(vae: Tokenizer, ds: LatentDataset, norm: LatentNorm) -> float:
    """Largest pixel difference between decoding normalised-then-inverted stored latents and the raw decode."""
    z = ds.gather(np.arange(min(8, len(ds))), ("mean",))["mean"][:, 0].float()  # (n, C, h, w) raw
    return float((vae.decode(norm.apply(z), norm) - vae.decode_raw(z)).abs().max())


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-latents-"))
    try:
        images = make_image_folder(root / "images", per_class=args.images // 3, size=(args.image_size + 8,) * 2)
        print(f"{'tokenizer':<12} {'class':<20} {'latent':<10} {'norm (own)':<34} {'img/s':>7} {'B/img tar':>10} "
              f"{'B/img payload':>14} {'round trip own':>15} {'round trip channel':>19}")
        for name, make in MAKERS.items():
            vae_dir = make(root / name)
            rate = extract(images, vae_dir, root / f"lat-{name}", args.image_size)
            ds = LatentDataset(root / f"lat-{name}", progress=False)
            vae = load_tokenizer(vae_dir)
            tar = sum(s["size"] for s in ds.meta["shards"]) / len(ds)
            payload = ds.meta["layout"]["payload_size"]
            channel = ds.space.norms["channel"]
            c, h, w = ds.latent_shape
            print(f"{name:<12} {vae.kind.name:<20} {f'{c}x{h}x{w}':<10} {vae.norm.describe():<34} {rate:>7.1f} "
                  f"{tar:>10.0f} {payload:>14d} {round_trip(vae, ds, vae.norm):>15.2e} "
                  f"{round_trip(vae, ds, channel):>19.2e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
