"""DiT (Peebles & Xie, 2023): the model, its presets, its config, and preset inference from weights.

Parameter names, shapes, initialisation and numerics follow the official release, so the official
checkpoints (e.g. DiT-XL-2-256x256.pt) load with strict=True and give the same outputs.

Block options (LightningDiT, Yao et al. 2025, github hustvl/LightningDiT, MIT): RMSNorm, a SwiGLU MLP,
2-D rotary position embedding and QK-norm, each a ModelConfig field whose default is the official
block; BLOCKS names the combinations. Their tensor names follow LightningDiT's (mlp.w12/w3, norm1.weight,
attn.q_norm, feat_rope.freqs_cos/sin), so inference from a state dict can tell the layouts apart.
"""
import contextlib
import functools
import importlib
import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shared.generative.objectives import DEFAULT_OBJECTIVE
from shared.network.routing import gather_tokens, scatter_tokens
from shared.runtime.errors import ChoiceError, SettingError, UserError

ATTENTION_BACKENDS = ("auto", "sdpa", "xformers", "math")
FREQUENCY_EMBEDDING_SIZE = 256  # sinusoidal timestep features fed to the timestep MLP (DiT Sec. 3.2)
CLASS_DROPOUT_PROB = 0.1  # DiT's label dropout: the null class that classifier-free guidance needs
NORM_EPS = 1e-6  # DiT's LayerNorms and LightningDiT's RMSNorms alike
ROPE_THETA = 10000  # rotary base period, as LightningDiT (EVA-02's VisionRotaryEmbeddingFast)
# Gradient checkpointing of every block that keeps the matmul and attention outputs and recomputes only the
# pointwise ops between them (selective activation checkpointing): between "off" and "every block" in memory.
SELECTIVE = "selective"

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
BLOCK_FIELDS = ("norm", "mlp", "rope", "qk_norm")
# Block presets. "lightning" is the block of LightningDiT's released configs (configs/*.yaml: use_rmsnorm,
# use_swiglu, use_rope true; use_qknorm false); its README recommends adding QK-norm when large runs hit
# NaN losses (at a slight cost in convergence speed), which is "lightning-qknorm".
BLOCKS = {
    "dit": dict(norm="layernorm", mlp="gelu", rope=False, qk_norm=False),
    "lightning": dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=False),
    "lightning-qknorm": dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=True),
}


def block_options(preset="dit", **overrides):
    """{norm, mlp, rope, qk_norm} of a BLOCKS preset with the non-None overrides applied; ChoiceError/UserError."""
    if preset not in BLOCKS:
        raise ChoiceError("block preset", preset, list(BLOCKS))
    options = dict(BLOCKS[preset])
    unknown = sorted(set(overrides) - set(BLOCK_FIELDS))
    if unknown:
        raise UserError(f"unknown block options {unknown}; the block options are {', '.join(BLOCK_FIELDS)}.")
    options.update({k: v for k, v in overrides.items() if v is not None})
    check_block_options(**options)
    return options


def check_block_options(norm, mlp, rope, qk_norm):
    """ChoiceError/UserError unless the four block options are known values."""
    if norm not in NORMS:
        raise ChoiceError("block norm", norm, NORMS, "layernorm is DiT's, rmsnorm LightningDiT's")
    if mlp not in MLPS:
        raise ChoiceError("block mlp", mlp, MLPS, "gelu is DiT's, swiglu LightningDiT's")
    for name, value in (("rope", rope), ("qk_norm", qk_norm)):
        if not isinstance(value, bool):
            raise UserError(f"block option {name} must be true or false, got {value!r}; fix the config or flag.")


def block_name(options):
    """The BLOCKS preset these options are, or "custom"."""
    chosen = {k: options[k] for k in BLOCK_FIELDS}
    return next((name for name, preset in BLOCKS.items() if preset == chosen), "custom")


def per_token(v):
    """A modulation vector (N, D) broadcast over tokens as (N, 1, D); a per-token one (N, T, D) as it is."""
    return v.unsqueeze(1) if v.dim() == 2 else v


def modulate(x, shift, scale):
    """adaLN modulation x * (1 + scale) + shift: one (N, D) vector per image, or (N, T, D) per token (DiT^DH head)."""
    return x * (1 + per_token(scale)) + per_token(shift)  # (N, T, D)


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


def block_norm(kind, dim):
    """The pre-attention/pre-MLP/final normaliser: affine-free LayerNorm (DiT) or RMSNorm (LightningDiT)."""
    if kind == "rmsnorm":
        return RMSNorm(dim)
    return nn.LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS)


def qk_norm_layer(kind, head_dim):
    """Per-head QK-norm (Dehghani et al. 2023): RMSNorm with the rmsnorm block, else LayerNorm (affine, eps 1e-5).

    As LightningDiT's Attention, whose q_norm/k_norm is RMSNorm(head_dim) when use_rmsnorm, else timm's
    default nn.LayerNorm.
    """
    return RMSNorm(head_dim) if kind == "rmsnorm" else nn.LayerNorm(head_dim)


#################################################################################
#                     Fixed sine-cosine positional embedding                    #
#################################################################################

