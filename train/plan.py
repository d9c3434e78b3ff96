"""`python -m train.plan`: how large a micro-batch fits on one GPU, for each checkpointing choice.

Fixed state is arithmetic; activations are measured on the real model (train/memory.py). `--verify` runs the
trainer's step on CUDA capped at the budget (--gpu-memory minus --margin): predicted next to measured peak.
"""
from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import math
import sys
import textwrap

from shared.runtime.cli import HelpFormatter, add_flags, flag_name
from shared.runtime.errors import UserError, cli_errors
from shared.runtime.precision import PRECISION_CHOICES, canonical_precision
from shared.network.routing import kept_tokens
from shared.network.blocks import SELECTIVE
from train.config import (BLOCK_FLAGS, TrainConfig, add_block_flags, block_from_args, checkpoint_choice,
                          column_consumers, model_config_for, route_span)
from train import memory
from train.autotune import smaller_micro
from train.memory import (DEFAULT_MARGIN, FixedState, PlanRow, StepOutOfMemory, Verified, fixed_state, forward_macs,
                          head_macs, latent_shape, measure_device, measure_profiles, measured_config, per_process_batch,
                          plan_row, train_flops_per_image)
from train.units import GiB, MiB, format_size, parse_size

PROG = "python -m train.plan"
FLAGS = {"model preset": "--model", "precision": "--precision", "objective": "--objective", **BLOCK_FLAGS}
OPTIMIZER_LABELS = {"adamw": "AdamW, 2 fp32 moments", "adamw8bit": "8-bit AdamW, 2 bytes/param"}


def checkpoint_choices(requested: int | str, depth: int) -> list[int | str]:
    """Checkpointing choices to tabulate: off, selective, every block, every 2nd block, and the requested one."""
    intervals = sorted({1, min(2, depth)} | ({requested} - {SELECTIVE, 0}))
    return [0, SELECTIVE, *intervals]


def choice_label(every: int | str) -> str:
    """Human name of a checkpointing choice."""
    names = {SELECTIVE: "selective", 0: "off", 1: "every block", 2: "every 2nd block", 3: "every 3rd block"}
    return names.get(every, f"every {every}th block")


def wrapped(*sentences: str) -> list[str]:
    """Sentences wrapped at 100 columns, continuation lines indented."""
    return [line for text in sentences for line in textwrap.wrap(text, 100, subsequent_indent="  ")]


def header_lines(args, config, tokens, n_params, n_trainable, device) -> list[str]:
    """What was planned and how the activations were measured."""
    policy = f"autocast({device.type}, {args.precision})" if args.precision != "fp32" else "fp32 (no autocast)"
    head = f", DiT^DH head of {config.head_depth} blocks at width {config.head_width}" if config.head_depth else ""
    return wrapped(
        f"{args.model} ({config.block} block{head}) at {args.image_size}x{args.image_size}: latents "
        f"{config.in_channels}x{config.input_size}x{config.input_size} ({tokens} tokens), {n_params:,} parameters "
        f"({n_trainable:,} trainable)",
        f"GPU memory {format_size(args.gpu_memory)} - margin {format_size(args.margin)} = budget "
        f"{format_size(args.gpu_memory - args.margin)}; global batch {args.global_batch_size} over "
        f"{args.num_processes} process(es); precision {args.precision}",
        f"activations measured on {device.type}: the trainer's forward + loss at batch 1 and 2 under {policy}, "
        "counting bytes autograd saves for backward (deduplicated by storage, parameters excluded)",
        *([f"token routing (TREAD): {tokens - kept_tokens(tokens, args.route_ratio)} of {tokens} tokens skip blocks "
           f"{args.route_start}..{args.route_end}; those blocks' activations are counted for the kept tokens"]
          if args.route_ratio else []))


def compute_lines(meta, kept: int | None, batch: int) -> list[str]:
    """Forward MACs per image counted from the modules (the head's share), and the training FLOPs per step."""
    macs, head = forward_macs(meta, kept)["total"], head_macs(meta, kept)
    step = train_flops_per_image(meta, kept)
    where = f" ({head / 1e9:.1f} in the DiT^DH head's {len(meta.blocks) - meta.depth} blocks)" if head else ""
    routed = ", routed training forward" if kept else ""
    return wrapped(f"compute: forward {macs / 1e9:.1f} GMAC per image{where}{routed}; training 3x forward = "
                   f"{step / 1e9:.1f} GFLOP per image, {step * batch / 1e12:.1f} TFLOP per optimizer step of {batch} "
                   "(recomputation under checkpointing not counted)")


