"""The transformer block's options, one table (LightningDiT, Yao et al. 2025, github hustvl/LightningDiT, MIT).

One BlockOption per slot value (its help, what it builds, the `marker` tensor that shows it in weights); DiT and
DiT^DH build their blocks from it. The built-ins register in dit.py, a --plugin with `register_block_option`;
LightningDiT's modules (RMSNorm, SwiGLU, 2-D RoPE) are at the end of this file.
"""
import argparse
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shared.runtime.cli import Flag
from shared.runtime.errors import ChoiceError, UserError
from shared.runtime.registry import Registry, plugin_module

# Checkpointing of every block that keeps matmul and attention outputs and recomputes only the pointwise ops.
SELECTIVE = "selective"
NORM_EPS = 1e-6  # DiT's LayerNorms and LightningDiT's RMSNorms alike
ROPE_THETA = 10000  # rotary base period, as LightningDiT (EVA-02's VisionRotaryEmbeddingFast)


# The places in the block an option fills, with their flag's help; each slot's `build` takes: norm (dim), mlp (dim,
# mlp_ratio), rope (head_dim, grid), qk_norm (head_dim, norm). SWITCHES take True/False; False builds nothing.
SLOTS = {
    "norm": "normalisation before attention, MLP and output", "mlp": "feed-forward",
    "rope": "2-D rotary position embedding on queries and keys, added to the absolute sin-cos embedding as "
            "LightningDiT; the model then runs only at the latent size it was built for",
    "qk_norm": "normalise queries and keys per head before attention; steadies fp16/bf16 training"}
SWITCHES = ("rope", "qk_norm")
BLOCK_FIELDS = tuple(SLOTS)


@dataclass(frozen=True)
class BlockOption:
    """One value of one slot and what it builds there (build's arguments: SLOTS' comment); marker: how weights show it."""

    slot: str
    value: str | bool
    help: str
    build: Callable | None
    marker: str = ""  # a tensor name only weights with this value have ("" = none)
    qk: Callable | None = None  # norm only: the per-head layer QK-norm uses with this norm (default: build)
    module: str = ""  # the module that registered it ("" = built in), recorded with the model

    def qk_layer(self, head_dim: int) -> nn.Module:
        """This norm's per-head layer for QK-norm."""
        return (self.qk or self.build)(head_dim)


BLOCK_OPTIONS: dict[str, Registry[BlockOption]] = {
    slot: Registry(f"block {slot}", lambda o: o.module or __name__, lambda o: f"{o.value}: {o.help}") for slot in SLOTS}


def register_block_option(slot: str, value, help: str, build: Callable | None, marker: str = "",
                          qk: Callable | None = None) -> BlockOption:
    """Add `value` to `slot`'s choices (a name for norm/mlp; True/False for a switch); a taken value is refused."""
    if slot not in SLOTS:
        raise TypeError(f"no block slot {slot!r}; the slots are {', '.join(SLOTS)}")
    if (slot in SWITCHES) != isinstance(value, bool):
        raise TypeError(f"block slot {slot} takes {'True/False' if slot in SWITCHES else 'a name'}, not {value!r}")
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return BLOCK_OPTIONS[slot].register(value, BlockOption(slot, value, help, build, marker, qk, plugin_module(caller)))


def block_option(slot: str, value) -> BlockOption:
    """The record of one slot's value; ChoiceError (UserError for a switch) naming the registered ones."""
    assert BLOCK_OPTIONS["norm"], "import shared.network.dit first: it registers the built-in block options"
    if slot in SWITCHES and not isinstance(value, bool):
        raise UserError(f"block option {slot} must be true or false, got {value!r}; fix the config or flag.")
    return BLOCK_OPTIONS[slot].lookup(value)


def build_part(slot: str, value, *args) -> nn.Module | None:
    """What `slot`'s `value` builds from the slot's arguments (None for a switch that is off)."""
    build = block_option(slot, value).build
    return build(*args) if build is not None else None


def check_block_options(options: dict) -> None:
    """ChoiceError/UserError unless `options` gives every slot a registered value (and nothing else)."""
    assert set(options) == set(SLOTS), f"block options {sorted(options)} are not the slots {', '.join(SLOTS)}"
    for slot, value in options.items():
        block_option(slot, value)


