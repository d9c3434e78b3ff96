"""Sampling throughput, eager vs each speed option: the network loop and the VAE decode apart, and the hours of a
50,000-image FID batch at those rates.

Run: python tests/bench/bench_sample.py --preset cpu    (DiT-T/2 on 8x8 latents, a tiny random VAE: a smoke check)
     python tests/bench/bench_sample.py --preset gpu    (DiT-XL/2 on 32x32 latents = 256 px, batch 64, cfg 1.5,
                                                          DDPM 250 and DPM-Solver++(2M) 20, SD-VAE's architecture)
Random weights, nothing downloaded: speed does not depend on the weights' values. The network rows run the
sampling code path of `python -m sample` (per-row generators, GuidedModelFn, the objective's sampler,
compile_for_sampling); the decode rows run Tokenizer.decode_raw. The decode error columns compare each
precision's uint8 pixels with the fp32 decode of the same latents; on random weights they say little about a
trained decoder (docs/performance.md: the tiny random VAEs err more than the trained digits VAE).
"""
import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.generative.guidance import GuidedModelFn  # noqa: E402
from shared.generative.diffusion import DDPMObjective  # noqa: E402
from shared.network.models import DiT_models, ModelConfig  # noqa: E402
from shared.runtime.precision import PRECISIONS, set_tf32  # noqa: E402
from shared.sampling.compiled import COMPILE_MODES, compile_for_sampling  # noqa: E402
from shared.sampling.plan import LabelPlan  # noqa: E402
from shared.sampling.generate import batch_start
from shared.tokenizers.tokenizer import to_uint8  # noqa: E402
from shared.tokenizers.tokenizer import Tokenizer  # noqa: E402

FID_IMAGES = 50_000  # the DiT paper's FID-50K
# The architecture of stabilityai/sd-vae-ft-ema (the DiT release's VAE): 4 levels, 8x downsampling, 4 channels.
SD_VAE_ARCH = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, norm_num_groups=32)
TINY_VAE_ARCH = dict(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8)
PRESETS = {
    "cpu": dict(model="DiT-T/2", input_size=8, batch=4, ddpm_steps=250, solver_steps=20, vae="tiny",
                options=("fp32", "bf16")),
    "gpu": dict(model="DiT-XL/2", input_size=32, batch=64, ddpm_steps=250, solver_steps=20, vae="sd",
                options=("fp32", "bf16", "bf16+blocks", "bf16+graphs")),
}


@dataclass
class Option:
    """One network setting: autocast precision and compile mode (shared/sampling/compiled.py)."""

    precision: str
    compile: str = "off"

    @classmethod
    def parse(cls, text: str) -> "Option":
        """'bf16' or 'bf16+blocks' -> Option."""
        precision, _, mode = text.partition("+")
        if precision not in PRECISIONS or (mode or "off") not in COMPILE_MODES:
            raise SystemExit(f"option {text!r}: PRECISION[+COMPILE] with PRECISION in {list(PRECISIONS)} and "
                             f"COMPILE in {list(COMPILE_MODES)}")
        return cls(precision, mode or "off")

    @property
    def name(self) -> str:
        return self.precision if self.compile == "off" else f"{self.precision} + compile {self.compile}"


