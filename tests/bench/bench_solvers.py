"""Sample quality against model calls on the digits demo: DDPM, DDIM, DPM-Solver++(2M) and UniPC.

Run (after `python -m data.demo` has trained demo-out/run):
  .venv/bin/python tests/bench/bench_solvers.py --ckpt demo-out/run --vae data/vae-digits --out /tmp/bench-solvers \
      --plot docs/solvers.png
Each setting is one real `python -m sample ... --npz` run (the demo's cfg 4 with all channels guided) of
--num-samples images in one batch, scored by the Fréchet distance in the digits feature space
(evaluate.digits.digits_fd, issue 12; lower is better). The table prints each distance with its ratio to the
reference (DDPM 250) side by side, then the fewest steps at which each sampler is within --tolerance of it
(either side). The noise floor is the same settings drawn again from other seeds (--floor): a ratio closer to 1
than the floor's spread cannot be told apart from the reference.

Under strong guidance the deterministic samplers (DDIM at eta 0 and the ODE solvers) converge to another
distribution than ancestral DDPM, so their FD need not fall with more steps. The second table therefore
measures convergence itself: DDIM and the solvers integrate the same probability-flow ODE from the same noise
(image i's noise depends only on the seed and i), so each image is compared with the same image from
--ode-reference (a many-step solve): the RMS pixel difference in grey levels (0-255).
Rerunning resumes: `python -m sample` keeps the images already in each folder, so finished settings cost only
their scoring.
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
from shared.generative.samplers import sampler_names  # noqa: E402

# ~16 min on 2 shared CPU cores at 200 images: the digits DiT-T/2 costs ~8.6 ms per image per guided call
# (two rows), and DDPM 250 is half of the total.
DEFAULT_SETTINGS = "ddpm:25,50,250 ddim:10,20,50 dpmpp-2m:5,10,15,20 unipc:5,10,15,20"
DEFAULT_FLOOR = "ddim:10 unipc:20"  # drawn again with --floor-seed: the seed-to-seed spread of the distance
DETERMINISTIC = ("ddim", "dpmpp-2m", "unipc")  # ODE samplers (DDIM at eta 0): same noise, same limit


def parse_settings(text: str) -> list[tuple[str, int]]:
    """'ddpm:50,250 unipc:10' -> [("ddpm", 50), ("ddpm", 250), ("unipc", 10)]; names checked against sampler_names()."""
    settings = []
    for group in text.split():
        name, _, steps = group.partition(":")
        if name not in sampler_names() or not steps:
            raise SystemExit(f"bad setting {group!r}: write SAMPLER:STEPS[,STEPS...] with SAMPLER one of "
                             f"{', '.join(sampler_names())}")
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
    p.add_argument("--ode-reference", default="dpmpp-2m:100",
                   help="many-step ODE solve the deterministic samplers' images are compared with")
    p.add_argument("--num-samples", type=int, default=200,
                   help="images per setting (FD is biased upward at small N: compare at one N only)")
    p.add_argument("--batch-size", type=int, default=200, help="images per forward pass")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="guidance scale (the demo's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the main settings")
    p.add_argument("--floor-seed", type=int, default=1, help="seed of the noise-floor repeats")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="'within' the reference: |FD / FD_ref - 1| <= tolerance")
    p.add_argument("--plot", default=None, help="write FD against model calls to this PNG")
    return p.parse_args(argv)


def sample_dir(args, name: str, steps: int, seed: int) -> Path:
    """The sample folder of one setting."""
    return Path(args.out) / f"{name}-{steps}-seed{seed}-n{args.num_samples}"


def draw(args, name: str, steps: int, seed: int) -> tuple[Path, float]:
    """Run `python -m sample` for one setting (resumed if already there); returns (npz path, seconds it took)."""
    out = sample_dir(args, name, steps, seed)
    cmd = [sys.executable, "-m", "sample", "--ckpt", args.ckpt, "--vae", args.vae, "--out", str(out), "--npz",
           "--sampler", name, "--num-sampling-steps", str(steps), "--cfg-scale", str(args.cfg_scale),
           "--guide-channels", "all", "--num-samples", str(args.num_samples), "--batch-size", str(args.batch_size),
           "--seed", str(seed), "--cpu"]
    timing = out / "bench-seconds.json"  # kept beside the samples, so a resumed run still reports the time
    if not (out / "samples.npz").exists():
        start = time.perf_counter()
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
        timing.write_text(json.dumps({"seconds": time.perf_counter() - start}))
    seconds = json.loads(timing.read_text())["seconds"] if timing.exists() else None
    return out / "samples.npz", seconds


def score(npz: Path) -> float:
    """Fréchet distance of samples.npz to the real digits in the digits feature space."""
    from evaluate.digits import digits_fd

    with np.load(npz) as data:
        return float(digits_fd(data["arr_0"]))


def pixel_gap(npz: Path, reference: Path) -> float:
    """RMS difference in grey levels between the same images (same seed and index) of two samples.npz."""
    with np.load(npz) as a, np.load(reference) as b:
        if not np.array_equal(a["labels"], b["labels"]):
            raise SystemExit(f"{npz} and {reference} hold different labels: not the same images")
        return float(np.sqrt(np.mean((a["arr_0"].astype(np.float64) - b["arr_0"].astype(np.float64)) ** 2)))


def measure(args) -> dict:
    """Every setting drawn (or resumed) and scored; the results are also written to OUT/results.json."""
    rows, floor = [], []
    ref = parse_settings(args.reference)[0]
    ode = parse_settings(args.ode_reference)[0]
    ode_npz, _ = draw(args, *ode, args.seed)
    for name, steps in ([ref] + [s for s in parse_settings(args.settings) if s != ref]):
        npz, seconds = draw(args, name, steps, args.seed)
        gap = pixel_gap(npz, ode_npz) if name in DETERMINISTIC else None
        rows.append({"sampler": name, "steps": steps, "seed": args.seed, "fd": score(npz), "ode_gap": gap,
                     "seconds": seconds})
        print(f"  {name:>9} {steps:>4} steps: FD {rows[-1]['fd']:.2f}"
              + (f", {gap:.2f} grey levels from {ode[0]}-{ode[1]}" if gap is not None else ""), flush=True)
    for name, steps in parse_settings(args.floor):
        npz, seconds = draw(args, name, steps, args.floor_seed)
        again = next(r["fd"] for r in rows if (r["sampler"], r["steps"]) == (name, steps))
        fd = score(npz)
        floor.append({"sampler": name, "steps": steps, "seeds": [args.seed, args.floor_seed], "fd": [again, fd],
                      "spread": abs(fd - again) / min(fd, again)})
    results = {"reference": {"sampler": ref[0], "steps": ref[1]}, "rows": rows, "floor": floor,
               "ode_reference": {"sampler": ode[0], "steps": ode[1], "fd": score(ode_npz)},
               "num_samples": args.num_samples, "cfg_scale": args.cfg_scale, "tolerance": args.tolerance}
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def reference_fd(results: dict) -> float:
    """The reference setting's distance."""
    ref = results["reference"]
    return next(r["fd"] for r in results["rows"] if (r["sampler"], r["steps"]) == (ref["sampler"], ref["steps"]))