def block_plugins(options: dict) -> list[str]:
    """The --plugin modules that register these options' values (none for the built-ins)."""
    return sorted({m for slot, value in options.items() if (m := block_option(slot, value).module)})


def block_flag(slot: str) -> Flag:
    """The training flag of a slot (--norm, --rope/--no-rope, ...), its help from the table; None: the --block's."""
    if slot in SWITCHES:
        return Flag(f"{SLOTS[slot]} ({block_option(slot, True).help}) (default: the --block's)", None,
                    action=argparse.BooleanOptionalAction)
    return Flag(f"{SLOTS[slot]}: " + "; ".join(f"{o.value}: {o.help}" for o in BLOCK_OPTIONS[slot].values())
                + " (a --plugin module may register more; default: the --block's)", None, metavar="NAME")


def block_summary(options: dict) -> str:
    """The options in one line for logs ("norm rmsnorm, mlp swiglu, rope True, qk_norm False")."""
    return ", ".join(f"{slot} {options[slot]}" for slot in SLOTS)


def infer_block(state_dict: dict) -> dict:
    """Each slot's value read from which tensors exist (the records' markers); UserError when none fits."""
    options = {}
    for slot, choices in BLOCK_OPTIONS.items():
        marked = [o.value for o in choices.values() if o.marker and o.marker in state_dict]
        unmarked = [o.value for o in choices.values() if not o.marker and not o.module]  # a plugin's needs a marker
        found = marked or unmarked
        if len(found) != 1:
            names = sorted(k for k in state_dict if k.startswith("blocks.0."))
            raise UserError(f"these weights' block {slot} cannot be told from their tensors ({names[:8] or 'none'}): "
                            f"{'several' if found else 'none'} of the registered values ({', '.join(map(str, choices))}) "
                            "fit. Use weights of a DiT_models preset with the block options of "
                            "shared.network.blocks.BLOCKS, or an export (which carries its config).")
        options[slot] = found[0]
    return options


# Block presets. "lightning" is the block of LightningDiT's released configs (configs/*.yaml: use_rmsnorm, use_swiglu,
# use_rope true; use_qknorm false); its README advises QK-norm when large runs hit NaN losses: "lightning-qknorm".
BLOCKS = {"dit": dict(norm="layernorm", mlp="gelu", rope=False, qk_norm=False),
          "lightning": dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=False),
          "lightning-qknorm": dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=True)}
BLOCK_HELP = ("dit: LayerNorm + GELU MLP, absolute positions only (DiT); lightning: RMSNorm + SwiGLU + 2-D RoPE, the "
              "block of LightningDiT's released configs; lightning-qknorm: that plus QK-norm (LightningDiT's advice "
              "against NaN losses)")


def block_options(preset="dit", **overrides):
    """The options of a BLOCKS preset with the non-None overrides applied, checked; ChoiceError/UserError."""
    if preset not in BLOCKS:
        raise ChoiceError("block preset", preset, list(BLOCKS))
    assert set(overrides) <= set(SLOTS), f"block options {sorted(overrides)} are not all among {list(SLOTS)}"
    options = {**BLOCKS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    check_block_options(options)
    return options


def block_name(options):
    """The BLOCKS preset these options are, or "custom"."""
    chosen = {k: options[k] for k in SLOTS}
    return next((name for name, preset in BLOCKS.items() if preset == chosen), "custom")


# --- Selective activation checkpointing of a block ---

# The aten ops whose outputs selective checkpointing keeps: matmuls and every SDPA kernel this torch has.
_SAVED_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_fused_attention_overrideable")
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_NAMES if hasattr(torch.ops.aten, name))