def parse_args(argv=None):
    """Benchmark options; a preset fills what is not given."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=list(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu",
                   help="sizes and options to time (default: gpu where CUDA is present, else cpu)")
    p.add_argument("--model", choices=list(DiT_models), help="DiT preset to time")
    p.add_argument("--input-size", type=int, help="latent side the DiT works on (32 = 256 px with SD-VAE)")
    p.add_argument("--batch", type=int, help="images per sampling batch (guidance doubles the network's rows)")
    p.add_argument("--cfg-scale", type=float, default=1.5, help="guidance scale (1.5: the DiT paper's FID setting)")
    p.add_argument("--ddpm-steps", type=int, help="DDPM steps (the paper's 250); 0 leaves DDPM out")
    p.add_argument("--solver-steps", type=int, help="DPM-Solver++(2M) steps; 0 leaves it out")
    p.add_argument("--options", nargs="+", metavar="PRECISION[+COMPILE]",
                   help="network settings after eager fp32, e.g. bf16 fp16 bf16+blocks bf16+graphs")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the compile rows (inductor on CUDA; aot_eager to smoke-test the "
                        "compiled path on the CPU, where its speed means nothing)")
    p.add_argument("--vae", choices=("tiny", "sd"), help="decoder timed: a tiny random VAE or SD-VAE's architecture")
    p.add_argument("--decode-batch", type=int, help="latents per decode call (default: --batch)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per row; the best is kept (noisy CPUs)")
    p.add_argument("--json", type=Path, help="also write every row to this JSON file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--threads", type=int, help="CPU threads of torch (default: torch's; 1 on a loaded machine, where "
                                               "oversubscribed threads wait on each other)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.options = [Option("fp32")] + [Option.parse(o) for o in args.options if o != "fp32"]
    args.decode_batch = args.decode_batch or args.batch
    return args


def synchronize(device) -> None:
    """Wait for the device's queued work, so a timer reads the work done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device, repeats: int) -> float:
    """Seconds of fn(), best of `repeats`."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


# ---- the network: the sampling loop without decode ------------------------------------------------------------

def sampling_runs(args) -> list[tuple[str, str, int]]:
    """(label, sampler, steps) of each timed sampler."""
    runs = [(f"DDPM {args.ddpm_steps}", "ddpm", args.ddpm_steps),
            (f"DPM-Solver++(2M) {args.solver_steps}", "dpmpp-2m", args.solver_steps)]
    return [run for run in runs if run[2] > 0]


def network_for(model, option: Option, backend: str):
    """The model as the sampling loop calls it under `option` (blocks mode compiles a copy in place)."""
    if option.compile == "blocks":
        model = copy.deepcopy(model)
    return compile_for_sampling(model, option.compile, backend)


def option_rows(args, model, config, device, option: Option) -> list[dict]:
    """images/s of the guided sampling loop per sampler under `option`, with the first call's (compile) seconds."""
    plan, indices = LabelPlan(config.num_classes), list(range(args.batch))
    shape = (config.in_channels, config.input_size, config.input_size)
    objective = DDPMObjective()
    fn = GuidedModelFn(network_for(model, option, args.backend), args.cfg_scale, None, option.precision)

    @torch.inference_mode()
    def draw(sampler, steps):
        """One batch through `sampler`, as Drawer.draw runs it (noise and generators per row)."""
        noise, labels, generators = batch_start(plan, 0, indices, shape)
        objective.sample(sampler, fn, noise.to(device), steps, {}, model_kwargs={"y": labels.to(device)},
                         generator=generators)

    first_s = best_seconds(lambda: draw("ddim", 2), device, 1)  # builds every kernel (and graph) of the shape
    return [dict(sampler=label, option=option.name, first_call_s=first_s,
                 images_per_s=args.batch / best_seconds(lambda: draw(sampler, steps), device, args.repeats))
            for label, sampler, steps in sampling_runs(args)]


def network_rows(args, model, config, device) -> list[dict]:
    """option_rows of every option; an option that fails (a compile error, out of memory) becomes error rows."""
    rows = []
    for option in args.options:
        try:
            rows.extend(option_rows(args, model, config, device, option))
        except Exception as err:  # noqa: BLE001 - one failing option must not cost the others' numbers
            message = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            rows.extend(dict(sampler=label, option=option.name, error=message) for label, _, _ in sampling_runs(args))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- the decoder ----------------------------------------------------------------------------------------------

def build_vae(kind: str, device, dtype) -> Tokenizer:
    """A random AutoencoderKL of the chosen architecture (seed 0: every precision decodes the same weights)."""
    from diffusers import AutoencoderKL

    arch = SD_VAE_ARCH if kind == "sd" else TINY_VAE_ARCH
    levels = len(arch["block_out_channels"])
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
                        up_block_types=("UpDecoderBlock2D",) * levels, **arch)
    return Tokenizer(vae, f"random {kind} VAE", device, dtype)


def build_vae_factor(kind: str) -> int:
    """Pixels per latent side of the chosen VAE architecture (2 per level after the first)."""
    arch = SD_VAE_ARCH if kind == "sd" else TINY_VAE_ARCH
    return 2 ** (len(arch["block_out_channels"]) - 1)


