"""What a DiT training step costs: forward MACs counted from the modules, and activation bytes MEASURED.

Shared by `python -m train.plan` (memory planner), train/autotune.py and `python -m train.bench`. The real model runs
the trainer's own forward + loss while saved-tensor hooks record every tensor autograd keeps for backward (by storage,
parameters excluded) and a dispatch mode records autocast's weight copies; batch 1 and 2 separate the per-sample from
the constant part (both exactly linear in the batch for a DiT). Not the meta device: autocast rejects it, and there
sdpa decomposes into the fp32 math path (saving the (N,H,T,T) matrix). Zero-filled weights on CUDA or the CPU: CPU
and CUDA autocast agree on every op a DiT uses with sdpa, so a CPU measurement stands for CUDA.
"""
import contextlib
import gc
import re
import sys
import time
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from shared.network.routing import draw_kept, kept_tokens
from shared.runtime.errors import UserError
from shared.network.blocks import SAVED_OPS, SELECTIVE
from shared.network.models import CLASS_DROPOUT_PROB, ModelConfig, check_preset
from train.config import TrainConfig, resolve_block
from shared.generative.objectives import objective_of
from train.step import autocast_context, forward_losses, make_learner, train_step
from train.units import parse_size


def synthetic_batch(shape_of, micro_batch: int, class_dropout_prob: float, objective, seed: int = 0,
                    extra: dict | None = None, route: tuple[int, int] | None = None) -> dict:
    """A micro-batch of the loader's keys, shapes and dtypes from random latents (bench and plan). shape_of: a
    ModelConfig or a DiT (both carry in_channels, input_size and num_classes). extra {column: shape}: also random
    columns of those per-sample shapes (REPA's "repr": (T, E)). route (T, K): the routed tokens' indices."""
    g = torch.Generator().manual_seed(seed)
    shape = (micro_batch, shape_of.in_channels, shape_of.input_size, shape_of.input_size)
    return {"x0": torch.randn(shape, generator=g),  # (B, C, h, w) fp32
            "label": torch.randint(0, shape_of.num_classes, (micro_batch,), generator=g),  # (B,)
            "drop": torch.rand(micro_batch, generator=g) < class_dropout_prob,  # (B,)
            "t": torch.cat([objective.draw_time(g) for _ in range(micro_batch)]),  # (B,)
            "noise": torch.randn(shape, generator=g),  # (B, C, h, w)
            "position": torch.arange(micro_batch, dtype=torch.int64),  # (B,)
            **{name: torch.randn((micro_batch, *shape), generator=g) for name, shape in (extra or {}).items()},
            **({"route_keep": torch.stack([draw_kept(g, *route) for _ in range(micro_batch)])} if route else {})}


def latent_shape(image_size: int, vae_factor: int = 8, channels: int = 4) -> tuple[int, int, int]:
    """(C, h, w) of the latents of an image size; UserError when it is not a multiple of the VAE factor."""
    if image_size <= 0 or vae_factor <= 0 or image_size % vae_factor:
        raise UserError(f"image size {image_size} is not a positive multiple of the VAE downsample factor "
                        f"{vae_factor}; use e.g. --image-size 256 with --vae-factor 8 (32x32 latents).")
    return channels, image_size // vae_factor, image_size // vae_factor


def measured_config(model: str, block: dict | None = None, **settings) -> TrainConfig:
    """The TrainConfig of a synthetic run of preset `model`, resolved as train resolves it (a DiTDH head filled in)."""
    check_preset(model)  # ChoiceError naming the presets
    return resolve_block(TrainConfig(latents="synthetic", results_dir="unused", model=model, **(block or {}),
                                     **settings))


