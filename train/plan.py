"""`python -m train.plan`: how large a micro-batch fits on one GPU, for each checkpointing choice.

Fixed state is arithmetic (bytes per parameter); activation memory is measured on the real model
(train/memory.py explains how). `--verify` runs a real training step on CUDA at the planned
micro-batch and prints the predicted next to the measured peak (torch.cuda.max_memory_allocated).
"""
import argparse
import gc
import sys
import textwrap
import torch

from shared.runtime.cli import HelpFormatter, add_flags
from shared.runtime.errors import UserError, cli_errors
from shared.runtime.precision import PRECISION_CHOICES, canonical_precision
from shared.network.routing import kept_tokens
from shared.network.models import SELECTIVE
from train.config import TrainConfig, add_block_flags, block_from_args, checkpoint_choice, model_config_for, route_span
from train.memory import (DEFAULT_MARGIN, FixedState, PlanRow, count_parameters, fixed_state, forward_macs, head_macs,
                          latent_shape, measure_device, measure_profiles, measured_config, per_process_batch, plan_row,
                          train_flops_per_image, verify_step)
from train.units import format_size, parse_size

PROG = "python -m train.plan"
FLAGS = {"model preset": "--model", "precision": "--precision", "objective": "--objective"}  # domain name -> flag
OPTIMIZER_LABELS = {"adamw": "AdamW, 2 fp32 moments", "adamw8bit": "8-bit AdamW, 2 bytes/param"}


# ----------------------------------------------------------------------------------------------------
# What to tabulate
# ----------------------------------------------------------------------------------------------------

def checkpoint_choices(requested: int | str, depth: int) -> list[int | str]:
    """Checkpointing choices to tabulate: off, selective, every block, every 2nd block, and the requested one."""
    intervals = sorted({1, min(2, depth)} | ({requested} - {SELECTIVE, 0}))
    return [0, SELECTIVE, *intervals]


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------

def choice_label(every: int | str) -> str:
    """Human name of a checkpointing choice."""
    if every == SELECTIVE:
        return "selective"
    return {0: "off", 1: "every block"}.get(every, f"every {every}th block" if every > 3 else
                                           f"every {every}{'nd' if every == 2 else 'rd'} block")


def header_lines(args, config, tokens, n_params, n_trainable, device) -> list[str]:
    """What was planned and how the activations were measured (wrapped at 100 columns)."""
    lines = _header_text(args, config, tokens, n_params, n_trainable, device)
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, 100, subsequent_indent="  ")]


def head_text(config) -> str:
    """', DiT^DH head of D blocks at width W' for a model with the head, else ''."""
    return f", DiT^DH head of {config.head_depth} blocks at width {config.head_width}" if config.head_depth else ""


def _header_text(args, config, tokens, n_params, n_trainable, device) -> list[str]:
    """Unwrapped header sentences."""
    policy = f"autocast({device.type}, {args.precision})" if args.precision != "fp32" else "fp32 (no autocast)"
    return [
        f"{args.model} ({config.block} block{head_text(config)}) at {args.image_size}x{args.image_size}: latents "
        f"{config.in_channels}x{config.input_size}x"
        f"{config.input_size} ({tokens} tokens), {n_params:,} parameters ({n_trainable:,} trainable)",
        f"GPU memory {format_size(args.gpu_memory)} - margin {format_size(args.margin)} = budget "
        f"{format_size(args.gpu_memory - args.margin)}; global batch {args.global_batch_size} over "
        f"{args.num_processes} process(es); precision {args.precision}",
        f"activations measured on {device.type}: the trainer's forward + loss at batch 1 and 2 under {policy}, "
        "counting bytes autograd saves for backward (deduplicated by storage, parameters excluded)",
    ] + ([f"token routing (TREAD): {tokens - kept_tokens(tokens, args.route_ratio)} of {tokens} tokens skip blocks "
          f"{args.route_start}..{args.route_end}; those blocks' activations are counted for the kept tokens"]
         if args.route_ratio else [])


def compute_lines(meta, route, batch: int) -> list[str]:
    """Forward MACs per image counted from the modules (the head's share), and the training FLOPs per step."""
    kept = None
    if route is not None:
        ratio, start, end = route
        meta.set_routing(start, end)
        kept = kept_tokens(meta.x_embedder.num_patches, ratio)
    macs, head = forward_macs(meta, kept)["total"], head_macs(meta, kept)
    step = train_flops_per_image(meta, kept)
    where = f" ({head / 1e9:.1f} in the DiT^DH head's {len(meta.blocks) - meta.depth} blocks)" if head else ""
    routed = ", routed training forward" if kept else ""
    text = (f"compute: forward {macs / 1e9:.1f} GMAC per image{where}{routed}; training 3x forward = "
            f"{step / 1e9:.1f} GFLOP per image, {step * batch / 1e12:.1f} TFLOP per optimizer step of {batch} "
            "(recomputation under checkpointing not counted)")
    return textwrap.wrap(text, 100, subsequent_indent="  ")


