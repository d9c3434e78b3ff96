"""Sampling throughput on this machine: DDPM 250 vs DDIM 50, guidance on vs off, VAE decode fp32 vs bf16 +- tiling.

Run: .venv/bin/python tests/bench/bench_sample.py [--model DiT-T/2 --input-size 8 --batch 8]
Random weights (speed does not depend on them); a random tiny VAE for decoding. Numbers are images/s,
best of --repeats, printed side by side with the ratio to the first row of each table.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.generative.guidance import guided_model_fn  # noqa: E402
from shared.sampling.image_draws import LabelPlan, batch_start  # noqa: E402
from shared.tokenizers.vae_match import load_vae  # noqa: E402
from shared.generative.objectives import DDPMObjective  # noqa: E402
from shared.network.models import DiT_models, ModelConfig  # noqa: E402
from tests.conftest import make_tiny_vae  # noqa: E402


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(DiT_models), default="DiT-T/2", help="DiT preset to time")
    p.add_argument("--input-size", type=int, default=8, help="latent side the DiT works on")
    p.add_argument("--num-classes", type=int, default=1000, help="classes of the random model")
    p.add_argument("--batch", type=int, default=4, help="images per sampling batch")
    p.add_argument("--ddpm-steps", type=int, default=250, help="DDPM steps (the paper's 250)")
    p.add_argument("--ddim-steps", type=int, default=50, help="DDIM steps")
    p.add_argument("--decode-size", type=int, default=32,
                   help="latent side for the decode test (must exceed the tiny VAE's 16-latent tile to tile)")
    p.add_argument("--decode-batch", type=int, default=8, help="latents per decode call")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per row; the best is kept (noisy CPUs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    return p.parse_args(argv)


def best_rate(fn, images: int, repeats: int, warmup: bool = True) -> float:
    """Images per second of fn() (best of `repeats`, after one warm-up call if asked)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return images / min(times)


def print_table(title: str, rows: list[tuple[str, float]]) -> None:
    """Rows of (name, images/s) with the ratio to the first row."""
    print(f"\n{title}")
    print(f"  {'setting':<34}{'images/s':>12}{'ratio':>9}")
    for name, rate in rows:
        print(f"  {name:<34}{rate:>12.2f}{rate / rows[0][1]:>8.2f}x")


def sampling_rows(args, device) -> tuple[list, list]:
    """(sampler rows, guidance rows): images/s of the diffusion loop alone (no decode)."""
    config = ModelConfig(args.model, input_size=args.input_size, num_classes=args.num_classes)
    model = config.build().eval().to(device)
    plan = LabelPlan(args.num_classes)
    indices = list(range(args.batch))
    shape = (config.in_channels, config.input_size, config.input_size)

    def run(sampler, steps, cfg):
        """One batch through the chosen sampler."""
        noise, labels, generators = batch_start(plan, 0, indices, shape)
        fn = guided_model_fn(model, cfg, 3, "fp32")
        with torch.inference_mode():
            DDPMObjective().sample(sampler, fn, noise.to(device), steps, {}, model_kwargs={"y": labels.to(device)},
                                   generator=generators)

    def rate(sampler, steps, cfg):
        """images/s of run(...)."""
        return best_rate(lambda: run(sampler, steps, cfg), args.batch, args.repeats, warmup=False)

    run("ddim", 2, 4.0)  # warm-up: first-call allocations and kernel selection
    ddpm, ddim = args.ddpm_steps, args.ddim_steps
    samplers = [(f"DDPM {ddpm} steps, cfg 4", rate("ddpm", ddpm, 4.0)),
                (f"DDIM {ddim} steps, cfg 4", rate("ddim", ddim, 4.0))]
    guidance = [(f"DDIM {ddim}, guidance on (cfg 4)", samplers[1][1]),
                (f"DDIM {ddim}, guidance off (cfg 1)", rate("ddim", ddim, 1.0))]
    return samplers, guidance


def decode_rows(args, device, vae_dir: Path) -> list:
    """images/s of VAE decode at fp32/bf16, without and with tiling."""
    latents = torch.randn(args.decode_batch, 4, args.decode_size, args.decode_size)
    rows = []
    for precision in ("fp32", "bf16"):
        for tiling in (False, True):
            vae = load_vae(str(vae_dir), None, device, precision, tiling, False)
            with torch.inference_mode():
                rate = best_rate(lambda: vae.decode(latents), args.decode_batch, args.repeats)
            rows.append((f"decode {precision}{' + tiling' if tiling else ''}", rate))
    return rows


def main(argv=None):
    """Time everything and print three tables."""
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"{args.model} latent {args.input_size}, batch {args.batch}, device {device}, "
          f"{torch.get_num_threads()} threads")
    samplers, guidance = sampling_rows(args, device)
    with tempfile.TemporaryDirectory() as tmp:
        decode = decode_rows(args, device, make_tiny_vae(Path(tmp) / "vae"))
    print_table("Sampler (diffusion loop only)", samplers)
    print_table("Classifier-free guidance (doubles the batch)", guidance)
    size = args.decode_size * 2
    print_table(f"VAE decode, tiny random VAE, {size}x{size} images (tiles of 32 px)", decode)


if __name__ == "__main__":
    main()