def fewest_steps(results: dict, ref: float, names) -> dict:
    """Sampler -> the fewest steps whose FD is within the tolerance of `ref`, either side (None: never)."""
    tol = results["tolerance"]
    return {name: min((r["steps"] for r in results["rows"] if r["sampler"] == name
                       and abs(r["fd"] / ref - 1) <= tol), default=None) for name in names}


def print_table(results: dict) -> None:
    """FD with its ratio to the reference and the gap to the ODE solution, one column per sampler; floor, verdicts."""
    ref, ode = reference_fd(results), results["ode_reference"]
    names = list(dict.fromkeys(r["sampler"] for r in results["rows"]))
    by = {(r["sampler"], r["steps"]): r for r in results["rows"]}
    all_steps = sorted({r["steps"] for r in results["rows"]})
    print(f"\nFD (digits features, {results['num_samples']} images, cfg {results['cfg_scale']:g}) and ratio to "
          f"{results['reference']['sampler']}-{results['reference']['steps']} (FD {ref:.2f})")
    print(f"{'model calls':>11}" + "".join(f"{name:>20}" for name in names))
    for steps in all_steps:
        cells = [f"{by[n, steps]['fd']:9.2f} ({by[n, steps]['fd'] / ref:4.2f}x)" if (n, steps) in by else ""
                 for n in names]
        print(f"{steps:>11}" + "".join(f"{c:>20}" for c in cells))
    ode_names = [n for n in names if n in DETERMINISTIC]
    print(f"\nRMS difference (grey levels, 0-255) to the same images from {ode['sampler']}-{ode['steps']} "
          f"(FD {ode['fd']:.2f})")
    print(f"{'model calls':>11}" + "".join(f"{name:>12}" for name in ode_names))
    for steps in all_steps:
        cells = [f"{by[n, steps]['ode_gap']:.2f}" if (n, steps) in by else "" for n in ode_names]
        if any(cells):
            print(f"{steps:>11}" + "".join(f"{c:>12}" for c in cells))
    for f in results["floor"]:
        print(f"noise floor: {f['sampler']}-{f['steps']} seeds {f['seeds']}: FD {f['fd'][0]:.2f} vs {f['fd'][1]:.2f} "
              f"({100 * f['spread']:.1f}% apart)")
    tol = results["tolerance"]
    targets = [(f"{results['reference']['sampler']}-{results['reference']['steps']}", ref, names),
               (f"the ODE solution ({ode['sampler']}-{ode['steps']})", ode["fd"], ode_names)]
    for target, value, which in targets:
        print(f"fewest steps with FD within {100 * tol:.0f}% of {target}, FD {value:.2f}:")
        for name, steps in fewest_steps(results, value, which).items():
            print(f"  {name:>9}: {f'{steps} steps' if steps else 'not reached in the steps tried'}")