def sincos_1d(dim, positions):
    """Sine half then cosine half of positions / 10000^(2i/dim) (Transformer positional encoding)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))  # (dim/2,)
    angles = positions.reshape(-1, 1).double() * omega  # (M, dim/2)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # (M, dim)


def sincos_2d(dim, grid_size):
    """(grid_size**2, dim) MAE-style 2-D embedding; first half encodes the column, second the row."""
    # The official code builds its grid with meshgrid(w, h), so its "emb_h" half actually holds the
    # column index; we keep that order so official checkpoints see the embedding they were trained with.
    rows, cols = torch.meshgrid(torch.arange(grid_size), torch.arange(grid_size), indexing="ij")
    return torch.cat([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], dim=1)  # (T, dim)


#################################################################################
#                 Embedding layers for patches, timesteps and labels            #
#################################################################################

class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches projected to D channels by a strided convolution."""

    def __init__(self, input_size, patch_size, in_channels, hidden_size):
        super().__init__()
        self.input_size, self.patch_size = input_size, patch_size
        self.num_patches = (input_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x):
        """(N, C, H, W) latents -> (N, T, D) tokens in row-major patch order."""
        x = self.proj(x)  # (N, D, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (N, T, D)


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features followed by a two-layer SiLU MLP."""

    def __init__(self, hidden_size, frequency_embedding_size=FREQUENCY_EMBEDDING_SIZE):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        """(N,) possibly fractional timesteps -> (N, dim) features, cosine half first (as GLIDE/ADM)."""
        half = dim // 2
        # fp32 on purpose: the official checkpoints were trained with exactly these fp32 features.
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]  # (N, half)
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, 2*half)
        if dim % 2:
            embedding = F.pad(embedding, (0, 1))  # (N, dim)
        return embedding

    def forward(self, t):
        """(N,) timesteps -> (N, D) embeddings."""
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))  # (N, D)


class LabelEmbedder(nn.Module):
    """Class embedding table; the extra last row is the null class used for classifier-free guidance."""

    def __init__(self, num_classes, hidden_size, dropout_prob):
        super().__init__()
        self.has_null = dropout_prob > 0  # as official: no null row when the model never drops labels
        self.embedding_table = nn.Embedding(num_classes + int(self.has_null), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels, force_drop_ids=None):
        """Replace labels by the null class with probability dropout_prob (or where force_drop_ids == 1)."""
        if force_drop_ids is None:
            # Global torch RNG, so seeding torch reproduces which labels were dropped.
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids.to(labels.device) == 1
        return torch.where(drop_ids, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels, train, force_drop_ids=None):
        """(N,) labels -> (N, D); drops labels during training for CFG (Ho & Salimans, 2022)."""
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)  # (N, D)


#################################################################################
#                        2-D rotary position embedding                          #
#################################################################################

def rope_angles(head_dim, grid_size, theta=ROPE_THETA):
    """(T, head_dim) rotation angles: first half of a head turned by the token's row, second half by its column.

    RoFormer (Su et al. 2021, Eq. 15) per axis with head_dim/4 frequencies theta^(-j / (head_dim/4)); each
    frequency turns one interleaved channel pair (2i, 2i+1), so it appears twice. Tokens in row-major patch
    order. This is LightningDiT's VisionRotaryEmbeddingFast(dim=head_dim/2, pt_seq_len=grid) table.
    """
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
        # Persistent, as LightningDiT's feat_rope buffers: they mark a RoPE state dict and pin its grid.
        # Filled by DiT.initialize_weights (like pos_embed), so building on the meta device stays cheap.
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


#################################################################################
#                          Attention with swappable kernels                     #
#################################################################################

def _import_xformers_ops():
    """Import xformers.ops or raise a UserError naming the fix."""
    try:
        return importlib.import_module("xformers.ops")
    except Exception as err:  # ImportError, or a broken build raising anything at import time
        raise SettingError(
            f"attention backend 'xformers' was requested but xformers cannot be imported ({err}). "
            "Install the xformers wheel that matches your torch and CUDA build (see "
            "requirements-xformers.txt), or use {attention backend} sdpa, which needs nothing extra."
        ) from err


def resolve_attention(backend):
    """Check an attention backend name and return the concrete one ("auto" means "sdpa")."""
    if backend not in ATTENTION_BACKENDS:
        raise ChoiceError("attention backend", backend, ATTENTION_BACKENDS,
                          "'auto' uses torch's scaled_dot_product_attention")
    if backend == "xformers":
        _import_xformers_ops()
    return "sdpa" if backend == "auto" else backend


# SDPA's fused kernels on CUDA, in the order tried at first use (the fastest first where it runs: cuDNN and flash on
# Ampere and later at head sizes up to 128/256, XL/2's 72 included; the memory-efficient kernel also in fp32 and on
# older GPUs). The math kernel, which materialises the (N, H, T, T) matrix, is the named fallback, never a silent one.
SDPA_KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
SDPA_FALLBACK = "MATH"
SDPA_NAMES = {"CUDNN_ATTENTION": "cuDNN", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient",
              "MATH": "math"}
_sdpa_choices: dict = {}  # (device, dtype, head size) -> the SDPBackend name chosen there, probed once per process


def probe_sdpa_kernel(kernel: str, device, dtype, head_dim: int) -> bool:
    """Whether SDPA restricted to `kernel` (an SDPBackend name) runs forward and backward at this dtype and head size."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 2, 64, head_dim, device=device, dtype=dtype, requires_grad=True)  # (N, H, T, d)
    try:
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            F.scaled_dot_product_attention(q, q, q).float().sum().backward()
    except RuntimeError:  # "No available kernel": this kernel does not take these inputs on this GPU
        return False
    return True


def _say(line: str) -> None:
    """One line to stderr (the stages' progress stream)."""
    print(line, file=sys.stderr, flush=True)


def choose_sdpa_kernel(device, dtype, head_dim: int, say=_say) -> str:
    """The first of SDPA_KERNELS that runs here (probed once per device, dtype and head size), else SDPA_FALLBACK;
    says in one line which it is (the fallback as a notice naming what it costs)."""
    key = (str(device), dtype, head_dim)
    if key not in _sdpa_choices:
        chosen = next((k for k in SDPA_KERNELS if probe_sdpa_kernel(k, device, dtype, head_dim)), SDPA_FALLBACK)
        _sdpa_choices[key] = chosen
        where = f"head size {head_dim} in {str(dtype).removeprefix('torch.')} on {device_name(device)}"
        if chosen == SDPA_FALLBACK:
            say(f"attention: notice: none of SDPA's fused kernels ({', '.join(SDPA_NAMES[k] for k in SDPA_KERNELS)}) "
                f"runs at {where}; using the math kernel, which is slower and stores the full attention matrix")
        else:
            say(f"attention: SDPA's {SDPA_NAMES[chosen]} kernel at {where}")
    return _sdpa_choices[key]