def count_parameters(model) -> tuple[int, int]:
    """(all parameters including the frozen pos_embed, trainable parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


# Forward cost in multiply-accumulates (the DiT paper's unit). Which part a module path below the model belongs to
# (first match wins); attention splits further by op: its linear layers (addmm/mm) versus Q K^T and A V (bmm). A
# DiT^DH (shared/network/ddt.py) adds the body's patch embedding (s_embedder) and the projection of the body's tokens
# into the head's per-token conditioning (s_projector).
_PARTS = (("patch_embed", r"x_embedder"), ("patch_embed", r"s_embedder"), ("timestep_mlp", r"t_embedder"),
          ("adaln", r"blocks\.[^.]+\.adaLN_modulation"), ("attention", r"blocks\.[^.]+\.attn"),
          ("mlp", r"blocks\.[^.]+\.mlp"), ("head_condition", r"s_projector"), ("final_layer", r"final_layer"))
_LINEAR_OPS = ("aten.addmm", "aten.mm")


def _count_flops(model, kept: int | None = None) -> FlopCounterMode:
    """One batch-1 forward under a FlopCounterMode (meta works); kept: a routed training forward keeping that many."""
    device = model.x_embedder.proj.weight.device
    x = torch.zeros(1, model.in_channels, model.input_size, model.input_size, device=device)  # (1, C, H, W)
    width = getattr(model, "time_width", 1)  # MeanFlow's network takes (t, t - r) pairs, improved MeanFlow 5 columns
    t = torch.zeros((1, width) if width > 1 else (1,), device=device)
    y = torch.zeros(1, dtype=torch.long, device=device)
    routing = {} if kept is None else {"force_drop_ids": torch.zeros(1, dtype=torch.bool, device=device),
                                       "route_keep": torch.arange(kept, device=device).unsqueeze(0)}  # (1, K)
    backend, training = model.attention, model.training
    model.set_attention("math")  # plain matmuls, which the counter sees on every device (xformers' it would not)
    model.train(kept is not None)  # routing acts in train mode only; train mode adds no FLOPs to a DiT
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x, t, y, **routing)
    finally:
        model.set_attention(backend)
        model.train(training)
    return counter


def forward_macs(model, kept: int | None = None) -> dict:
    """Per-image forward MACs of a DiT by part (XL/2 at 256: 118.6 GMAC), from a real forward; meta works."""
    # FlopCounterMode records every matrix product and convolution (2 FLOPs per MAC), so the count follows what the
    # block is built of; label lookup and elementwise ops are not counted (the paper's convention).
    counts = _count_flops(model, kept).get_flop_counts()
    root = re.escape(type(model).__name__)
    parts = dict.fromkeys(("patch_embed", "timestep_mlp", "attention_linears", "attention_matmuls", "mlp",
                           "adaln", "final_layer"), 0)
    for path, ops in counts.items():
        part = next((name for name, pattern in _PARTS if re.fullmatch(rf"{root}\.{pattern}", path)), None)
        for op, flops in ops.items():
            if part == "attention":
                parts["attention_linears" if str(op) in _LINEAR_OPS else "attention_matmuls"] += flops // 2
            elif part is not None:
                parts[part] = parts.get(part, 0) + flops // 2
    total = sum(counts["Global"].values()) // 2
    if other := total - sum(parts.values()):  # products outside the known parts, rather than lost
        parts["other"] = other
    parts["total"] = total
    return parts


def head_macs(model, kept: int | None = None) -> int:
    """Per-image forward MACs of the DiT^DH head's blocks (0 without a head): a part of forward_macs' total."""
    if len(model.blocks) == model.depth:
        return 0
    root = type(model).__name__
    heads = {f"{root}.blocks.{i}" for i in range(model.depth, len(model.blocks))}
    counts = _count_flops(model, kept).get_flop_counts()
    return sum(sum(ops.values()) for path, ops in counts.items() if path in heads) // 2


def train_flops_per_image(model, kept: int | None = None) -> int:
    """Model FLOPs of one training image: 3 x forward, 2 FLOPs per MAC, recomputation not counted (PaLM App. B)."""
    return 6 * forward_macs(model, kept)["total"]


def _storage_key(tensor) -> tuple:
    """Identity of a tensor's memory: views of one buffer share it."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


