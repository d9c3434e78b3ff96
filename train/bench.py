"""`python -m train.bench`: time DiT training steps on synthetic latents (no shards, no VAE).

Each configuration gets a fresh learner from train/step.py, timed on the trainer's own `train_step` over synthetic
micro-batches; warm-up (and compilation) excluded, the median of the timed steps reported, each bracketed by device
syncs. MFU = 6 x forward MACs per image (recomputation not counted) x images/s / device peak FLOP/s.
"""
from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import importlib.util
import itertools
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

from shared.runtime.cli import Flag, argument_of, check_bounds
from shared.runtime.errors import UserError, cli_errors
from shared.runtime.fsio import atomic_write_json
from shared.network.attention import ATTENTION_BACKENDS
from shared.network.blocks import SELECTIVE
from shared.runtime.precision import PRECISIONS, set_tf32
from train.config import BLOCK_FLAGS, TrainConfig, add_block_flags, block_from_args, checkpoint_value, model_config_for
from train.memory import (DEFAULT_MARGIN, CudaAllocator, fixed_state, forward_macs, latent_shape, measure_device,
                          measure_profiles, measured_config, plan_row, synthetic_batch, train_flops_per_image)
from train.step import make_learner, train_step
from train.units import GiB, format_size, parse_size

PROG = "python -m train.bench"
FLAGS = {"model preset": "--model", "attention backend": "--attention", "precision": "--precisions", **BLOCK_FLAGS}
# Dense tensor-core peaks in TFLOP/s for 16-bit inputs (vendor datasheets; GeForce figures with fp16
# accumulation, about half with fp32 accumulation; H100/H200 SXM). First substring of
# torch.cuda.get_device_name() that matches, in this order (A100 before A10, L40S before L40 before L4).
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10": 125.0, "L40S": 362.0, "L40": 181.0,
                     "L4": 121.0, "RTX 4090": 165.2, "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0}


@dataclass(frozen=True)
class BenchConfig:
    """One cell of the matrix."""
    precision: str      # fp32 | fp16 | bf16
    checkpoint: int | str  # 0 = off, k = every k-th block, "selective"
    attention: str      # sdpa | math | xformers
    compile: bool
    micro_batch: int
    note: str = ""
    host_sync: bool = False  # read loss, grad norm and the skip flag every step, as the loop did before issue 34
    adamw: str = "fused"     # fused (the trainer's) | foreach (for comparison)

    def label(self) -> str:
        """Short row name."""
        parts = [self.precision, f"ckpt={self.checkpoint}", self.attention, f"mb={self.micro_batch}"]
        parts += ["compile"] if self.compile else []
        parts += ["sync"] if self.host_sync else []
        parts += [self.adamw] if self.adamw != "fused" else []
        return " ".join(parts) + (f" ({self.note})" if self.note else "")


@dataclass
class BenchResult:
    """Measured numbers of one configuration (error set instead when it could not run)."""
    config: BenchConfig
    step_s: float | None = None
    images_s: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    mfu: float | None = None
    error: str | None = None
    compile_s: float | None = None  # compile rows: the first step's seconds beyond the median step (tracing, kernels)
    recompiles: int | None = None   # compile rows: frames dynamo compiled in the timed steps after the first step


PRESETS = {
    # One thread on the CPU: with more, a busy machine stalls every parallel region (we saw 10x swings).
    "cpu": dict(model="DiT-T/2", image_size=128, steps=8, warmup=2, threads=1),
    "gpu": dict(model="DiT-XL/2", image_size=256, steps=10, warmup=3, threads=None),
    "changes-cpu": dict(model="DiT-T/2", image_size=128, steps=4, warmup=2, threads=1),
    # warm-up 3: the compiled rows trace and build their kernels in the first step
    "changes-gpu": dict(model="DiT-XL/2", image_size=256, steps=10, warmup=3, threads=None),
}
CHANGES_GPU_MICRO = 256  # issue 34's micro-batch: ~100 GiB at DiT-XL/2 256 px without checkpointing