def device_name(device) -> str:
    """The GPU's name for messages (the device string elsewhere)."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def compile_blocks(model: torch.nn.Module, backend="inductor", **options) -> torch.nn.Module:
    """Regional compilation: each of `model.blocks` compiled in place; returns `model`.

    The blocks are instances of one class, so dynamo compiles their forward once (parameters are graph inputs, not
    constants) and reuses it for every other block: compile time is one block's, whatever the depth. A DiT^DH head
    (another width) adds one graph; embedders and the final layer stay eager. Training and sampling both call it.
    """
    for block in model.blocks:
        block.compile(backend=backend, **options)
    return model


def prepare_attention(model, device, dtype, choose=choose_sdpa_kernel) -> None:
    """On CUDA, pin each sdpa block's attention to the kernel chosen for its head size at `dtype` (the autocast
    dtype, or fp32), probed before the first forward (and before torch.compile traces it). Elsewhere nothing."""
    if torch.device(device).type != "cuda":
        return
    for block in model.blocks:
        if block.attn.backend == "sdpa":
            block.attn.sdpa_kernel = choose(device, dtype, block.attn.head_dim)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (names as timm's, as the checkpoints).

    Optional QK-norm and rotary positions act on q and k before whichever kernel runs, so every backend
    sees the same inputs.
    """

    def __init__(self, dim, num_heads, qk_norm=False, norm="layernorm"):
        super().__init__()
        if dim % num_heads:
            raise UserError(f"hidden size {dim} is not divisible by {num_heads} heads; pick a width that is.")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.qk_norm = qk_norm
        # nn.Identity has no tensors, so the official block's state dict is unchanged.
        self.q_norm = qk_norm_layer(norm, self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = qk_norm_layer(norm, self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=True)
        self.backend = "sdpa"
        self.sdpa_kernel = None  # an SDPBackend name SDPA is restricted to (prepare_attention), or None: torch's choice

    def forward(self, x, rope=None):
        """(N, T, D) -> (N, T, D); rope: a RotaryEmbedding2d for this token grid, or None."""
        n, t, d = x.shape
        qkv = self.qkv(x).reshape(n, t, 3, self.num_heads, self.head_dim)  # (N, T, 3, H, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (N, H, T, d)
        q, k = self._position_and_norm(q, k, v.dtype, rope)
        if self.backend == "xformers":
            out = self._xformers(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (N, T, H, d)
        elif self.backend == "sdpa" and self.sdpa_kernel is not None:
            out = pinned_sdpa(q, k, v, self.sdpa_kernel).transpose(1, 2)  # (N, T, H, d)
        else:
            attend = F.scaled_dot_product_attention if self.backend == "sdpa" else math_attention
            out = attend(q, k, v).transpose(1, 2)  # (N, T, H, d)
        return self.proj(out.reshape(n, t, d))  # (N, T, D)

    def _position_and_norm(self, q, k, dtype, rope):
        """QK-norm then RoPE on (N, H, T, d), as LightningDiT; cast back to v's dtype for the kernels."""
        if not self.qk_norm and rope is None:
            return q, k  # the official block: untouched
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q), rope(k)
        return q.to(dtype), k.to(dtype)

    def _xformers(self, q, k, v):
        """xformers memory-efficient attention on (N, T, H, d); CUDA only, never a silent fallback."""
        if not q.is_cuda:
            raise SettingError(
                f"attention backend 'xformers' needs CUDA tensors but the model runs on {q.device}; "
                "its kernels are not implemented there. Use {attention backend} sdpa (or auto) on this device."
            )
        try:
            return _import_xformers_ops().memory_efficient_attention(q, k, v)  # (N, T, H, d)
        except NotImplementedError as err:
            raise SettingError(
                f"xformers has no kernel for this input ({q.dtype}, head dim {q.shape[-1]}, {q.device}): "
                f"{err}. Use {{attention backend}} sdpa, or install an xformers build for your GPU."
            ) from err


def pinned_sdpa(q, k, v, kernel: str):
    """SDPA on (N, H, T, d) restricted to one kernel (an SDPBackend name): an input it cannot take raises, no fallback."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        return F.scaled_dot_product_attention(q, k, v)  # (N, H, T, d)


def math_attention(q, k, v):
    """softmax(Q K^T / sqrt(d)) V written out (Vaswani et al., 2017, Eq. 1), on (N, H, T, d)."""
    weights = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (N, H, T, T)
    return weights.softmax(dim=-1) @ v  # (N, H, T, d)


#################################################################################
#                                  DiT blocks                                   #
#################################################################################

class Mlp(nn.Module):
    """Two-layer feed-forward network with tanh-approximated GELU."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=True)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x):
        """(N, T, D) -> (N, T, D)."""
        return self.fc2(self.act(self.fc1(x)))


def swiglu_hidden(dim, mlp_ratio=4.0):
    """SwiGLU hidden width: 2/3 of the GELU MLP's, so the three matrices hold as many weights as its two.

    LightningDiT's rule, int(2/3 * int(dim * mlp_ratio)), no rounding: 3072 for XL's 1152, 512 for T's 192.
    """
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


def block_mlp(kind, dim, mlp_ratio):
    """The block's feed-forward: DiT's GELU MLP or LightningDiT's SwiGLU of equal weight count."""
    if kind == "swiglu":
        return SwiGLU(dim, swiglu_hidden(dim, mlp_ratio))
    return Mlp(dim, int(dim * mlp_ratio))


def _saved_ops() -> frozenset:
    """The aten ops whose outputs selective checkpointing keeps: matmuls and every SDPA kernel torch has."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


SAVED_OPS = _saved_ops()


def selective_policy(ctx, op, *args, **kwargs):
    """Keep what costs FLOPs (matmuls, attention) for backward; recompute the cheap pointwise ops (norms, GELU, adaLN)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The (forward, recompute) contexts of torch's selective checkpointing under selective_policy."""
    return create_selective_checkpoint_contexts(selective_policy)


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning (DiT Sec. 3.2, Fig. 3); block options as LightningDiT."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, norm="layernorm", mlp="gelu", qk_norm=False):
        super().__init__()
        self.norm1 = block_norm(norm, hidden_size)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm, norm=norm)
        self.norm2 = block_norm(norm, hidden_size)
        self.mlp = block_mlp(mlp, hidden_size, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    # How this block's activations are kept for backward (DiT.set_grad_checkpointing): None stores them all, "full"
    # recomputes the block, SELECTIVE recomputes its pointwise ops. The checkpoint runs inside forward, so a compiled
    # block (train/step.py's regional compile) traces it and its policy into the one graph it reuses for every block.
    recompute = None

    def forward(self, x, c, rope=None):
        """x (N, T, D) tokens, c (N, D) or per-token (N, T, D) conditioning, rope RotaryEmbedding2d or None -> (N, T, D)."""
        if self.recompute is None or not torch.is_grad_enabled():
            return self._forward(x, c, rope)
        if self.recompute == SELECTIVE:
            return checkpoint(self._forward, x, c, rope, use_reentrant=False, context_fn=selective_contexts)
        return checkpoint(self._forward, x, c, rope, use_reentrant=False)

    def _forward(self, x, c, rope=None):
        """The block itself (forward's arguments)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=-1)
        x = x + per_token(gate_msa) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        return x + per_token(gate_mlp) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    """adaLN-modulated norm and a linear map from tokens to p*p*out_channels patch values."""

    def __init__(self, hidden_size, patch_size, out_channels, norm="layernorm"):
        super().__init__()
        self.norm_final = block_norm(norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        """x (N, T, D), c (N, D) or per-token (N, T, D) -> (N, T, p*p*out_channels)."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


#################################################################################
#                         Initialisation shared by DiT and DiT^DH               #
#################################################################################
# Pieces of the init both models run in their own RNG draw order (initialize_weights of each). The ones that
# draw (init_patch_embed_, init_condition_mlp_) are called where the draw falls; the others draw nothing.

def init_patch_embed_(embedder: PatchEmbed) -> None:
    """The patch embedding initialised as a linear layer over the flattened patch (as official DiT), zero bias."""
    w = embedder.proj.weight  # (D, C, p, p)
    nn.init.xavier_uniform_(w.view(w.shape[0], -1))
    nn.init.zeros_(embedder.proj.bias)


def init_condition_mlp_(mlp: nn.Sequential) -> None:
    """The timestep MLP's two linears ~ N(0, 0.02) (DiT's init; RAE keeps it)."""
    nn.init.normal_(mlp[0].weight, std=0.02)
    nn.init.normal_(mlp[2].weight, std=0.02)


def set_positions_(pos_embed: torch.Tensor, grid: int, ropes=()) -> None:
    """The fixed sin-cos table into pos_embed (1, T, D) and the rotary tables recomputed; no RNG draw."""
    pos = sincos_2d(pos_embed.shape[-1], grid).float()  # (T, D), computed on the CPU in float64
    pos_embed.copy_(pos.unsqueeze(0).to(pos_embed.device))  # (1, T, D)
    for rope in ropes:
        if rope is not None:
            rope.reset_tables()


def adaln_zero_(blocks, final_layer: FinalLayer) -> None:
    """adaLN-Zero (DiT Sec. 3.2): every block starts as the identity, the output as zero; no RNG draw."""
    for layer in [b.adaLN_modulation[-1] for b in blocks] + [final_layer.adaLN_modulation[-1], final_layer.linear]:
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


#################################################################################
#                                     DiT                                       #
#################################################################################

class DiT(nn.Module):
    """Diffusion Transformer over latent patches, conditioned on timestep and class."""

    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28,
                 num_heads=16, mlp_ratio=4.0, class_dropout_prob=CLASS_DROPOUT_PROB, num_classes=1000,
                 learn_sigma=True, attention="auto", grad_checkpoint_every=0, norm="layernorm", mlp="gelu",
                 rope=False, qk_norm=False, interval_time=False):
        super().__init__()
        check_block_options(norm, mlp, rope, qk_norm)
        if input_size % patch_size:
            raise UserError(f"input size {input_size} is not a multiple of patch size {patch_size}; "
                            "pick a preset whose patch size divides the latent size.")
        self.input_size, self.patch_size = input_size, patch_size
        self.in_channels = in_channels
        self.learn_sigma = learn_sigma
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.null_label = num_classes  # the one owner of the null-class index
        self.block_options = dict(norm=norm, mlp=mlp, rope=rope, qk_norm=qk_norm)

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        # MeanFlow (Geng et al. 2025): a second embedder for the interval length t - r, summed into the conditioning
        # as the official models_dit.py's h_embedder. None (no tensors) unless asked, so other layouts are unchanged.
        self.h_embedder = TimestepEmbedder(hidden_size) if interval_time else None
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # Fixed sin-cos embedding, kept as a frozen parameter so it is in the state dict as official.
        tokens = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, hidden_size), requires_grad=False)  # (1, T, D)
        # LightningDiT keeps the absolute sin-cos embedding above and adds RoPE inside attention.
        self.feat_rope = RotaryEmbedding2d(hidden_size // num_heads, input_size // patch_size) if rope else None
        self.depth = depth  # blocks that token routing may span (all of them here; a DiT^DH's body)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio, norm=norm, mlp=mlp, qk_norm=qk_norm)
                                     for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm=norm)
        self.initialize_weights()
        self.set_attention(attention)
        self.set_grad_checkpointing(grad_checkpoint_every)
        self.route = None  # (start, end): blocks that see only the kept tokens in training (set_routing)

    @torch.no_grad()
    def initialize_weights(self):
        """Official init: xavier linears, sin-cos positions, N(0, 0.02) embeddings, adaLN-Zero (norm gains 1)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        set_positions_(self.pos_embed, self.input_size // self.patch_size, [self.feat_rope])
        init_patch_embed_(self.x_embedder)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        init_condition_mlp_(self.t_embedder.mlp)
        if self.h_embedder is not None:
            init_condition_mlp_(self.h_embedder.mlp)
        adaln_zero_(self.blocks, self.final_layer)

    def set_attention(self, backend):
        """Switch every block's attention kernel: "auto"|"sdpa"|"xformers"|"math"; UserError if unusable."""
        self.attention = resolve_attention(backend)
        for block in self.blocks:
            block.attn.backend = self.attention

    def set_grad_checkpointing(self, every):
        """Recompute every `every`-th block (blocks 0, k, 2k, ...) in backward; 0 turns it off; SELECTIVE: in every
        block only the pointwise ops (matmul and attention outputs kept)."""
        if every != SELECTIVE and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise UserError(f"gradient checkpointing interval must be a whole number >= 0 (0 = off, 1 = every "
                            f"block) or {SELECTIVE!r}, got {every!r}.")
        self.grad_checkpoint_every = every
        for index, block in enumerate(self.blocks):
            block.recompute = (SELECTIVE if every == SELECTIVE else "full") if self._checkpointed(index) else None

    def set_routing(self, start=None, end=None):
        """Token routing in training (shared/network/routing.py): blocks start..end see only the kept tokens; None: off.

        A training setting like checkpointing, not architecture: no weights, not in ModelConfig or exports.
        """
        if start is None:
            self.route = None
            return
        if not 0 <= start <= end < self.depth:
            raise UserError(f"a route over blocks {start}..{end} does not fit this model's {self.depth} routable blocks "
                            f"(0 <= start <= end <= {self.depth - 1}; a DiT^DH head is never routed).")
        self.route = (start, end)

    def _checkpointed(self, index):
        """Whether block `index` recomputes in backward (all of it, or its pointwise ops) instead of storing them."""
        k = 1 if self.grad_checkpoint_every == SELECTIVE else self.grad_checkpoint_every
        return k > 0 and index % k == 0

    def _active_route(self, route_keep, return_hidden_at):
        """(start, end) of the route this forward takes ((-1, -1): none); SettingError for REPA inside it."""
        start, end = self.route if self.training and self.route and route_keep is not None else (-1, -1)
        if return_hidden_at is not None and start <= return_hidden_at - 1 <= end:
            raise SettingError(f"block {return_hidden_at}'s output is inside the token route (blocks {start}.."
                               f"{end}), where only some tokens are present; align a block before the route.")
        return start, end

    def _block(self, i, x, c, rope):
        """Block i on tokens x (N, T or K, D) with conditioning c (recomputed in backward as the block says)."""
        return self.blocks[i](x, c, rope)

    def _run_blocks(self, x, c, rope, indices, route=(-1, -1), route_keep=None, return_hidden_at=None):
        """x (N, T, D) through blocks `indices`; blocks route[0]..route[1] see only route_keep's (N, K) tokens.

        Returns (x, block return_hidden_at's output or None). The skipped tokens wait in `full` and rejoin
        after block route[1] holding what block route[0] - 1 gave them (TREAD, shared/network/routing.py).
        """
        start, end = route
        hidden, table = None, rope
        for i in indices:
            if i == start:  # the route starts: the skipped tokens wait in `full` (N, T, D)
                full, x = x, gather_tokens(x, route_keep)  # (N, K, D)
                rope = RoutedRope(table, route_keep) if table is not None else None
            x = self._block(i, x, c, rope)  # (N, T or K, D)
            if i == end:  # ... and ends: the kept tokens' new values rejoin the skipped ones
                x, rope = scatter_tokens(full, route_keep, x), table  # (N, T, D)
            if i + 1 == return_hidden_at:
                hidden = x  # (N, T, D)
        return x, hidden

    def unpatchify(self, x):
        """(N, T, p*p*C) patch values -> (N, C, H, W), the inverse of the patch order of x_embedder."""
        c, p = self.out_channels, self.patch_size
        h = w = self.input_size // p
        x = x.reshape(x.shape[0], h, w, p, p, c)  # (N, h, w, p, p, C)
        x = x.permute(0, 5, 1, 3, 2, 4)  # (N, C, h, p, w, p)
        return x.reshape(x.shape[0], c, h * p, w * p)  # (N, C, H, W)

    def _check_input(self, x):
        """UserError when latents do not have the shape this model was built for."""
        expected = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            grid = self.input_size // self.patch_size
            rope = (f" Its rotary position tables are built for a {grid}x{grid} token grid, so it cannot run at "
                    "another size either.") if self.feat_rope is not None else ""
            raise UserError(
                f"the model expects latents of shape (N, {', '.join(map(str, expected))}) but got "
                f"{tuple(x.shape)}; the latents' image size or VAE does not match this model's input_size "
                f"and in_channels.{rope} Use latents extracted at the size the model was built for."
            )

    def time_embedding(self, t):
        """(N,) timesteps -> (N, D); with the interval embedder, (N, 2) pairs (time, interval length) -> (N, D)."""
        if self.h_embedder is None:
            return self.t_embedder(t)
        if t.dim() != 2 or t.shape[1] != 2:
            raise UserError(f"this model embeds two times (MeanFlow: t and t - r) and needs them as an (N, 2) tensor, "
                            f"but got shape {tuple(t.shape)}; sample it with a meanflow sampler (--sampler meanflow).")
        return self.t_embedder(t[:, 0]) + self.h_embedder(t[:, 1])  # (N, D)

    def forward(self, x, t, y, force_drop_ids=None, return_hidden_at=None, route_keep=None):
        """x (N, C, H, W) latents, t (N,) timesteps (with the interval embedder (N, 2): time, interval length), y (N,)
        labels -> (N, out_channels, H, W).

        force_drop_ids (N,) bool/0-1: which labels become the null class. Training passes the data side's
        per-sample coin here, so the model's own global-RNG label dropout never runs (train/data.py).
        return_hidden_at k (1..depth): also return block k's output tokens (N, T, D), from the same forward
        (REPA aligns them; shared/network/repa.py): the result is then (output, tokens).
        route_keep (N, K) int64: in train mode with set_routing on, only these tokens pass the routed blocks
        (TREAD); in eval mode every token passes every block, as sampling does.
        """
        self._check_input(x)
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D), T = H * W / p**2
        c = self.time_embedding(t) + self.y_embedder(y, self.training, force_drop_ids)  # (N, D)
        route = self._active_route(route_keep, return_hidden_at)
        x, hidden = self._run_blocks(x, c, self.feat_rope, range(self.depth), route, route_keep, return_hidden_at)
        x = self.unpatchify(self.final_layer(x, c))  # (N, out_channels, H, W)
        return x if return_hidden_at is None else (x, hidden)