class _Handle:
    """What the pack hook gives autograd: the saved tensor, detached (whole, it would make an uncollectable cycle)."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()  # same storage, no grad_fn: its grad_fn's node holds this handle


class SavedTensorLedger(torch.autograd.graph.saved_tensors_hooks):
    """Context recording the tensors autograd saves for backward that are still alive (weakly: nothing outlives it)."""
    def __init__(self, exclude_keys=()):
        self.live: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self.exclude = set(exclude_keys)
        super().__init__(self._pack, lambda handle: handle.tensor)

    def _pack(self, tensor):
        handle = _Handle(tensor)
        self.live.add(handle)
        return handle

    def storages(self) -> dict:
        """{storage key: bytes} of the live saved tensors, deduplicated, parameters excluded."""
        keyed = [(_storage_key(handle.tensor), handle.tensor) for handle in list(self.live)]
        return {key: tensor.untyped_storage().nbytes() for key, tensor in keyed if key not in self.exclude}


class OutputCounter(TorchDispatchMode):
    """{storage key: bytes} of the outputs of the ops `wanted(func, args)` picks, parameters excluded."""
    def __init__(self, param_keys, wanted):
        super().__init__()
        self.param_keys, self.wanted, self.found = set(param_keys), wanted, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.wanted(func, args):
            for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(tensor, torch.Tensor) and _storage_key(tensor) not in self.param_keys:
                    self.found[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return out


def _param_keys(module) -> set:
    """Storage keys of all parameters and buffers of a module."""
    return {_storage_key(t) for t in list(module.parameters()) + list(module.buffers())}


def measure_forward(model, batch: int, precision: str, objective, route=None) -> tuple[int, int, int]:
    """(bytes saved for backward, cast cache, their union) the trainer's forward + loss at `batch` leaves resident;
    route (tokens, kept): as set on the model."""
    device = next(model.parameters()).device
    micro = synthetic_batch(model, batch, CLASS_DROPOUT_PROB, objective, route=route)
    params = _param_keys(model)
    ledger = SavedTensorLedger(params)
    casts = OutputCounter(params, lambda func, args: func is torch.ops.aten._to_copy.default and bool(args)
                          and isinstance(args[0], torch.Tensor) and _storage_key(args[0]) in params)  # autocast's
    # the outputs selective checkpointing keeps (SAVED_OPS), unseen by saved-tensor hooks (conservative: all ops)
    kept = OutputCounter(params, lambda func, args: func in SAVED_OPS)
    selective = getattr(model, "grad_checkpoint_every", 0) == SELECTIVE
    model.train()
    with ledger, casts, kept if selective else contextlib.nullcontext(), autocast_context(device, precision):
        loss = forward_losses(model, objective, micro, precision, device)["loss"]
        saved = {**kept.found, **ledger.storages()}  # read inside autocast: the cast cache is still alive here
    del loss
    return sum(saved.values()), sum(casts.found.values()), sum({**casts.found, **saved}.values())


def measure_block(model, batch: int, precision: str, index: int = 0) -> int:
    """Bytes block `index` saves for backward at `batch`: the peak added when it is recomputed under checkpointing."""
    block = model.blocks[index]
    device = next(model.parameters()).device
    width, tokens = block.attn.qkv.in_features, model.x_embedder.num_patches
    head = index >= model.depth  # a DiT^DH head block: its own width and a per-token condition
    x = torch.zeros(batch, tokens, width, device=device, requires_grad=True)  # (N, T, D) the fp32 residual stream
    c = torch.zeros(batch, *((tokens,) if head else ()), width, device=device, requires_grad=True)  # (N, [T,] D)
    rope = model.dec_feat_rope if head else model.feat_rope  # RoPE, when built, as in the forward
    ledger = SavedTensorLedger(_param_keys(model) | {_storage_key(x), _storage_key(c)})
    with ledger, autocast_context(device, precision):
        out = block._forward(x, c, rope)  # (N, T, D): the block itself, whatever checkpointing it is set to
        saved = ledger.storages()
    del out
    return sum(saved.values())


@dataclass
class LinearBytes:
    """bytes(n) = const + per_sample * n, fitted from measurements at batch 1 and 2."""
    const: int
    per_sample: int

    @classmethod
    def fit(cls, at1: int, at2: int) -> "LinearBytes":
        return cls(const=2 * at1 - at2, per_sample=at2 - at1)

    def at(self, n: int) -> int:
        return self.const + self.per_sample * n


@dataclass
class ActivationProfile:
    """Measured activation memory of one checkpointing choice, as functions of the micro-batch."""
    every: int | str  # 0 off, k every k-th block, SELECTIVE
    saved: LinearBytes        # saved for backward by the whole step (checkpointed blocks keep only inputs)
    resident: LinearBytes     # saved + autocast weight copies, alive until the forward ends
    recompute: LinearBytes    # one block's saved tensors, re-created in backward (0 without checkpointing)
    cast_cache: int

    def peak(self, n: int) -> int:
        """Activation bytes at the worse of forward end and backward start (incl. one recomputed block)."""
        return max(self.resident.at(n), self.saved.at(n) + self.recompute.at(n))


def measure_profile(model, every: int, precision: str, block_fit: LinearBytes, objective,
                    route=None) -> ActivationProfile:
    """One checkpointing choice measured at batch 1 and 2 and fitted (block_fit: its largest checkpointed block's)."""
    model.set_grad_checkpointing(every)
    (saved1, casts, resident1), (saved2, _, resident2) = (measure_forward(model, n, precision, objective, route=route)
                                                          for n in (1, 2))
    return ActivationProfile(every, LinearBytes.fit(saved1, saved2), LinearBytes.fit(resident1, resident2),
                             block_fit if every else LinearBytes(0, 0), casts)


def measure_block_fit(model, precision: str, index: int = 0) -> LinearBytes:
    """Block `index`'s saved bytes as a linear function of the batch."""
    return LinearBytes.fit(*(measure_block(model, n, precision, index) for n in (1, 2)))


def measure_block_fits(model, precision: str) -> dict:
    """{kind (a range of block indices: the body, then a DiT^DH's head): one of its blocks' LinearBytes}."""
    kinds = [range(model.depth)] + ([range(model.depth, len(model.blocks))] if len(model.blocks) > model.depth else [])
    return {kind: measure_block_fit(model, precision, kind[0]) for kind in kinds}


def recompute_fit(fits: dict, every: int) -> LinearBytes:
    """The largest block a backward recomputes with every `every`-th block checkpointed (0: none recomputed)."""
    every = 1 if every == SELECTIVE else every  # selective recomputes in every block (at most its saved tensors)
    chosen = [fit for kind, fit in fits.items() if every and any(i % every == 0 for i in kind)]
    return max(chosen, key=lambda fit: (fit.per_sample, fit.const), default=LinearBytes(0, 0))


OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2}  # AdamW: two fp32 moments; 8-bit: two 1-byte moments
DEFAULT_MARGIN = "1.5GiB"  # CUDA context, cuBLAS workspace, allocator slack (train.plan's --margin, autotune's)