def pixel_error(reference: np.ndarray, other: np.ndarray) -> dict:
    """uint8 images vs reference: max |difference|, PSNR (dB, inf when equal), fraction of values off by > 1 level."""
    diff = np.abs(reference.astype(np.int16) - other.astype(np.int16))
    mse = float(np.mean(diff.astype(np.float64) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
    return {"max_abs": int(diff.max()), "psnr_db": psnr, "over_1_level": float(np.mean(diff > 1))}


def decode_rows(args, config, device) -> list[dict]:
    """images/s of Tokenizer.decode_raw per precision, and its pixel error against the fp32 decode."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(args.decode_batch, config.in_channels, config.input_size, config.input_size, generator=gen)
    rows, reference = [], None
    for precision in ("fp32", "bf16"):
        vae = build_vae(args.vae, device, PRECISIONS[precision])
        with torch.inference_mode():
            pixels = to_uint8(vae.decode_raw(z))  # warm-up, and the pixels compared
            seconds = best_seconds(lambda v=vae: v.decode_raw(z), device, args.repeats)
        reference = pixels if reference is None else reference
        rows.append(dict(precision=precision, images_per_s=args.decode_batch / seconds,
                         **pixel_error(reference, pixels)))
        del vae
    return rows


# ---- the FID batch --------------------------------------------------------------------------------------------

def fid_rows(network: list[dict], decode: list[dict]) -> list[dict]:
    """Each network row with each decode precision: images/s of both in turn (as Drawer.draw runs them) and the
    hours FID_IMAGES take at that rate."""
    rows = []
    for net in (r for r in network if "error" not in r):
        for dec in decode:
            rate = 1.0 / (1.0 / net["images_per_s"] + 1.0 / dec["images_per_s"])
            rows.append(dict(sampler=net["sampler"], option=net["option"], decode=dec["precision"],
                             images_per_s=rate, fid_hours=FID_IMAGES / rate / 3600))
    return rows


# ---- printing -------------------------------------------------------------------------------------------------

def print_network(rows: list[dict]) -> None:
    """Network rows per sampler, each with its ratio to eager fp32 of that sampler (error rows say why)."""
    print("\nNetwork: the guided sampling loop, no decode (first call: the warm-up, compile included)")
    print(f"  {'sampler':<24}{'setting':<26}{'images/s':>11}{'vs fp32':>9}{'first call s':>14}")
    base = {}
    for r in rows:
        if "error" in r:
            print(f"  {r['sampler']:<24}{r['option']:<26}  failed: {r['error']}")
            continue
        base.setdefault(r["sampler"], r["images_per_s"])
        print(f"  {r['sampler']:<24}{r['option']:<26}{r['images_per_s']:>11.2f}"
              f"{r['images_per_s'] / base[r['sampler']]:>8.2f}x{r['first_call_s']:>14.1f}")


def print_decode(rows: list[dict], vae: str, size: int) -> None:
    """Decode rows with their error against fp32."""
    print(f"\nVAE decode: random {vae} VAE, {size}x{size} px; error of the uint8 pixels against the fp32 decode")
    print(f"  {'precision':<12}{'images/s':>11}{'vs fp32':>9}{'max |diff|':>12}{'PSNR dB':>10}{'> 1 level':>11}")
    for r in rows:
        print(f"  {r['precision']:<12}{r['images_per_s']:>11.2f}{r['images_per_s'] / rows[0]['images_per_s']:>8.2f}x"
              f"{r['max_abs']:>12d}{r['psnr_db']:>10.1f}{100 * r['over_1_level']:>10.3f}%")


def print_fid(rows: list[dict]) -> None:
    """The FID batch's hours per (sampler, setting, decode)."""
    print(f"\n{FID_IMAGES:,} images (FID): network then decode per batch, one device")
    print(f"  {'sampler':<24}{'setting':<26}{'decode':<8}{'images/s':>11}{'hours':>10}")
    for r in rows:
        print(f"  {r['sampler']:<24}{r['option']:<26}{r['decode']:<8}{r['images_per_s']:>11.2f}"
              f"{r['fid_hours']:>10.2f}")


def main(argv=None):
    """Time every row, print three tables (and write --json)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    set_tf32(device)  # as python -m sample (TF32 on by default, as the DiT release)
    config = ModelConfig(args.model, input_size=args.input_size, num_classes=1000)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{args.model} on {args.input_size}x{args.input_size} latents, batch {args.batch}, cfg {args.cfg_scale:g}, "
          f"{device} ({where}), torch {torch.__version__}")
    torch.manual_seed(0)
    model = config.build(device=device).eval().requires_grad_(False)
    network = network_rows(args, model, config, device)
    del model
    decode = decode_rows(args, config, device)
    fid = fid_rows(network, decode)
    print_network(network)
    print_decode(decode, args.vae, args.input_size * build_vae_factor(args.vae))
    print_fid(fid)
    if args.json:
        settings = {k: (v if not isinstance(v, (Path, list)) else str(v)) for k, v in vars(args).items()}
        settings["options"] = [asdict(o) for o in args.options]
        args.json.write_text(json.dumps({"settings": settings, "network": network, "decode": decode, "fid": fid},
                                        indent=2))


if __name__ == "__main__":
    main()