#################################################################################
#                          Presets, config, inference                           #
#################################################################################

PRESETS = {
    f"DiT-{size}/{patch}": dict(depth=depth, hidden_size=width, patch_size=patch, num_heads=heads)
    for size, depth, width, heads in [("XL", 28, 1152, 16), ("L", 24, 1024, 16), ("B", 12, 768, 12),
                                      ("S", 12, 384, 6)]
    # Patch 1 for latents of 16x16 or smaller (f16 / f32 tokenizers); LightningDiT-XL/1 is DiT-XL's shape at patch 1
    for patch in (1, 2, 4, 8)
}
# Tiny preset for tests and the CPU demo, not an official size: 4.0M parameters in its 6 blocks,
# 4.4M in all with 1000 classes at 256x256 (4.2M with 10 classes).
PRESETS["DiT-T/2"] = dict(depth=6, hidden_size=192, patch_size=2, num_heads=3)
PRESETS["DiT-T/1"] = dict(depth=6, hidden_size=192, patch_size=1, num_heads=3)

# DiT^DH (RAE, bytetriper/RAE configs/stage2/training/ImageNet256/DiTDH-{S,XL}_DINOv2-B.yaml): a DiT-S or
# DiT-XL body at patch 1, then 2 head blocks of width 2048 with 16 heads; RAE's block (RMSNorm, SwiGLU, 2-D
# RoPE, no QK-norm) is the presets' default (DEFAULT_BLOCKS). DiTDH-T is ours: a tiny one for tests and the CPU.
HEAD_FIELDS = ("head_depth", "head_width", "head_heads")
RAE_HEAD = dict(head_depth=2, head_width=2048, head_heads=16)
PRESETS["DiTDH-S"] = dict(depth=12, hidden_size=384, patch_size=1, num_heads=6, **RAE_HEAD)
PRESETS["DiTDH-XL"] = dict(depth=28, hidden_size=1152, patch_size=1, num_heads=16, **RAE_HEAD)
PRESETS["DiTDH-T"] = dict(depth=4, hidden_size=192, patch_size=1, num_heads=3, head_depth=2, head_width=384,
                          head_heads=6)
