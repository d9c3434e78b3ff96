"""Sample quality against model calls on the digits demo: DDPM, DDIM, DPM-Solver++(2M) and UniPC.

Run (after `python -m data.demo` has trained demo-out/run):
  .venv/bin/python tests/bench/bench_solvers.py --ckpt demo-out/run --vae data/vae-digits --out /tmp/bench-solvers \
      --plot docs/solvers.png
Each setting is one real `python -m sample ... --npz` run (the demo's cfg 4 with all channels guided) of
--num-samples images in one batch, scored by the Fréchet distance in the digits feature space
(evaluate.digits.digits_fd, issue 12; lower is better). The table prints each distance with its ratio to the
reference (DDPM 250) side by side, then the fewest steps at which each sampler is within --tolerance of it.
The noise floor is the same settings drawn again from other seeds (--floor): a ratio closer to 1 than the
floor's spread cannot be told apart from the reference. Rerunning resumes: `python -m sample` keeps the images
already in each folder, so finished settings cost only their scoring.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from shared.diffusion import SAMPLER_NAMES  # noqa: E402

# ~16 min on 2 shared CPU cores at 200 images: the digits DiT-T/2 costs ~8.6 ms per image per guided call
# (two rows), and DDPM 250 is half of the total.
DEFAULT_SETTINGS = "ddpm:25,50,250 ddim:10,20,50 dpmpp-2m:5,10,15,20 unipc:5,10,15,20"
DEFAULT_FLOOR = "ddim:10 unipc:20"  # drawn again with --floor-seed: the seed-to-seed spread of the distance


def parse_settings(text: str) -> list[tuple[str, int]]:
    """'ddpm:50,250 unipc:10' -> [("ddpm", 50), ("ddpm", 250), ("unipc", 10)]; names checked against SAMPLER_NAMES."""
    settings = []
    for group in text.split():
        name, _, steps = group.partition(":")
        if name not in SAMPLER_NAMES or not steps:
            raise SystemExit(f"bad setting {group!r}: write SAMPLER:STEPS[,STEPS...] with SAMPLER one of "
                             f"{', '.join(SAMPLER_NAMES)}")
        settings += [(name, int(k)) for k in steps.split(",")]
    return settings


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=str(ROOT / "demo-out" / "run"), help="trained digits run (python -m data.demo)")
    p.add_argument("--vae", default=str(ROOT / "data" / "vae-digits"), help="the digits VAE")
    p.add_argument("--out", default="/tmp/bench-solvers", help="folder of one sample folder per setting")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="SAMPLER:STEPS,... groups, space separated")
    p.add_argument("--reference", default="ddpm:250", help="the setting the others are compared with")
    p.add_argument("--floor", default=DEFAULT_FLOOR, help="settings drawn again from --floor-seed (noise floor)")
    p.add_argument("--num-samples", type=int, default=200,
                   help="images per setting (FD is biased upward at small N: compare at one N only)")
    p.add_argument("--batch-size", type=int, default=200, help="images per forward pass")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="guidance scale (the demo's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the main settings")
    p.add_argument("--floor-seed", type=int, default=1, help="seed of the noise-floor repeats")
    p.add_argument("--tolerance", type=float, default=0.05, help="'as good as the reference': FD <= (1 + tol) x")
    p.add_argument("--plot", default=None, help="write FD against model calls to this PNG")
    return p.parse_args(argv)


def sample_dir(args, name: str, steps: int, seed: int) -> Path:
    """The sample folder of one setting."""
    return Path(args.out) / f"{name}-{steps}-seed{seed}-n{args.num_samples}"


def draw(args, name: str, steps: int, seed: int) -> tuple[Path, float]:
    """Run `python -m sample` for one setting (resumes if already there); returns (npz path, seconds)."""
    out = sample_dir(args, name, steps, seed)
    cmd = [sys.executable, "-m", "sample", "--ckpt", args.ckpt, "--vae", args.vae, "--out", str(out), "--npz",
           "--sampler", name, "--num-sampling-steps", str(steps), "--cfg-scale", str(args.cfg_scale),
           "--guide-channels", "all", "--num-samples", str(args.num_samples), "--batch-size", str(args.batch_size),
           "--seed", str(seed), "--cpu"]
    start = time.perf_counter()
    done = (out / "samples.npz").exists()
    if not done:
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return out / "samples.npz", (None if done else time.perf_counter() - start)


def score(npz: Path) -> float:
    """Fréchet distance of samples.npz to the real digits in the digits feature space."""
    from evaluate.digits import digits_fd

    with np.load(npz) as data:
        return float(digits_fd(data["arr_0"]))


def measure(args) -> dict:
    """{"rows": [...], "floor": [...]} with sampler, steps, seed, fd, seconds; cached in OUT/results.json."""
    rows, floor = [], []
    main = parse_settings(args.settings)
    ref = parse_settings(args.reference)[0]
    for name, steps in ([ref] + [s for s in main if s != ref]):
        npz, seconds = draw(args, name, steps, args.seed)
        rows.append({"sampler": name, "steps": steps, "seed": args.seed, "fd": score(npz), "seconds": seconds})
        print(f"  {name:>9} {steps:>4} steps: FD {rows[-1]['fd']:.2f}", flush=True)
    for name, steps in parse_settings(args.floor):
        npz, seconds = draw(args, name, steps, args.floor_seed)
        again = next(r["fd"] for r in rows if (r["sampler"], r["steps"]) == (name, steps))
        fd = score(npz)
        floor.append({"sampler": name, "steps": steps, "seeds": [args.seed, args.floor_seed], "fd": [again, fd],
                      "spread": abs(fd - again) / min(fd, again)})
    results = {"reference": {"sampler": ref[0], "steps": ref[1]}, "rows": rows, "floor": floor,
               "num_samples": args.num_samples, "cfg_scale": args.cfg_scale, "tolerance": args.tolerance}
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def reference_fd(results: dict) -> float:
    """The reference setting's distance."""
    ref = results["reference"]
    return next(r["fd"] for r in results["rows"] if (r["sampler"], r["steps"]) == (ref["sampler"], ref["steps"]))