@dataclass
class FixedState:
    """Bytes that do not depend on the batch: fp32 master weights, gradients, optimizer state, EMA."""
    weights: int
    grads: int
    optimizer: int
    ema: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.ema


def fixed_state(n_params: int, n_trainable: int, optimizer: str, ema_device: str) -> FixedState:
    """Fixed state of the DiT recipe: fp32 weights + fp32 grads + optimizer moments + fp32 EMA."""
    return FixedState(weights=4 * n_params, grads=4 * n_trainable,
                      optimizer=OPTIMIZER_STATE_BYTES[optimizer] * n_trainable,
                      ema=4 * n_params if ema_device == "gpu" else 0)


@dataclass
class PlanRow:
    """One checkpointing choice: its measured activations and the micro-batch that fits."""
    profile: ActivationProfile
    micro: int | None           # None: not even a micro-batch of 1 fits
    accumulation: int | None
    peak: int | None            # predicted peak allocated bytes at `micro` (fixed + activations)


def per_process_batch(global_batch: int, processes: int) -> int:
    """Samples per process per optimizer step; UserError when the global batch does not divide."""
    if global_batch <= 0 or processes <= 0 or global_batch % processes:
        raise UserError(f"global batch {global_batch} does not split evenly over {processes} process(es); "
                        "pick a global batch that is a multiple of the process count.")
    return global_batch // processes


def largest_micro_batch(profile: ActivationProfile, fixed: int, budget: int, batch: int) -> int | None:
    """Largest divisor m of the per-process batch with fixed + activations(m) <= budget."""
    return next((m for m in range(batch, 0, -1) if batch % m == 0 and fixed + profile.peak(m) <= budget), None)


def plan_row(profile: ActivationProfile, fixed: int, budget: int, batch: int) -> PlanRow:
    """The plan for one checkpointing choice."""
    micro = largest_micro_batch(profile, fixed, budget, batch)
    if micro is None:
        return PlanRow(profile, None, None, None)
    return PlanRow(profile, micro, batch // micro, fixed + profile.peak(micro))


def measure_device(choice: str, flag: str = "--measure-device") -> torch.device:
    """auto: CUDA when present, else the CPU; UserError when `flag` asks for CUDA and none is visible."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{flag} {choice} was asked for but no CUDA GPU is visible; use {flag} cpu (what auto picks "
                        "when no GPU is present).")
    return torch.device(choice)


def measure_profiles(config, precision: str, choices, device, route=None) -> tuple[list, int, int]:
    """(profiles, params, trainable) of each choice on one zero-filled model; route (ratio, start, end)."""
    model = config.build(device=device, init=False)
    n_params, n_trainable = count_parameters(model)
    bar = tqdm(total=1 + len(choices), desc="measuring activations", unit="pass", leave=False, file=sys.stderr)
    fits = measure_block_fits(model, precision)  # full-token blocks of each kind (a DiT^DH's head is the larger)
    bar.update()
    shape = None
    if route is not None:  # the routed blocks' activations are those of the kept tokens
        ratio, start, end = route
        model.set_routing(start, end)
        shape = (model.x_embedder.num_patches, kept_tokens(model.x_embedder.num_patches, ratio))
    profiles = []
    for every in choices:
        profiles.append(measure_profile(model, every, precision, recompute_fit(fits, every), objective_of(config),
                                        shape))
        bar.update()
    bar.close()
    return profiles, n_params, n_trainable


class CudaAllocator:
    """The CUDA caching allocator as --verify and autotune's confirmation read it (the seam a CPU test replaces)."""
    device = torch.device("cuda")
    available = staticmethod(torch.cuda.is_available)
    synchronize = staticmethod(torch.cuda.synchronize)
    reset_peak = staticmethod(torch.cuda.reset_peak_memory_stats)
    peak = staticmethod(torch.cuda.max_memory_allocated)  # since reset_peak: what the planner predicts
    reserved = staticmethod(torch.cuda.memory_reserved)  # allocated plus the unused parts of its segments

    def total(self) -> int:
        """Bytes of the card."""
        return torch.cuda.get_device_properties(self.device).total_memory

    def release(self) -> None:
        """Free what nothing references any more: reference cycles holding tensors, then the allocator's cache."""
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def capped(self, limit: int):
        """Inside the block the allocator holds at most `limit` bytes, as a smaller card would (restored after)."""
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
        before = get(self.device) if get is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / self.total()), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, self.device)