DEFAULT_BLOCKS = {name: "lightning" for name in PRESETS if name.startswith("DiTDH-")}  # else "dit"


def _build_dit_dh(**kwargs):
    """A DiT^DH (shared/network/ddt.py; imported late: it builds on this module)."""
    from shared.network.ddt import DiTDH

    return DiTDH(**kwargs)


def preset_head(name: str) -> dict:
    """{head_depth, head_width, head_heads} of a preset (all 0 for the plain DiT presets)."""
    return {k: PRESETS[name].get(k, 0) for k in HEAD_FIELDS}


def default_block(name: str) -> str:
    """The BLOCKS name a preset is built with when no block option is given (DiT's, RAE's for DiTDH-*)."""
    return DEFAULT_BLOCKS.get(name, "dit")


def build_model(name: str, **kwargs):
    """Preset `name` with `kwargs` overriding its architecture; a head (head_depth > 0) makes it a DiT^DH."""
    arch = {**PRESETS[name], **kwargs}
    if arch.get("head_depth", 0):
        return _build_dit_dh(**arch)
    return DiT(**{k: v for k, v in arch.items() if k not in HEAD_FIELDS})


DiT_models = {name: functools.partial(build_model, name) for name in PRESETS}


def token_width_problem(model: str, in_channels: int, head: dict | None = None) -> str | None:
    """Why the preset (with `head`) is too narrow for tokens of in_channels x patch^2 values, or None.

    RAE Sec. 4.1: a transformer whose width is below the token dimension cannot fit high-dimensional latents
    (DINOv2-B: 768 per token); the fix is a wider model or the DiT^DH head. The stage that predicts the output
    (the head when there is one) must be at least as wide as a token.
    """
    arch = PRESETS[model]
    head = head or preset_head(model)
    token = in_channels * arch["patch_size"] ** 2
    width = head["head_width"] if head.get("head_depth") else arch["hidden_size"]
    if width >= token:
        return None
    where = f"its head of width {width}" if head.get("head_depth") else f"width {width}"
    return (f"{model} with {where} is narrower than the tokens it would predict: {in_channels} latent channels x "
            f"patch {arch['patch_size']}^2 = {token} values per token. RAE (Zheng et al. 2025, Sec. 4.1) shows such "
            f"a transformer cannot fit the latents; add the wide shallow DiT^DH head ({{head depth}} 2 "
            f"{{head width}} 2048 {{head heads}} 16, as RAE), or use a DiTDH preset (DiTDH-S, DiTDH-XL), or a preset "
            f"at least {token} wide.")