def variant(base: BenchConfig, note: str, **changes) -> BenchConfig:
    """`base` with some fields changed, labelled by what changed."""
    return BenchConfig(**{**asdict(base), **changes, "note": note})


def optional_rows(ours: BenchConfig) -> list[BenchConfig]:
    """Rows that only make sense where the software is present (xformers; off CUDA its row says why), then compile."""
    rows = [variant(ours, "xformers", attention="xformers")] if importlib.util.find_spec("xformers") else []
    return rows + [variant(ours, "torch.compile", compile=True)]


def change_rows(today: BenchConfig) -> list[BenchConfig]:
    """Issue 34's changes beside the step before them (`today`): each alone, then all of them together."""
    now = variant(today, "no host sync, fused AdamW", host_sync=False, adamw="fused")
    return [today, now, variant(now, "foreach AdamW instead of fused", adamw="foreach"),
            variant(now, "regional compile", compile=True),
            variant(now, "selective checkpointing", checkpoint=SELECTIVE),
            variant(now, "checkpointing every block", checkpoint=1),
            variant(now, "all: compile + selective", compile=True, checkpoint=SELECTIVE)]


def preset_matrix(name: str) -> list[BenchConfig]:
    """cpu: quick ablation on a tiny model; gpu: DiT-XL/2 mirroring fast-DiT's README; changes-*: change_rows."""
    if name == "changes-cpu":  # fp32: the development CPU has no bf16 units (bf16 is ~9x slower there)
        return change_rows(BenchConfig("fp32", 0, "sdpa", False, 8, "before issue 34", host_sync=True, adamw="foreach"))
    if name == "changes-gpu":  # the bf16 micro-batch 256 at most; plan_changes_micro fits it to the card
        return change_rows(BenchConfig("bf16", 0, "sdpa", False, CHANGES_GPU_MICRO, "before issue 34", host_sync=True))
    if name == "cpu":
        ours = BenchConfig("bf16", 1, "sdpa", False, 8, "ours")
        return [ours, variant(ours, "checkpointing off", checkpoint=0),
                variant(ours, "math attention", attention="math"), variant(ours, "no autocast", precision="fp32"),
                variant(ours, "fp16 + GradScaler", precision="fp16"),
                *optional_rows(ours), *(variant(ours, "micro-batch sweep", micro_batch=m) for m in (4, 16))]
    # fast-DiT README (one A100, batch 128, claimed): "checkpointing only" 0.43 steps/s, then "+ mixed
    # precision" 0.56; features are always pre-extracted here. Micro-batch 32 so fp32 fits 24 GiB.
    baseline = BenchConfig("fp32", 1, "sdpa", False, 32, "fast-DiT: checkpointing only")
    ours = BenchConfig("bf16", 1, "sdpa", False, 32, "ours: + mixed precision")
    return [baseline, ours, variant(ours, "fp16 + GradScaler", precision="fp16"),
            variant(ours, "checkpointing every 2nd block", checkpoint=2),
            variant(ours, "checkpointing off", checkpoint=0),
            variant(ours, "checkpointing off", checkpoint=0, micro_batch=8),
            variant(ours, "math attention", attention="math"), *optional_rows(ours),
            *(variant(ours, "micro-batch sweep", micro_batch=m) for m in (16, 64, 128))]


def split_list(text: str, kind=str) -> list:
    """'a,b,c' -> [a, b, c] converted by kind; UserError on a bad item."""
    try:
        return [kind(item.strip()) for item in str(text).split(",") if item.strip()]
    except ValueError as err:
        raise UserError(f"cannot read {text!r} as a comma-separated list ({err}); e.g. --micro-batch-sizes 4,8,16.")