def fixed_lines(fixed: FixedState, args) -> list[str]:
    """The fixed-state breakdown."""
    rows = [("weights (fp32 master)", fixed.weights), ("gradients (fp32)", fixed.grads),
            (f"optimizer state ({OPTIMIZER_LABELS[args.optimizer]})", fixed.optimizer),
            (f"EMA (fp32, on {args.ema_device})", fixed.ema), ("fixed total", fixed.total),
            ("workspace margin (CUDA context, allocator slack)", args.margin)]
    return ["", "fixed state"] + [f"  {name:<50}{format_size(n):>12}  ({n / 1e9:.2f} GB)" for name, n in rows]


def table_lines(rows: list[PlanRow], requested: int, margin: int) -> list[str]:
    """One line per checkpointing choice; the requested one is marked with '*'."""
    widths = (19, 10, 10, 10, 10, 6, 6, 10, 10)
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines = ["", "activations and plan",
             "  saved/img: kept for backward per sample; recomp/img: one checkpointed block rebuilt in backward;",
             "  constant: batch-independent part; w. copies: low-precision weights autocast caches in forward;",
             "  peak: fixed state + activations at the micro-batch; +margin: what the GPU must hold",
             "", fmt.format("checkpointing", "saved/img", "recomp/img", "constant", "w. copies", "micro", "accum",
                            "peak", "+margin")]
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


VERIFY_TIMED_STEPS = 5  # steps timed after the measured one (their median is printed)