def check_preset(name: str) -> None:
    """ChoiceError unless `name` is a key of DiT_models."""
    if name not in DiT_models:
        raise ChoiceError("model preset", name, list(DiT_models))


OBJECTIVE_FIELDS = ("objective", "objective_args", "objective_plugin", "sampling")  # not the network: build() skips them


@dataclass
class ModelConfig:
    """Everything needed to rebuild a DiT; written into every checkpoint and export.

    The block options and the head default to the preset's (DiT's block and no head for the DiT presets, RAE's
    block and head for DiTDH-*), so configs written before they existed load as they were trained.
    """

    model: str
    input_size: int
    in_channels: int = 4
    num_classes: int = 1000
    learn_sigma: bool = True
    class_dropout_prob: float = CLASS_DROPOUT_PROB
    norm: str | None = None  # None: the preset's block (default_block)
    mlp: str | None = None
    rope: bool | None = None
    qk_norm: bool | None = None
    # The DiT^DH head (shared/network/ddt.py): blocks, width and attention heads; None: the preset's (0 = none).
    head_depth: int | None = None
    head_width: int | None = None
    head_heads: int | None = None
    # A second timestep embedder (`h_embedder`) for the interval length t - r: MeanFlow's average-velocity network
    # (shared/generative/meanflow.py) takes the pair (t, t - r). False: no such tensors, the releases' layout.
    interval_time: bool = False
    # What the network was trained to predict (shared/generative/objectives.py): the registered objective's name,
    # its recorded fields (e.g. flow: {"convention": "sit", "time_dist_shift": 1.0}: the direction of its time
    # input, RAE's shift), and the --plugin module that registers it ("" for a built-in). Not architecture:
    # build() ignores them.
    objective: str = DEFAULT_OBJECTIVE
    objective_args: dict = field(default_factory=dict)
    objective_plugin: str = ""
    # How it samples unless told otherwise: its recipe's sampling half in python -m sample's flag names (e.g.
    # LightningDiT: {"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, 0.89]}); {} = the objective's own.
    sampling: dict = field(default_factory=dict)

    def __post_init__(self):
        check_preset(self.model)
        preset = {**BLOCKS[default_block(self.model)], **preset_head(self.model)}
        for name in (*BLOCK_FIELDS, *HEAD_FIELDS):
            if getattr(self, name) is None:
                setattr(self, name, preset[name])
        check_block_options(self.norm, self.mlp, self.rope, self.qk_norm)
        from shared.network.ddt import check_head  # late: ddt builds on this module
        check_head(self.head_depth, self.head_width, self.head_heads)
        if self.model in DEFAULT_BLOCKS and not self.head_depth:
            raise SettingError(f"{self.model} is a DiT^DH preset but {{head depth}} is 0; use a DiT preset for a "
                               "model without the head.")
        from shared.generative.objectives import objective_of, recorded_args  # late: objectives imports samplers
        from shared.generative.samplers import check_recorded

        objective = objective_of(self)
        check_interval_time(self, objective)
        self.objective_args = recorded_args(objective)  # every recorded field (defaults too): equal models, equal configs
        self.sampling = {k: list(v) if isinstance(v, tuple) else v for k, v in self.sampling.items()}  # as JSON reads
        check_recorded(self.sampling, objective.family, "the model config")

    @property
    def has_null_class(self) -> bool:
        """Whether the model has a null-class embedding to guide against (trained with label dropout)."""
        return self.class_dropout_prob > 0

    @property
    def block(self) -> str:
        """The BLOCKS preset of this config's block options, or "custom"."""
        return block_name(self.to_dict())

    @property
    def block_options(self) -> dict:
        """{norm, mlp, rope, qk_norm}."""
        return {k: getattr(self, k) for k in BLOCK_FIELDS}

    @property
    def head(self) -> dict:
        """{head_depth, head_width, head_heads} (all 0 without the DiT^DH head)."""
        return {k: getattr(self, k) for k in HEAD_FIELDS}

    def build(self, attention="auto", grad_checkpoint_every=0, device=None, init=True):
        """The DiT (a DiT^DH when it has a head) this config describes, on `device` (default: torch's current).

        init=False allocates zero-filled weights without running the initialisation (fast; for measuring only);
        on the meta device nothing is allocated either way.
        """
        kwargs = {k: v for k, v in self.to_dict().items() if k not in ("model", *OBJECTIVE_FIELDS)}
        if not kwargs["interval_time"]:
            del kwargs["interval_time"]  # a DiT^DH takes no such argument (check_interval_time refuses it there)
        kwargs.update(attention=attention, grad_checkpoint_every=grad_checkpoint_every)
        if init or str(device) == "meta":
            with torch.device(device) if device is not None else contextlib.nullcontext():
                return build_model(self.model, **kwargs)
        with torch.device("meta"):
            model = build_model(self.model, **kwargs)
        model = model.to_empty(device=device or "cpu")
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                tensor.zero_()
        return model

    def to_dict(self):
        """Plain JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild from to_dict() output; UserError on missing or unknown keys (absent block options are DiT's)."""
        d = upgrade_objective(dict(d))
        names = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(d) - names), sorted({"model", "input_size"} - set(d))
        if unknown or missing:
            raise UserError(f"model config {d} has unknown keys {unknown} / lacks keys {missing}; it was "
                            "written by an incompatible version. Re-export the weights with this version.")
        return cls(**d)