def parse_compile(item: str) -> bool:
    """'on'/'off' (also true/false, 1/0) -> bool."""
    table = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
    if item.lower() not in table:
        raise ValueError(f"{item!r} is not on/off")
    return table[item.lower()]


# The matrix flags in BenchConfig's field order: (item parser, default).
MATRIX = {"precisions": (str, "fp32,bf16"), "checkpointing": (checkpoint_value, "0,1"), "attention": (str, "sdpa"),
          "compile": (parse_compile, "off"), "micro_batch_sizes": (int, "8")}
RUN_FLAGS = {  # how long each configuration runs (None: the preset's), their bounds declared once
    "steps": Flag("timed steps per configuration (default 8, gpu preset 10)", None, min=1),
    "warmup": Flag("untimed warm-up steps per configuration (default 2)", None, min=0),
    "threads": Flag("CPU threads for torch (default: torch's; cpu preset: 1, steadier when shared)", None, min=1),
}


def resolve_matrix(args) -> list[BenchConfig]:
    """The preset's rows, or the flags' product (defaults where a flag is absent); mixing both is refused."""
    if args.preset is None:
        values = [split_list(getattr(args, k) or default, kind) for k, (kind, default) in MATRIX.items()]
        precisions, checkpoints, attentions, _, micros = values
        bad = [p for p in precisions if p not in PRECISIONS] + [a for a in attentions if a not in ATTENTION_BACKENDS]
        if bad:
            raise UserError(f"unknown value(s) {bad}: precisions are {'/'.join(PRECISIONS)}, attention "
                            f"{'/'.join(ATTENTION_BACKENDS)}.")
        if any(k != SELECTIVE and k < 0 for k in checkpoints) or any(m <= 0 for m in micros):
            raise UserError(f"checkpoint intervals must be >= 0 (0 = off) or {SELECTIVE}, and micro-batch sizes >= 1.")
        return [BenchConfig(*combo) for combo in itertools.product(*values)]
    if given := [f"--{k.replace('_', '-')}" for k in MATRIX if getattr(args, k) is not None]:
        raise UserError(f"--preset {args.preset} defines the matrix itself, so {', '.join(given)} would be "
                        "ignored; drop --preset to choose the matrix with flags, or drop those flags.")
    return preset_matrix(args.preset)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on a CUDA device now (None elsewhere): what the planner fits the micro-batch into."""
    # looked up at call time: tests/bench/capped.py's cap applies
    return int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None


def plan_changes_micro(args, configs: list[BenchConfig], device, free: int | None) -> tuple[list, str]:
    """changes-gpu's rows at the largest micro-batch (a divisor of 256) the planner fits in `free`, and why."""
    if free is None:
        return configs, (f"micro-batch {CHANGES_GPU_MICRO}: the preset's; no free CUDA memory to plan against "
                         f"on {device.type}")
    if args.memory_cap_gib:
        free = min(free, int(args.memory_cap_gib * GiB))
    base = configs[0]  # no checkpointing, eager: the rows' largest activations
    cfg = bench_train_config(base, args)
    model_cfg = model_config_for(cfg, latent_shape(args.image_size), args.num_classes)
    profiles, n_params, n_trainable = measure_profiles(model_cfg, base.precision, [base.checkpoint], device)
    fixed = fixed_state(n_params, n_trainable, cfg.optimizer, cfg.ema_device).total
    # What the rows may allocate: free memory less the planner's margin and the foreach row's temporaries (foreach
    # AdamW, one of the rows, keeps about one fp32 copy of the weights in temporaries that fused does not).
    budget = free - parse_size(DEFAULT_MARGIN) - 4 * n_trainable
    row = plan_row(profiles[0], fixed, budget, CHANGES_GPU_MICRO)
    where = f"{format_size(free)} free less {DEFAULT_MARGIN} margin and foreach AdamW's temporaries"
    if row.micro is None:
        raise UserError(f"{args.model} at {args.image_size} px does not fit even at micro-batch 1 without "
                        f"checkpointing in {format_size(budget)} ({where}): free the GPU or benchmark a smaller "
                        "--model or --image-size.")
    why = (f"micro-batch {row.micro}: the largest divisor of {CHANGES_GPU_MICRO} whose planned peak without "
           f"checkpointing ({format_size(row.peak)}) fits {format_size(budget)} ({where})")
    return [replace(c, micro_batch=row.micro) for c in configs], why