def verify_lines(measured, chosen: PlanRow, meta, kept: int | None) -> list[str]:
    """Predicted next to measured: the peak memory, and the step time with the FLOPs it achieved."""
    flops = train_flops_per_image(meta, kept) * measured.images
    seconds = sorted(measured.seconds)[len(measured.seconds) // 2]
    return [f"verify: predicted peak {format_size(chosen.peak)}, measured max_memory_allocated "
            f"{format_size(measured.peak)} (measured/predicted {measured.peak / chosen.peak:.2f})",
            f"verify: step of {measured.images} images (micro-batch {chosen.micro}) {seconds:.3f} s median of "
            f"{len(measured.seconds)} ({measured.images / seconds:.1f} images/s); counted {flops / 1e12:.1f} TFLOP per "
            f"step, so {flops / seconds / 1e12:.1f} TFLOP/s achieved (recomputation not counted)"]


def verify_plan(config, args, chosen: PlanRow, batch: int) -> Verified:
    """--verify: the trainer's step at the chosen plan, capped at the budget; UserError when it does not fit."""
    budget = args.gpu_memory - args.margin
    try:
        return memory.verify_step(config, args, chosen, timed=VERIFY_TIMED_STEPS, budget=budget)
    except StepOutOfMemory as oom:
        error = UserError(over_budget_text(oom, chosen, args, budget, batch))
    raise error  # outside the handler: nothing of the failed step rides on the paragraph


def size_flag(nbytes: int) -> str:
    """Bytes as a --margin/--gpu-memory value, rounded up: '2.4GiB' (to 0.1 GiB) from 1 GiB, else '130MiB'."""
    if nbytes >= GiB:
        return f"{math.ceil(nbytes / GiB * 10) / 10:g}GiB"
    return f"{math.ceil(nbytes / MiB)}MiB"


def over_budget_text(oom: StepOutOfMemory, chosen: PlanRow, args, budget: int, batch: int) -> str:
    """'measured X > budget Y at micro-batch M; try ...': what did not fit and the settings that need less."""
    limit = "budget" if oom.limit == budget else "card (smaller than the budget)"
    measured = (f"measured {format_size(oom.needed)} > {limit} {format_size(oom.limit)}" if oom.needed > oom.limit
                else f"measured more than the {limit} {format_size(oom.limit)} ({format_size(oom.needed)} held when "
                     "an allocation failed)")
    missed = max(oom.needed, oom.limit) - chosen.peak  # what the prediction left out
    smaller = smaller_micro(chosen.micro, batch)
    every = chosen.profile.every
    tries = ([f"--gpu-memory {oom.limit // MiB}MiB (this card)"] if oom.limit < budget else  # the card was the limit
             [f"--margin {size_flag(args.margin + missed)} (plans with the {format_size(missed)} the prediction "
              "missed)"])
    if every != 1:
        tries.append("--grad-checkpoint 1")
    if smaller is not None:
        tries.append(f"training with --micro-batch-size {smaller} --grad-checkpoint {every}")
    return (f"--verify: {measured} at micro-batch {chosen.micro} (checkpointing {choice_label(every)}, "
            f"{args.precision}): the trainer's step ran out of memory under an allocator cap of the budget, where "
            f"the plan predicted a peak of {format_size(chosen.peak)}. Try {', or '.join(tries)}; --optimizer "
            "adamw8bit and --ema-device cpu also need less.")


def plan_command(cfg, latent_shape: tuple, num_classes: int, gpu_memory: int | None) -> str | None:
    """The `python -m train.plan` command for a resolved TrainConfig on a `gpu_memory`-byte card (None: off CUDA)."""
    # None where the planner cannot measure the run: a head other than the preset's, or a shard column's head
    from shared.network.models import preset_head

    if column_consumers(cfg) or any(getattr(cfg, k) != v for k, v in preset_head(cfg.model).items()):
        return None
    channels, height, _ = latent_shape
    flags = {"model": cfg.model, "objective": cfg.objective, "image_size": cfg.image_size,
             "vae_factor": cfg.image_size // height, "latent_channels": channels, "num_classes": num_classes,
             "global_batch_size": cfg.global_batch_size, "num_processes": cfg.world_size, "precision": cfg.precision,
             "optimizer": cfg.optimizer, "ema_device": cfg.ema_device, "grad_checkpoint": cfg.grad_checkpoint,
             "block": cfg.block, "norm": cfg.norm, "mlp": cfg.mlp}
    if cfg.route_ratio > 0:
        flags.update(route_ratio=cfg.route_ratio, route_start=cfg.route_start, route_end=cfg.route_end)
    words = [PROG] + [f"{flag_name(k)} {v}" for k, v in flags.items()]
    words += ["--rope" if cfg.rope else "--no-rope", "--qk-norm" if cfg.qk_norm else "--no-qk-norm"]
    if gpu_memory is not None:
        words += [f"--gpu-memory {size_flag(gpu_memory)}", "--verify"]
    return " ".join(words)


def out_of_memory_error(cfg, latent_shape: tuple, num_classes: int, step: int, last_checkpoint, error,
                        gpu_memory: int | None) -> UserError:
    """`python -m train`'s out-of-memory paragraph: the smaller settings to resume with, the planner, the checkpoint."""
    smaller = smaller_micro(cfg.micro_batch_size, cfg.global_batch_size // cfg.world_size)
    fixes = []
    if smaller is not None:
        fixes.append(f"--micro-batch-size {smaller} (gradient accumulation keeps the global batch of "
                     f"{cfg.global_batch_size})")
    if cfg.grad_checkpoint != 1:
        fixes.append("--grad-checkpoint 1 (every block recomputed in backward)")
    if cfg.ema_device != "cpu":
        fixes.append("--ema-device cpu")
    if not fixes:
        fixes.append("nothing smaller: this run already trains one image at a time, every block checkpointed, the "
                     "EMA on the CPU; a new run with --optimizer adamw8bit or a smaller --model, or a larger GPU")
    kept = (f"The last checkpoint {last_checkpoint} is intact and the rerun resumes from it" if last_checkpoint
            else "No checkpoint was written yet; the rerun starts over")
    command = plan_command(cfg, latent_shape, num_classes, gpu_memory)
    where = f"; `{command}` shows what fits" if command else ""
    asked = memory.requested_bytes(error)  # CUDA's request, not the allocator statistics its message goes on with
    cause = "CUDA out of memory" + (f", tried to allocate {format_size(asked)}" if asked else "")
    return UserError(f"ran out of GPU memory after {step} completed step(s), at micro-batch {cfg.micro_batch_size} x "
                     f"{cfg.grad_accum_steps} accumulation, checkpointing {choice_label(cfg.grad_checkpoint)}, "
                     f"{cfg.precision} ({cause}). {kept}. Rerun the same command with {', or '.join(fixes)}{where}.")


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
    recommend = (f"checkpointing interval to recommend (every K-th block; bare flag = 1; 0 = off; {SELECTIVE}: matmul "
                 "and attention outputs kept, the pointwise ops recomputed); off, selective, every block and every 2nd "
                 "block are always tabulated")
    add_flags(p, TrainConfig, only=("model", "objective", "global_batch_size", "grad_checkpoint", "ema_device",
                                    "optimizer", "route_ratio", "route_start", "route_end"),
              changes={"grad_checkpoint": {"help": recommend, "default": 0, "type": checkpoint_choice}})
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
                   help="CUDA only: run real steps at the planned micro-batch, capped at the budget, and print "
                        "predicted vs measured peak")
    return p


def check_args(args):
    """Reject inconsistent numbers, and --verify without CUDA, before building or measuring anything."""
    if args.margin >= args.gpu_memory:
        raise UserError(f"the margin {format_size(args.margin)} leaves nothing of {format_size(args.gpu_memory)}; "
                        "pass a smaller --margin or a larger --gpu-memory.")
    if args.grad_checkpoint == "auto":
        raise UserError("--grad-checkpoint auto is the trainer's choice; the planner tabulates every choice: pass the "
                        f"one to recommend (0, {SELECTIVE}, 1, 2, ...).")
    if args.grad_checkpoint != SELECTIVE and args.grad_checkpoint < 0:
        raise UserError(f"--grad-checkpoint must be 0 (off) or a positive interval, got {args.grad_checkpoint}.")
    if not args.verify:
        return
    cuda = memory.allocator()
    if not cuda.available():
        raise UserError("--verify runs a real training step on a CUDA GPU and compares its peak memory with "
                        "the plan, but no CUDA GPU is visible here. Run it on the training machine, or drop "
                        "--verify to get the plan alone.")
    if args.gpu_memory > cuda.total():
        print(f"{PROG}: note: planning for {format_size(args.gpu_memory)} on a smaller card; --verify caps the step "
              f"at the card's {format_size(cuda.total())}.", file=sys.stderr)


def run(args) -> str:
    """Measure, plan and (optionally) verify; returns the report text."""
    check_args(args)
    batch = per_process_batch(args.global_batch_size, args.num_processes)
    config = model_config_for(measured_config(args.model, block_from_args(args, args.model), objective=args.objective),
                              latent_shape(args.image_size, args.vae_factor, args.latent_channels), args.num_classes)
    device = measure_device(args.measure_device)
    meta = config.build(device="meta")  # shapes only, no allocation
    choices = checkpoint_choices(args.grad_checkpoint, len(meta.blocks))
    route, kept = None, None  # (ratio, start, end) of the route the flags ask for (TREAD's span by default), kept
    if args.route_ratio:  # the header and --verify show and use the resolved span
        start, end = route_span(args.model, config.input_size, args.route_ratio, args.route_start, args.route_end)
        args.route_start, args.route_end = start, end
        meta.set_routing(start, end)
        route, kept = (args.route_ratio, start, end), kept_tokens(meta.x_embedder.num_patches, args.route_ratio)
    profiles, n_params, n_trainable = measure_profiles(config, args.precision, choices, device, route)
    fixed = fixed_state(n_params, n_trainable, args.optimizer, args.ema_device)
    rows = [plan_row(p, fixed.total, args.gpu_memory - args.margin, batch) for p in profiles]
    chosen = next(r for r in rows if r.profile.every == args.grad_checkpoint)
    lines = header_lines(args, config, meta.x_embedder.num_patches, n_params, n_trainable, device)
    lines += compute_lines(meta, kept, batch) + fixed_lines(fixed, args)
    lines += table_lines(rows, args.grad_checkpoint, args.margin) + [summary_line(chosen, batch)]
    if args.verify and chosen.micro is not None:
        lines += verify_lines(verify_plan(config, args, chosen, batch), chosen, meta, kept)
    return "\n".join(lines)


@interruptible(PROG)
def main(argv=None):
    """Entry point of python -m train.plan."""
    args = build_parser().parse_args(argv)
    with cli_errors(PROG, FLAGS):
        print(run(args))


if __name__ == "__main__":
    main()