def check_interval_time(config: ModelConfig, objective) -> None:
    """SettingError unless the config has the interval embedder exactly when its objective feeds two times."""
    wanted = bool(getattr(objective, "interval_time", False))
    if config.interval_time and config.head_depth:
        raise SettingError(f"{config.model} has a DiT^DH head, which has no second time embedding here (MeanFlow's "
                           "t - r is embedded by the plain DiT only; the JVP through the head is not supported). Train "
                           "the meanflow objective on a DiT-* preset (e.g. DiT-XL/2, the paper's backbone).")
    if config.interval_time != wanted:
        has = "has" if config.interval_time else "lacks"
        raise SettingError(f"the model config {has} the interval time embedder (interval_time "
                           f"{config.interval_time}), but its objective {config.objective} "
                           f"{'feeds' if wanted else 'does not feed'} the network a second time; the two are "
                           "written together, so these weights were edited by hand. Re-export them with this version.")


def upgrade_objective(d: dict) -> dict:
    """A config written before objectives recorded their own fields: its `flow_convention` becomes objective_args."""
    if "flow_convention" not in d:
        return d
    convention = d.pop("flow_convention")
    if d.get("objective", DEFAULT_OBJECTIVE) == "flow":
        d.setdefault("objective_args", {"convention": convention})
    elif convention != "sit":
        raise SettingError(f"a flow time convention ({convention}) is recorded for a {d.get('objective', DEFAULT_OBJECTIVE)} "
                           "model; only flow models have one. Leave the {flow time convention} at sit.")
    return d


def _shape(state_dict, key):
    """Shape of a required tensor, or a UserError saying the weights are not a DiT state dict."""
    if key not in state_dict:
        raise UserError(f"these weights have no {key!r} tensor, so they are not a DiT state dict (official "
                        "DiT checkpoint or this project's export); use a DiT weight file.")
    return tuple(state_dict[key].shape)


def _infer_block(state_dict):
    """Block options read from which tensors exist (LightningDiT's names); unknown MLP layouts refused."""
    if "blocks.0.mlp.w12.weight" in state_dict:
        mlp, mlp_hidden = "swiglu", _shape(state_dict, "blocks.0.mlp.w12.weight")[0] // 2
    elif "blocks.0.mlp.fc1.weight" in state_dict:
        mlp, mlp_hidden = "gelu", _shape(state_dict, "blocks.0.mlp.fc1.weight")[0]
    else:
        names = sorted(k for k in state_dict if k.startswith("blocks.0.mlp."))
        raise UserError(f"these weights' MLP has tensors {names or 'none'}, neither DiT's GELU MLP (mlp.fc1/fc2) "
                        "nor the SwiGLU of the block options (mlp.w12/w3); this version cannot rebuild that "
                        "block. Use weights of a DiT_models preset with the block options of shared.network.models.BLOCKS.")
    return dict(norm="rmsnorm" if "blocks.0.norm1.weight" in state_dict else "layernorm", mlp=mlp,
                rope="feat_rope.freqs_cos" in state_dict, qk_norm="blocks.0.attn.q_norm.weight" in state_dict,
                mlp_hidden=mlp_hidden)