def synchronize(device: torch.device):
    """Wait for queued device work so wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_tflops(args, device: torch.device) -> tuple[float | None, str]:
    """The device peak used for MFU and where it came from."""
    if args.peak_tflops:
        return args.peak_tflops, "from --peak-tflops"
    if device.type != "cuda":
        return None, "unknown on CPU (pass --peak-tflops for MFU)"
    name = torch.cuda.get_device_name(device)
    if value := next((v for key, v in KNOWN_PEAK_TFLOPS.items() if key in name), None):
        return value, f"default for {name} (16-bit tensor cores, dense)"
    return None, f"unknown for {name} (pass --peak-tflops for MFU)"


def bench_train_config(config: BenchConfig, args) -> TrainConfig:
    """The TrainConfig `python -m train` would run for one cell (one micro-batch per step, no accumulation)."""
    return measured_config(args.model, block_from_args(args), global_batch_size=config.micro_batch,
                           micro_batch_size=config.micro_batch, grad_accum_steps=1, precision=config.precision,
                           grad_checkpoint=config.checkpoint, attention=config.attention, compile=config.compile)


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far, recompilations included."""
    from torch._dynamo.utils import counters  # private, but the one count of recompilations torch keeps

    return counters["frames"]["total"]


def time_steps(config: BenchConfig, args, device) -> tuple[float, list, int]:
    """(first step's seconds (compilation in it), each timed step's after warm-up, recompilations in those)."""
    cfg = bench_train_config(config, args)
    model_cfg = model_config_for(cfg, latent_shape(args.image_size), args.num_classes)
    learner = make_learner(cfg, model_cfg, device=device)
    if config.adamw == "foreach":  # the multi-tensor kernels instead of the fused one (a skip syncs the host)
        learner.optimizer = torch.optim.AdamW(learner.trained_parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                              weight_decay=cfg.weight_decay, foreach=True)
    batch = synthetic_batch(model_cfg, config.micro_batch, cfg.class_dropout_prob, learner.objective)
    times, frames = [], compiled_frames()
    for i in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        result = train_step(learner, [batch])
        if config.host_sync:  # what the loop read after every step before issue 34
            float(result["loss"]), float(result["grad_norm"]), bool(result["skipped"])
        synchronize(device)
        times.append(time.perf_counter() - start)
        if i + 1 == max(args.warmup, 1):  # the first compilation is not a recompilation, even when it is timed
            frames = compiled_frames()
    return times[0], times[args.warmup:], compiled_frames() - frames


def run_config(config: BenchConfig, args, device, flops_per_image, peak) -> BenchResult:
    """Time one configuration; any failure (OOM, unusable backend, compile error) becomes the row's error."""
    cuda = device.type == "cuda"
    if cuda:
        CudaAllocator().release()  # the previous configuration's model and optimizer must not count here
        torch.cuda.reset_peak_memory_stats(device)
    try:
        first, timed, recompiles = time_steps(config, args, device)
    except torch.cuda.OutOfMemoryError:
        return BenchResult(config, error="OOM")
    except Exception as err:  # reported in the table (its first sentence), the remaining configurations still run
        reason = (str(err).strip().splitlines() or [""])[0].split(". ")[0]
        return BenchResult(config, error=f"{type(err).__name__}: {reason}"[:140])
    step = statistics.median(timed)
    images = config.micro_batch / step
    mem = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    mfu = flops_per_image * images / (peak * 1e12) if peak else None
    compiled = dict(compile_s=max(first - step, 0.0), recompiles=recompiles) if config.compile else {}
    return BenchResult(config, 1 / step, images, mem, reserved, mfu, **compiled)


