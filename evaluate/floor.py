"""`python -m evaluate.floor`: the digits Fréchet distance of real digits, the floor a perfect model would score.

An FD from N images is biased upwards by the noise of its covariance, so a sampler's digits FD is read against real
digits at the same N; with --vae, also after that VAE's round trip (the floor of a DiT trained on its latents).
"""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from shared.runtime.cli import HelpFormatter, add_flags, from_args, option
from shared.runtime.errors import UserError, cli_errors

PROG = "python -m evaluate.floor"


def floor_table(counts, draws: int, seed: int, vae_spec: str | None = None) -> list[tuple[str, float, float]]:
    """(what, mean FD, std FD) rows: N real digits vs all for each count, half vs half, then N via the VAE vs all."""
    from evaluate.digits import digits_fd, real_digits, real_features, real_stats
    from evaluate.metrics import frechet_distance_of, frechet_distance_to
    features = real_features()  # (1797, 64)
    mu, sigma = real_stats()
    rng, n, rows = np.random.default_rng(seed), len(features), []
    for count in counts:
        if not 2 <= count <= n:
            raise UserError(f"--counts {count}: each count must lie in 2..{n} (the real digits).")
        values = [frechet_distance_to(features[rng.permutation(n)[:count]], mu, sigma) for _ in range(draws)]
        rows.append((f"{count} real vs all {n}", float(np.mean(values)), float(np.std(values))))
    half = n // 2
    halves = [frechet_distance_of(*np.split(features[rng.permutation(n)], [half])) for _ in range(draws)]
    rows.append((f"half vs half ({half} / {n - half})", float(np.mean(halves)), float(np.std(halves))))
    if vae_spec:
        decoded = vae_round_trip(real_digits()[0], vae_spec)
        rng = np.random.default_rng(seed)
        for count in counts:
            values = [digits_fd(decoded[rng.permutation(len(decoded))[:count]]) for _ in range(draws)]
            rows.append((f"{count} via VAE vs all", float(np.mean(values)), float(np.std(values))))
    return rows


def vae_round_trip(images: np.ndarray, vae_spec: str, batch_size: int = 256) -> np.ndarray:
    """uint8 images (N, H, W, 3) encoded to their posterior mean and decoded by the VAE: uint8 (N, H, W, 3)."""
    import torch

    from shared.tokenizers.tokenizer import LatentNorm, channels_first
    from shared.tokenizers.locate import load_tokenizer
    from shared.datasets.shards import draw_latents
    vae = load_tokenizer(vae_spec)
    if vae.image_size is not None and vae.image_size != images.shape[1]:  # an RAE resizes, then draws its own size
        raise UserError(f"{vae_spec} encodes and decodes {vae.image_size}x{vae.image_size} images only, but the "
                        f"digits are {images.shape[1]}x{images.shape[2]}; pass a tokenizer made for "
                        f"{images.shape[1]} px images as --vae.")
    norm = vae.norm or LatentNorm.none(source=f"{vae_spec} records no normalisation")
    out = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            x = channels_first(images[start:start + batch_size])  # (b, 3, H, W) in [-1, 1]
            mean, _ = vae.encode_moments(x)  # (b, C, h, w), raw
            latents = draw_latents(mean, None, norm)  # (b, C, h, w) normalised: what the DiT learns and samples
            out.append(vae.decode_uint8(latents, norm))  # (b, H, W, 3)
    return np.concatenate(out)


@dataclass
class FloorOptions:
    """Everything `python -m evaluate.floor` accepts (one field per flag: its default and help)."""
    counts: tuple = option((30, 100, 200, 500, 1000), "sample counts N to measure the floor at", type=int, nargs="+")
    draws: int = option(10, "random draws per count (mean and std are printed)", min=1)
    seed: int = option(0, "seed of the draws")
    vae: str | None = option(None, "also measure real digits after this VAE's encode/decode round trip, e.g. "
                                   "data/vae-digits (default: not measured)")


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    return add_flags(argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1],
                                             formatter_class=HelpFormatter), FloorOptions)


@interruptible(PROG)
def main(argv=None) -> None:
    """Print the floor table."""
    with cli_errors(PROG):
        args = from_args(FloorOptions, build_parser().parse_args(argv))
        for what, mean, std in floor_table(args.counts, args.draws, args.seed, args.vae):
            print(f"{what:<28} digits FD {mean:8.2f} ± {std:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