def _infer_architecture(state_dict):
    """Read depth, width, patch, channels, input size, block options, mlp width and label rows from tensors."""
    width, in_channels, patch, _ = _shape(state_dict, "x_embedder.proj.weight")
    tokens = _shape(state_dict, "pos_embed")[1]
    grid = math.isqrt(tokens)
    depth = len({m.group(1) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k))})
    block = _infer_block(state_dict) if depth else dict(BLOCKS["dit"], mlp_hidden=0)
    return dict(
        depth=depth, hidden_size=width, patch_size=patch, in_channels=in_channels, input_size=grid * patch,
        square=grid * grid == tokens, **block,
        out_channels=_shape(state_dict, "final_layer.linear.weight")[0] // (patch * patch),
        label_rows=_shape(state_dict, "y_embedder.embedding_table.weight")[0],
    )


def _mlp_width(mlp, width):
    """Hidden width a preset's MLP has with this MLP option (mlp_ratio 4 throughout DiT_models)."""
    return swiglu_hidden(width) if mlp == "swiglu" else 4 * width


def _infer_head(state_dict, arch):
    """The DiT^DH part of a state dict in RAE's layout (s_embedder = body, x_embedder = head): depths, head width."""
    body_width = arch["hidden_size"]
    widths = {int(m.group(1)): state_dict[k].shape[1] for k in state_dict
              if (m := re.match(r"blocks\.(\d+)\.attn\.qkv\.weight$", k))}
    depth = sum(1 for w in widths.values() if w == body_width)
    head_width = _shape(state_dict, "x_embedder.proj.weight")[0]
    return dict(depth=depth, head_depth=len(widths) - depth, head_width=head_width)


def _heads_from_rope(state_dict, key, width):
    """Attention heads read from a RoPE table (T, head_dim), or None without one."""
    return width // state_dict[key].shape[1] if key in state_dict else None


def _infer_dit_dh(state_dict, class_dropout_prob):
    """ModelConfig of a DiT^DH state dict (RAE's DiTwDDTHead layout); UserError if no DiTDH preset fits."""
    renamed = {("x_embedder" + k[len("s_embedder"):] if k.startswith("s_embedder") else k): v
               for k, v in state_dict.items() if not k.startswith("x_embedder")}
    arch = _infer_architecture(renamed)
    arch.update(_infer_head(state_dict, arch), rope="enc_feat_rope.freqs_cos" in state_dict)
    found = {k: arch[k] for k in ("depth", "hidden_size", "patch_size", "head_depth", "head_width")}
    name = next((n for n, p in PRESETS.items() if p.get("head_depth") and {k: p[k] for k in found} == found), None)
    if name is None:
        raise UserError(f"these DiT^DH weights have body depth {arch['depth']} width {arch['hidden_size']}, head depth "
                        f"{arch['head_depth']} width {arch['head_width']}, patch {arch['patch_size']}, which match no "
                        f"DiTDH preset ({', '.join(n for n, p in PRESETS.items() if p.get('head_depth'))}). Use weights "
                        "of a preset model.")
    head_heads = _heads_from_rope(state_dict, "dec_feat_rope.freqs_cos", arch["head_width"]) or PRESETS[name]["head_heads"]
    has_null = class_dropout_prob > 0 and arch["label_rows"] > 1
    config = ModelConfig(
        model=name, input_size=arch["input_size"], in_channels=arch["in_channels"],
        num_classes=arch["label_rows"] - int(has_null), learn_sigma=arch["out_channels"] == 2 * arch["in_channels"],
        class_dropout_prob=class_dropout_prob if has_null else 0.0, **{k: arch[k] for k in BLOCK_FIELDS},
        head_depth=arch["head_depth"], head_width=arch["head_width"], head_heads=head_heads, objective="flow",
    )
    _check_layout(state_dict, config)
    return config


def infer_model_config(state_dict, class_dropout_prob=CLASS_DROPOUT_PROB):
    """Recover the ModelConfig of a DiT (or DiT^DH) state dict from its tensor shapes; UserError if no preset fits."""
    # Shapes cannot tell whether the label table's last row is a null class; like the official
    # checkpoints we assume it is (num_classes = rows - 1) unless class_dropout_prob is 0.
    if "s_embedder.proj.weight" in state_dict:  # RAE's DiTwDDTHead layout
        return _infer_dit_dh(state_dict, class_dropout_prob)
    arch = _infer_architecture(state_dict)
    found = {k: arch[k] for k in ("depth", "hidden_size", "patch_size")}
    name = next((n for n, p in PRESETS.items() if {k: p[k] for k in found} == found and not p.get("head_depth")
                 and arch["mlp_hidden"] == _mlp_width(arch["mlp"], p["hidden_size"]) and arch["square"]), None)
    if name is None:
        raise UserError(
            f"these weights have depth {arch['depth']}, width {arch['hidden_size']}, patch {arch['patch_size']}, "
            f"MLP width {arch['mlp_hidden']} ({arch['mlp']}) and input size {arch['input_size']} (latent grid), "
            f"which match no preset in DiT_models ({', '.join(PRESETS)}). Use weights of a preset model."
        )
    if arch["out_channels"] not in (arch["in_channels"], 2 * arch["in_channels"]):
        raise UserError(f"the final layer predicts {arch['out_channels']} channels for {arch['in_channels']} "
                        "input channels (expected equal or double); these are not DiT weights.")
    has_null = class_dropout_prob > 0 and arch["label_rows"] > 1
    config = ModelConfig(
        model=name, input_size=arch["input_size"], in_channels=arch["in_channels"],
        num_classes=arch["label_rows"] - int(has_null),
        learn_sigma=arch["out_channels"] == 2 * arch["in_channels"],
        class_dropout_prob=class_dropout_prob if has_null else 0.0,
        **{k: arch[k] for k in BLOCK_FIELDS},
    )
    _check_layout(state_dict, config)
    return config


def _check_layout(state_dict, config):
    """UserError when the tensor names differ from those of the model the inferred config builds."""
    with torch.device("meta"):
        expected = set(config.build().state_dict())
    extra, missing = sorted(set(state_dict) - expected), sorted(expected - set(state_dict))
    if extra or missing:
        raise UserError(
            f"these weights look like {config.model} with block options {config.block_options}, but their tensor "
            f"names differ from that model's (unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}, missing "
            f"{missing[:4]}{' ...' if len(missing) > 4 else ''}), so this version cannot rebuild their block. Use "
            "a DiT checkpoint or one of this project's exports (which carry their config)."
        )