def _cell(value, fmt):
    return "-" if value is None else fmt.format(value)


HEAD = (f"{'config':<64} {'steps/s':>8} {'images/s':>9} {'peak mem':>11} {'reserved':>11} {'MFU':>7} "
        f"{'vs baseline':>11} {'compile s':>9} {'recompiles':>10}")


def table_line(r: BenchResult, base: float | None) -> str:
    """One row of the table; base: the images/s of the ratio column's baseline (None: no row ran yet)."""
    if r.error:
        return f"{r.config.label():<64} error: {r.error}"
    ratio = r.images_s / base if base else None
    return (f"{r.config.label():<64} {r.step_s:>8.3f} {r.images_s:>9.2f} "
            f"{_cell(r.peak_bytes and format_size(r.peak_bytes), '{}'):>11} "
            f"{_cell(r.reserved_bytes and format_size(r.reserved_bytes), '{}'):>11} "
            f"{_cell(r.mfu and 100 * r.mfu, '{:.1f}%'):>7} {_cell(ratio, '{:.2f}x'):>11} "
            f"{_cell(r.compile_s, '{:.1f}'):>9} {_cell(r.recompiles, '{}'):>10}")


def baseline(results: list[BenchResult]) -> float | None:
    """images/s of the first row that ran: the ratio column's baseline."""
    return next((r.images_s for r in results if r.images_s), None)


def table(results: list[BenchResult]) -> str:
    """Aligned text table; the first successful row is the baseline of the ratio column."""
    base = baseline(results)
    return "\n".join([HEAD, "-" * len(HEAD), *(table_line(r, base) for r in results)])


def header(args, device, model, flops, peak_note) -> str:
    """What ran where, and the FLOP count the MFU uses."""
    macs = forward_macs(model)["total"]
    cap = f", memory capped at {args.memory_cap_gib:g} GiB" if device.type == "cuda" and args.memory_cap_gib else ""
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return (f"{args.model} at {args.image_size}x{args.image_size} on {dev}{cap}; torch {torch.__version__}\n"
            f"forward {macs / 1e9:.2f} GMAC/image, training {flops / 1e9:.2f} GFLOP/image; peak for MFU: "
            f"{peak_note}\nwarm-up {args.warmup} steps, median of {args.steps} timed steps of the trainer's step "
            f"(AdamW, grad norm, EMA on the device); compile s: the first step's time beyond the median step, "
            f"recompiles: during the timed steps"
            + ("; TF32 matmuls on" if device.type == "cuda" else "; peak memory is measured on CUDA only"))