def selective_policy(ctx, op, *args, **kwargs):
    """Keep what costs FLOPs (matmuls, attention) for backward; recompute the cheap pointwise ops (norms, GELU, adaLN)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


selective_contexts = partial(create_selective_checkpoint_contexts, selective_policy)  # () -> (forward, recompute)


# --- What LightningDiT's options build (their records: shared/network/dit.py, beside DiT's) ---

class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * gain over the last dim (Zhang & Sennrich, 2019), normalised in fp32 at least."""

    def __init__(self, dim, eps=NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # learned gain, as LightningDiT's (DiT's LayerNorms have none)

    def forward(self, x):
        """(..., dim) -> (..., dim); the normalised value is cast back to x's dtype before the gain."""
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 -> fp32; a float64 model stays float64
        return F.rms_norm(wide, (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


def swiglu_hidden(dim, mlp_ratio=4.0):
    """SwiGLU width, LightningDiT's int(2/3 * int(dim * mlp_ratio)): as many weights as the GELU MLP (3072 at XL)."""
    return int(2 / 3 * int(dim * mlp_ratio))


class SwiGLU(nn.Module):
    """SiLU-gated feed-forward (Shazeer 2020, "GLU Variants", Eq. 6 FFN_SwiGLU) with biases, names as LightningDiT."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden_dim, bias=True)  # gate and value projections, fused
        self.w3 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x):
        """(N, T, D) -> (N, T, D)."""
        gate, value = self.w12(x).chunk(2, dim=-1)  # 2 x (N, T, hidden)
        return self.w3(F.silu(gate) * value)


def rope_angles(head_dim, grid_size, theta=ROPE_THETA):
    """(T, head_dim) angles: a head's first half turned by the token's row, the second by its column (RoFormer Eq. 15)."""
    # head_dim/4 frequencies theta^(-j / (head_dim/4)) per axis, each turning one interleaved channel pair (2i, 2i+1);
    # tokens in row-major patch order: LightningDiT's VisionRotaryEmbeddingFast(dim=head_dim/2, pt_seq_len=grid).
    quarter = head_dim // 4
    freqs = theta ** -(torch.arange(quarter, dtype=torch.float64) / quarter)  # (head_dim/4,)
    rows, cols = torch.meshgrid(torch.arange(grid_size), torch.arange(grid_size), indexing="ij")
    angles = torch.cat([rows.reshape(-1, 1) * freqs, cols.reshape(-1, 1) * freqs], dim=1)  # (T, head_dim/2)
    return angles.repeat_interleave(2, dim=1)  # (T, head_dim)


def rotate_pairs(x):
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): multiplication by i of each channel pair."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., d/2, 2)
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (..., d)


class RotaryEmbedding2d(nn.Module):
    """Rotates queries/keys (N, H, T, d) by their token's grid position; tables built for one grid size."""

    def __init__(self, head_dim, grid_size):
        super().__init__()
        if head_dim % 4:
            raise UserError(f"2-D RoPE needs a head dimension divisible by 4 (a channel pair per frequency, rows "
                            f"and columns), but heads have {head_dim} channels; pick a preset whose width / heads "
                            "is a multiple of 4, or train without --rope.")
        self.head_dim, self.grid_size = head_dim, grid_size
        # Persistent, as LightningDiT's feat_rope (they mark a RoPE state dict); filled by initialize_weights.
        self.register_buffer("freqs_cos", torch.zeros(grid_size * grid_size, head_dim))  # (T, d)
        self.register_buffer("freqs_sin", torch.zeros(grid_size * grid_size, head_dim))  # (T, d)

    @torch.no_grad()
    def reset_tables(self):
        """Write cos/sin of rope_angles (computed on the CPU in float64) into the buffers."""
        angles = rope_angles(self.head_dim, self.grid_size)
        self.freqs_cos.copy_(angles.cos().float().to(self.freqs_cos.device))
        self.freqs_sin.copy_(angles.sin().float().to(self.freqs_sin.device))

    def forward(self, x):
        """(N, H, T, d) -> (N, H, T, d) in fp32 (the fp32 tables promote; Attention casts back)."""
        return x * self.freqs_cos + rotate_pairs(x) * self.freqs_sin


class RoutedRope(nn.Module):
    """A RotaryEmbedding2d's rotation for the tokens a route keeps: each keeps its own grid position's angles."""

    def __init__(self, rope: RotaryEmbedding2d, keep: torch.Tensor):
        super().__init__()
        self.freqs_cos = rope.freqs_cos[keep].unsqueeze(1)  # (N, 1, K, d), broadcast over heads
        self.freqs_sin = rope.freqs_sin[keep].unsqueeze(1)  # (N, 1, K, d)

    def forward(self, x):
        """(N, H, K, d) -> (N, H, K, d): RotaryEmbedding2d's rotation with per-sample tables."""
        return RotaryEmbedding2d.forward(self, x)