def fewest_steps(results: dict) -> dict:
    """Sampler -> the fewest steps whose FD <= (1 + tolerance) x the reference's (None if none is)."""
    limit = (1 + results["tolerance"]) * reference_fd(results)
    names = dict.fromkeys(r["sampler"] for r in results["rows"])
    return {name: min((r["steps"] for r in results["rows"] if r["sampler"] == name and r["fd"] <= limit),
                      default=None) for name in names}


def print_table(results: dict) -> None:
    """FD and its ratio to the reference, one column per sampler, rows = model calls; then the floor and verdicts."""
    ref = reference_fd(results)
    names = list(dict.fromkeys(r["sampler"] for r in results["rows"]))
    by = {(r["sampler"], r["steps"]): r["fd"] for r in results["rows"]}
    print(f"\nFD (digits features, {results['num_samples']} images, cfg {results['cfg_scale']:g}) and ratio to "
          f"{results['reference']['sampler']}-{results['reference']['steps']} (FD {ref:.2f})")
    print(f"{'model calls':>11}" + "".join(f"{name:>20}" for name in names))
    for steps in sorted({r["steps"] for r in results["rows"]}):
        cells = [f"{by[n, steps]:9.2f} ({by[n, steps] / ref:4.2f}x)" if (n, steps) in by else "" for n in names]
        print(f"{steps:>11}" + "".join(f"{c:>20}" for c in cells))
    for f in results["floor"]:
        print(f"noise floor: {f['sampler']}-{f['steps']} seeds {f['seeds']}: FD {f['fd'][0]:.2f} vs {f['fd'][1]:.2f} "
              f"({100 * f['spread']:.1f}% apart)")
    tol = results["tolerance"]
    for name, steps in fewest_steps(results).items():
        verdict = f"{steps} steps" if steps else "not reached in the steps tried"
        print(f"fewest steps within {100 * tol:.0f}% of the reference: {name:>9}: {verdict}")


def plot(results: dict, path: str) -> None:
    """FD against model calls (log x), one line per sampler, the reference and its tolerance band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ref = reference_fd(results)
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    for name in dict.fromkeys(r["sampler"] for r in results["rows"]):
        pts = sorted((r["steps"], r["fd"]) for r in results["rows"] if r["sampler"] == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.axhline(ref, color="k", lw=0.8, ls="--", label=f"{results['reference']['sampler']}-"
               f"{results['reference']['steps']}")
    ax.axhspan(ref, ref * (1 + results["tolerance"]), color="0.85", label=f"within {100 * results['tolerance']:.0f}%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model calls per image (guided: each is one doubled batch)")
    ax.set_ylabel("Fréchet distance (digits features)")
    ax.set_title(f"digits demo, {results['num_samples']} images per point, cfg {results['cfg_scale']:g}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(path)


def main(argv=None) -> None:
    """Measure (or resume), print the table, optionally plot."""
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = measure(args)
    print_table(results)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