def build_parser() -> argparse.ArgumentParser:
    """Flags of python -m train.bench."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="cpu: tiny model, quick ablation of our step; gpu: "
                   "DiT-XL/2 at 256 mirroring the fast-DiT README table; changes-gpu (DiT-XL/2, bf16, the largest "
                   "micro-batch up to 256 that train/memory.py's planner fits in the free memory) and changes-cpu "
                   "(tiny): the step before issue 34 beside each of its changes (no host sync, fused vs foreach AdamW, "
                   "regional compile, selective checkpointing). Sets the matrix and defaults.")
    p.add_argument("--model", help="DiT preset (default: the preset's, else DiT-T/2)")
    p.add_argument("--image-size", type=int, help="image size in pixels; latents are 1/8 of it (default 128)")
    p.add_argument("--num-classes", type=int, default=1000, help="number of classes")
    add_block_flags(p)
    p.add_argument("--micro-batch-sizes", help="comma-separated micro-batch sweep, e.g. 4,8,16 (default 8)")
    p.add_argument("--precisions", help="comma-separated subset of fp32,fp16,bf16 (default fp32,bf16)")
    p.add_argument("--checkpointing", help="comma-separated checkpoint intervals, 0 = off, or selective (default 0,1)")
    p.add_argument("--attention", help="comma-separated subset of sdpa,math,xformers (default sdpa)")
    p.add_argument("--compile", help="comma-separated on/off for torch.compile (default off)")
    for name, spec in RUN_FLAGS.items():
        names, kwargs = argument_of(name, spec, int)
        p.add_argument(*names, **kwargs)
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda[:i]")
    p.add_argument("--memory-cap-gib", type=float, default=24.0, help="CUDA only: cap this process's memory "
                   "(emulates a 24 GiB RTX 3090 on a bigger card); 0 = no cap")
    p.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s for MFU (default: known GPU names)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    return p


def resolve_defaults(args):
    """Fill model, size, steps and warm-up from the preset (or the plain defaults)."""
    preset = PRESETS.get(args.preset, PRESETS["cpu"])
    for key in ("model", "image_size", "steps", "warmup", "threads"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key] if args.preset or key != "threads" else None)
    for name, spec in RUN_FLAGS.items():
        check_bounds(name, spec, getattr(args, name))  # a preset's value as a flag's
    if args.threads:
        torch.set_num_threads(args.threads)


def run(args) -> list[BenchResult]:
    """Run the matrix, printing the header, then each row and writing --json (the rows so far) as it is measured."""
    resolve_defaults(args)
    configs = resolve_matrix(args)
    device = measure_device(args.device, "--device")
    model = model_config_for(measured_config(args.model, block_from_args(args)), latent_shape(args.image_size),
                             args.num_classes).build(device="meta")
    flops = train_flops_per_image(model)
    peak, peak_note = peak_tflops(args, device)
    if device.type == "cuda" and args.memory_cap_gib:  # emulate a smaller card (a 24 GiB RTX 3090) on a larger one
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * GiB / total), device)
    set_tf32(device)  # as python -m train and the official DiT train.py
    why = None
    if args.preset == "changes-gpu":  # free memory read before the planner's own model occupies any
        configs, why = plan_changes_micro(args, configs, device, free_memory(device))
    # each line on stdout at once: a run cut by a time limit keeps what it printed
    print(header(args, device, model, flops, peak_note) + (f"\n{why}" if why else "") + "\n", flush=True)
    results = []
    print(HEAD + "\n" + "-" * len(HEAD), flush=True)
    try:
        for config in tqdm(configs, desc="bench", unit="config", file=sys.stderr):
            results.append(run_config(config, args, device, flops, peak))
            print(table_line(results[-1], baseline(results)), flush=True)
            if args.json:  # machine-readable; a Ctrl-C mid-write leaves the old file or none
                atomic_write_json(args.json, {
                    "model": args.model, "image_size": args.image_size, "device": str(device),
                    "torch": torch.__version__, "train_flops_per_image": flops, "peak_tflops": peak,
                    "results": [{**asdict(r.config), **{k: v for k, v in asdict(r).items() if k != "config"}}
                                for r in results]}, indent=2)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM (a time limit): the rows so far are printed and written
        # one line, not interruptible's: a rerun measures every row again, nothing resumes
        signum = signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
        kept = f"; they are in {args.json}" if args.json and results else ""
        print(f"{PROG}: cut by {signal.Signals(signum).name} after {len(results)} of {len(configs)} rows: the rows "
              f"above were measured{kept}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    return results


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout's signal), unwinding like Ctrl-C (every `finally` runs)."""
    @staticmethod
    def handler(signum, frame):
        """Raise Terminated; a second SIGTERM must not cut the unwinding short."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated


@interruptible(PROG)
def main(argv=None):
    """Entry point of python -m train.bench."""
    args = build_parser().parse_args(argv)
    # SIGTERM raises KeyboardInterrupt (main thread only: handlers cannot be set elsewhere)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, Terminated.handler) if main_thread else None
    try:
        with cli_errors(PROG, FLAGS):
            run(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