def fixed_lines(fixed: FixedState, args) -> list[str]:
    """The fixed-state breakdown."""
    rows = [("weights (fp32 master)", fixed.weights), ("gradients (fp32)", fixed.grads),
            (f"optimizer state ({OPTIMIZER_LABELS[args.optimizer]})", fixed.optimizer),
            (f"EMA (fp32, on {args.ema_device})", fixed.ema), ("fixed total", fixed.total),
            ("workspace margin (CUDA context, allocator slack)", args.margin)]
    return ["", "fixed state"] + [f"  {name:<50}{format_size(n):>12}  ({n / 1e9:.2f} GB)" for name, n in rows]


TABLE_COLUMNS = ("checkpointing", "saved/img", "recomp/img", "constant", "w. copies", "micro", "accum",
                 "peak", "+margin")


def table_lines(rows: list[PlanRow], requested: int, margin: int) -> list[str]:
    """One line per checkpointing choice; the requested one is marked with '*'."""
    widths = (19, 10, 10, 10, 10, 6, 6, 10, 10)
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines = ["", "activations and plan",
             "  saved/img: kept for backward per sample; recomp/img: one checkpointed block rebuilt in backward;",
             "  constant: batch-independent part; w. copies: low-precision weights autocast caches in forward;",
             "  peak: fixed state + activations at the micro-batch; +margin: what the GPU must hold",
             "", fmt.format(*TABLE_COLUMNS)]
    for row in rows:
        p = row.profile
        mark = "* " if p.every == requested else "  "
        fits = row.micro is not None
        lines.append(fmt.format(
            mark + choice_label(p.every), format_size(p.saved.per_sample),
            format_size(p.recompute.per_sample) if p.every else "-",
            format_size(max(p.resident.const, p.saved.const + p.recompute.const)), format_size(p.cast_cache),
            row.micro if fits else "none", row.accumulation if fits else "-",
            format_size(row.peak) if fits else "-", format_size(row.peak + margin) if fits else "-"))
    return lines


def summary_line(row: PlanRow, batch: int) -> str:
    """The recommendation for the requested checkpointing choice."""
    label = choice_label(row.profile.every)
    if row.micro is None:
        return (f"\nwith checkpointing {label}: not even one sample fits; turn on --grad-checkpoint, use "
                "--ema-device cpu or --optimizer adamw8bit, or use a larger GPU.")
    return (f"\nwith checkpointing {label}: --micro-batch-size {row.micro} "
            f"(gradient accumulation {row.accumulation} to reach {batch} per process)")


# ----------------------------------------------------------------------------------------------------
# Verification on CUDA
# ----------------------------------------------------------------------------------------------------

VERIFY_TIMED_STEPS = 5  # steps timed after the measured one (their median is printed)