def allocator() -> CudaAllocator:
    """The device memory --verify and the confirmation measure (a test replaces this to run them on the CPU)."""
    return CudaAllocator()


def verify_config(config: ModelConfig, args, row: PlanRow) -> TrainConfig:
    """The TrainConfig `python -m train` would be given for the plan; args: train.plan's flags or the run's config."""
    accumulation = min(row.accumulation, 2)  # a second micro-step runs with the first one's gradients held
    route = {k: getattr(args, k, None) for k in ("route_ratio", "route_start", "route_end")}
    return measured_config(args.model, config.block_options,
                           global_batch_size=row.micro * accumulation, micro_batch_size=row.micro,
                           grad_accum_steps=accumulation, precision=args.precision,
                           grad_checkpoint=row.profile.every, optimizer=args.optimizer, ema_device=args.ema_device,
                           **{k: v for k, v in route.items() if v is not None})


@dataclass
class Verified:
    """A real CUDA step at the planned micro-batch: its peak allocated bytes and the timed steps' seconds."""
    peak: int
    seconds: list
    images: int  # per optimizer step (micro-batch x the accumulation verify runs)


class StepOutOfMemory(Exception):
    """The trainer's step at `micro` ran out of memory under `limit` bytes; it needed at least `needed`."""
    def __init__(self, micro: int, needed: int, limit: int | None):
        self.micro, self.needed, self.limit = micro, needed, limit
        super().__init__(f"micro-batch {micro}: out of memory, needed {needed} bytes (limit {limit})")


_REQUEST = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ?([KMGT]i?B|B)")  # CUDA's out-of-memory message


def requested_bytes(error: BaseException) -> int:
    """The allocation a CUDA out-of-memory error could not make ('Tried to allocate 2.00 GiB'), 0 if unnamed."""
    found = _REQUEST.search(str(error))
    return parse_size(found.group(1) + found.group(2)) if found else 0


def verify_step(config, args, row: PlanRow, timed: int = 0, budget: int | None = None) -> Verified:
    """Peak bytes of the trainer's step at the planned micro-batch, capped at `budget`; StepOutOfMemory if it fails."""
    cuda = allocator()
    cuda.release()  # nothing measured before (the planner's model, an earlier try's learner) counts in the peak
    limit = None if budget is None else min(budget, cuda.total())
    verified = None
    with cuda.capped(limit) if limit is not None else contextlib.nullcontext():
        try:
            verified = _timed_steps(config, args, row, timed, cuda)
        except torch.OutOfMemoryError as err:
            needed = cuda.reserved() + requested_bytes(err)  # while the failed step's tensors are still held
    cuda.release()  # the step's learner is gone (returned, or died with the exception's frames): its memory back
    if verified is None:
        raise StepOutOfMemory(row.micro, needed, limit)
    return verified


def _timed_steps(config, args, row: PlanRow, timed: int, cuda: CudaAllocator) -> Verified:
    """verify_step's measurement: a step that allocates the optimizer state, the measured step, `timed` more."""
    cfg = verify_config(config, args, row)
    learner = make_learner(cfg, config, device=cuda.device)
    batches = [synthetic_batch(config, row.micro, cfg.class_dropout_prob, learner.objective, seed=i,
                               route=learner.route) for i in range(cfg.grad_accum_steps)]
    train_step(learner, batches)  # allocates the optimizer state
    cuda.synchronize()
    cuda.reset_peak()
    train_step(learner, batches)
    cuda.synchronize()
    peak, seconds = cuda.peak(), []
    for _ in range(timed):
        start = time.perf_counter()
        train_step(learner, batches)
        cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return Verified(peak, seconds, row.micro * cfg.grad_accum_steps)