def plot(results: dict, path: str) -> None:
    """Two panels against model calls (log x): FD with the reference band, and the gap to the ODE solution."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ref, tol, ode = reference_fd(results), results["tolerance"], results["ode_reference"]
    names = list(dict.fromkeys(r["sampler"] for r in results["rows"]))
    fig = Figure(figsize=(10, 3.8), dpi=90)
    left, right = fig.subplots(1, 2)
    for i, name in enumerate(names):
        rows = sorted((r for r in results["rows"] if r["sampler"] == name), key=lambda r: r["steps"])
        style = dict(marker="o", label=name, color=f"C{i}")
        left.plot([r["steps"] for r in rows], [r["fd"] for r in rows], **style)
        if name in DETERMINISTIC:
            right.plot([r["steps"] for r in rows], [r["ode_gap"] for r in rows], **style)
    label = f"{results['reference']['sampler']}-{results['reference']['steps']}"
    left.axhline(ref, color="k", lw=0.8, ls="--", label=label)
    left.axhspan(ref * (1 - tol), ref * (1 + tol), color="0.88", label=f"{label} ± {100 * tol:.0f}%")
    left.axhline(ode["fd"], color="0.3", lw=0.8, ls=":", label=f"{ode['sampler']}-{ode['steps']} (ODE solution)")
    left.set_ylabel("Fréchet distance (digits features)")
    left.set_title(f"FD, {results['num_samples']} images per point, cfg {results['cfg_scale']:g}", fontsize=10)
    right.set_yscale("log")
    right.yaxis.set_major_formatter(ScalarFormatter())
    right.yaxis.set_minor_formatter(NullFormatter())
    right.set_ylabel("RMS pixel difference (grey levels)")
    right.set_title(f"distance to the same images from {ode['sampler']}-{ode['steps']}", fontsize=10)
    right.set_yticks([1, 2, 5, 10])
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["steps"] for r in results["rows"]}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("model calls per image (each one doubled batch with guidance)")
        ax.legend(fontsize=7, loc="best" if ax is left else "upper right")  # FD curves move with cfg
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