def verify_lines(measured, chosen: PlanRow, meta, route) -> list[str]:
    """Predicted next to measured: the peak memory, and the step time with the FLOPs it achieved."""
    kept = kept_tokens(meta.x_embedder.num_patches, route[0]) if route else None
    flops = train_flops_per_image(meta, kept) * measured.images
    seconds = sorted(measured.seconds)[len(measured.seconds) // 2]
    return [f"verify: predicted peak {format_size(chosen.peak)}, measured max_memory_allocated "
            f"{format_size(measured.peak)} (measured/predicted {measured.peak / chosen.peak:.2f})",
            f"verify: step of {measured.images} images (micro-batch {chosen.micro}) {seconds:.3f} s median of "
            f"{len(measured.seconds)} ({measured.images / seconds:.1f} images/s); counted {flops / 1e12:.1f} TFLOP per "
            f"step, so {flops / seconds / 1e12:.1f} TFLOP/s achieved (recomputation not counted)"]


def check_verify_possible(args):
    """--verify needs CUDA; say so before measuring anything."""
    if args.verify and not torch.cuda.is_available():
        raise UserError("--verify runs a real training step on a CUDA GPU and compares its peak memory with "
                        "the plan, but no CUDA GPU is visible here. Run it on the training machine, or drop "
                        "--verify to get the plan alone.")
    if args.verify and args.gpu_memory > torch.cuda.get_device_properties(0).total_memory:
        print(f"{PROG}: note: planning for {format_size(args.gpu_memory)} on a larger card; --verify checks "
              "the prediction, not whether it fits a smaller card.", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------

def size_arg(text: str) -> int:
    """argparse type for memory sizes: argparse reports the message as a usage error."""
    try:
        return parse_size(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def build_parser() -> argparse.ArgumentParser:
    """Flags of python -m train.plan (same names as python -m train where they overlap)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    # The flags python -m train also has: its defaults and help (TrainConfig), reworded where plan means more.
    add_flags(p, TrainConfig, only=("model", "objective", "global_batch_size", "grad_checkpoint", "ema_device",
                                    "optimizer", "route_ratio", "route_start", "route_end"),
              changes={"grad_checkpoint": {"help": "checkpointing interval to recommend (every K-th block; bare flag "
                                                   f"= 1; 0 = off; {SELECTIVE}: matmul and attention outputs kept, the "
                                                   "pointwise ops recomputed); off, selective, every block and every "
                                                   "2nd block are always tabulated", "default": 0,
                                           "type": checkpoint_choice}})
    p.add_argument("--image-size", type=int, default=256, help="training image size in pixels")
    add_block_flags(p)
    p.add_argument("--vae-factor", type=int, default=8, help="VAE downsample factor (latent = image / factor)")
    p.add_argument("--latent-channels", type=int, default=4, help="latent channels of the VAE")
    p.add_argument("--num-classes", type=int, default=1000, help="number of classes (label table size)")
    p.add_argument("--precision", "--mixed-precision", dest="precision", choices=PRECISION_CHOICES, default="bf16",
                   type=canonical_precision, help="training precision (as python -m train --precision; 'no' = fp32)")
    p.add_argument("--gpu-memory", type=size_arg, default="24GiB", help="GPU memory to plan for, e.g. 24GiB")
    p.add_argument("--margin", type=size_arg, default=DEFAULT_MARGIN,
                   help="memory kept free for the CUDA context, cuBLAS workspace and allocator slack")
    p.add_argument("--num-processes", type=int, default=1, help="data-parallel processes sharing the global batch")
    p.add_argument("--measure-device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="device for the activation measurement (auto: CUDA if present, else CPU)")
    p.add_argument("--verify", action="store_true",
                   help="CUDA only: run real steps at the planned micro-batch and print predicted vs measured peak")
    return p


def check_args(args):
    """Reject inconsistent numbers before building anything."""
    if args.margin >= args.gpu_memory:
        raise UserError(f"the margin {format_size(args.margin)} leaves nothing of {format_size(args.gpu_memory)}; "
                        "pass a smaller --margin or a larger --gpu-memory.")
    if args.grad_checkpoint == "auto":
        raise UserError("--grad-checkpoint auto is the trainer's choice; the planner tabulates every choice: pass the "
                        f"one to recommend (0, {SELECTIVE}, 1, 2, ...).")
    if args.grad_checkpoint != SELECTIVE and args.grad_checkpoint < 0:
        raise UserError(f"--grad-checkpoint must be 0 (off) or a positive interval, got {args.grad_checkpoint}.")


def plan_route(args, config) -> tuple[float, int, int] | None:
    """(ratio, start, end) of the token route the flags ask for (TREAD's span by default), or None; UserError."""
    if not args.route_ratio:
        return None
    start, end = route_span(args.model, config.input_size, args.route_ratio, args.route_start, args.route_end)
    args.route_start, args.route_end = start, end  # the header and --verify show and use the resolved span
    return args.route_ratio, start, end


def run(args) -> str:
    """Measure, plan and (optionally) verify; returns the report text."""
    check_args(args)
    check_verify_possible(args)
    batch = per_process_batch(args.global_batch_size, args.num_processes)
    config = model_config_for(measured_config(args.model, block_from_args(args, args.model), objective=args.objective),
                              latent_shape(args.image_size, args.vae_factor, args.latent_channels), args.num_classes)
    device = measure_device(args.measure_device)
    meta = config.build(device="meta")  # shapes only, no allocation
    choices = checkpoint_choices(args.grad_checkpoint, len(meta.blocks))
    route = plan_route(args, config)
    profiles, n_params, n_trainable = measure_profiles(config, args.precision, choices, device, route)
    fixed = fixed_state(n_params, n_trainable, args.optimizer, args.ema_device)
    rows = [plan_row(p, fixed.total, args.gpu_memory - args.margin, batch) for p in profiles]
    chosen = next(r for r in rows if r.profile.every == args.grad_checkpoint)
    lines = header_lines(args, config, meta.x_embedder.num_patches, n_params, n_trainable, device)
    lines += compute_lines(meta, route, batch)
    lines += fixed_lines(fixed, args)
    lines += table_lines(rows, args.grad_checkpoint, args.margin) + [summary_line(chosen, batch)]
    if args.verify and chosen.micro is not None:
        gc.collect()  # the measurement model must be gone before CUDA peak memory is read
        torch.cuda.empty_cache()
        lines += verify_lines(verify_step(config, args, chosen, timed=VERIFY_TIMED_STEPS), chosen, meta, route)
    return "\n".join(lines)


def main(argv=None):
    """Entry point of python -m train.plan."""
    args = build_parser().parse_args(argv)
    with cli_errors(PROG, FLAGS):
        print(run(args))


if __name__ == "__main__":
    main()
