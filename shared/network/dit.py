"""DiT (Peebles & Xie, 2023): the network, and the base it shares with DiT^DH (shared/network/ddt.py).

Parameter names, shapes, initialisation and numerics follow the official release, so the official checkpoints
(e.g. DiT-XL-2-256x256.pt) load with strict=True and give the same outputs. Top to bottom as the official models.py,
with the built-in block options' records (their table: shared/network/blocks.py; presets: models.py).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shared.network.attention import import_xformers_ops, resolve_attention
from shared.network.blocks import (NORM_EPS, SELECTIVE, RMSNorm, RotaryEmbedding2d, RoutedRope, SwiGLU, block_option,
                                   build_part, check_block_options, register_block_option, selective_contexts,
                                   swiglu_hidden)
from shared.network.routing import gather_tokens, scatter_tokens
from shared.runtime.errors import SettingError, UserError

FREQUENCY_EMBEDDING_SIZE = 256  # sinusoidal timestep features fed to the timestep MLP (DiT Sec. 3.2)
CLASS_DROPOUT_PROB = 0.1  # DiT's label dropout: the null class that classifier-free guidance needs


# --- Fixed sine-cosine positional embedding ---

def sincos_1d(dim, positions):
    """Sine half then cosine half of positions / 10000^(2i/dim) (Transformer positional encoding)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))  # (dim/2,)
    angles = positions.reshape(-1, 1).double() * omega  # (M, dim/2)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # (M, dim)


def sincos_2d(dim, grid_size):
    """(grid_size**2, dim) MAE-style 2-D embedding; first half encodes the column, second the row."""
    # The official meshgrid(w, h) puts the column index in its "emb_h" half: kept, as its checkpoints were trained.
    rows, cols = torch.meshgrid(torch.arange(grid_size), torch.arange(grid_size), indexing="ij")
    return torch.cat([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], dim=1)  # (T, dim)


# --- Embedding layers for patches, timesteps and labels ---

class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches projected to D channels by a strided convolution."""

    def __init__(self, input_size, patch_size, in_channels, hidden_size):
        super().__init__()
        self.num_patches = (input_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x):
        """(N, C, H, W) latents -> (N, T, D) tokens in row-major patch order."""
        return self.proj(x).flatten(2).transpose(1, 2)  # (N, D, H/p, W/p) -> (N, T, D)


GUIDANCE_INPUTS = 3  # improved MeanFlow's guidance conditioning: 1 - 1/w, t_min, t_max


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features followed by a two-layer SiLU MLP."""

    def __init__(self, hidden_size, frequency_embedding_size=FREQUENCY_EMBEDDING_SIZE):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        """(N,) possibly fractional timesteps -> (N, dim) features, cosine half first (as GLIDE/ADM)."""
        assert dim % 2 == 0, dim  # cos and sin halves; the DiT's is 256
        half = dim // 2
        # fp32 on purpose: the official checkpoints were trained with exactly these fp32 features.
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]  # (N, half)
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, dim)

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
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

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


# --- The built-in block options' records (LightningDiT's modules: blocks.py) ---

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


register_block_option("norm", "layernorm", "affine-free LayerNorm, eps 1e-6 (DiT)",
                      lambda dim: nn.LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS),
                      qk=nn.LayerNorm)  # QK-norm: timm's default LayerNorm (affine, eps 1e-5), as LightningDiT
register_block_option("norm", "rmsnorm", "RMSNorm with a learned gain, eps 1e-6 (LightningDiT)", RMSNorm,
                      marker="blocks.0.norm1.weight")
register_block_option("mlp", "gelu", "tanh GELU, 4x width (DiT)", lambda dim, ratio: Mlp(dim, int(dim * ratio)),
                      marker="blocks.0.mlp.fc1.weight")
register_block_option("mlp", "swiglu", "SiLU-gated, 2/3 of 4x width, as many weights (LightningDiT)",
                      lambda dim, ratio: SwiGLU(dim, swiglu_hidden(dim, ratio)), marker="blocks.0.mlp.w12.weight")
register_block_option("rope", False, "absolute sin-cos positions only (DiT)", None)
register_block_option("rope", True, "half the head turned by row, half by column, theta 10000", RotaryEmbedding2d,
                      marker="feat_rope.freqs_cos")
register_block_option("qk_norm", False, "none (DiT)", None)
register_block_option("qk_norm", True, "the --norm's per-head layer (Dehghani et al. 2023): RMSNorm with rmsnorm, "
                      "LayerNorm with layernorm, as LightningDiT",
                      lambda head_dim, norm: block_option("norm", norm).qk_layer(head_dim),
                      marker="blocks.0.attn.q_norm.weight")


# --- The transformer block (adaLN-Zero), its attention, the output ---

def per_token(v):
    """A modulation vector (N, D) broadcast over tokens as (N, 1, D); a per-token one (N, T, D) as it is."""
    return v.unsqueeze(1) if v.dim() == 2 else v


def modulate(x, shift, scale):
    """adaLN modulation x * (1 + scale) + shift: one (N, D) vector per image, or (N, T, D) per token (DiT^DH head)."""
    return x * (1 + per_token(scale)) + per_token(shift)  # (N, T, D)


class Attention(nn.Module):
    """Multi-head self-attention, fused qkv (timm's names); QK-norm and RoPE act on q and k before any kernel runs."""

    def __init__(self, dim, num_heads, qk_norm=None):
        super().__init__()
        assert dim % num_heads == 0, f"hidden size {dim} is not divisible by {num_heads} heads"
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.qk_norm = qk_norm is not None
        # nn.Identity has no tensors, so the official block's state dict is unchanged.
        self.q_norm = qk_norm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = qk_norm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=True)
        self.backend = "sdpa"
        self.sdpa_kernel = None  # an SDPBackend name SDPA is restricted to (prepare_attention), or None: torch's choice

    def forward(self, x, rope=None):
        """(N, T, D) -> (N, T, D); rope: a RotaryEmbedding2d for this token grid, or None."""
        n, t, d = x.shape
        qkv = self.qkv(x).reshape(n, t, 3, self.num_heads, self.head_dim)  # (N, T, 3, H, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (N, H, T, d)
        if self.qk_norm or rope is not None:  # else the official block: q and k untouched
            q, k = self.q_norm(q), self.k_norm(k)  # QK-norm then RoPE, as LightningDiT
            if rope is not None:
                q, k = rope(q), rope(k)
            q, k = q.to(v.dtype), k.to(v.dtype)  # cast back to v's dtype for the kernels
        if self.backend == "xformers":  # CUDA only, never a silent fallback
            if not q.is_cuda:
                raise SettingError(f"attention backend 'xformers' needs CUDA tensors but the model runs on {q.device}; "
                                   "its kernels are not implemented there. Use {attention backend} sdpa (or auto) on "
                                   "this device.")
            try:
                out = import_xformers_ops().memory_efficient_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (N, T, H, d)
            except NotImplementedError as err:
                raise SettingError(f"xformers has no kernel for this input ({q.dtype}, head dim {q.shape[-1]}, "
                                   f"{q.device}): {err}. Use {{attention backend}} sdpa, or install an xformers "
                                   "build for your GPU.") from err
        elif self.backend == "sdpa" and self.sdpa_kernel is not None:
            out = pinned_sdpa(q, k, v, self.sdpa_kernel).transpose(1, 2)  # (N, T, H, d)
        else:
            attend = F.scaled_dot_product_attention if self.backend == "sdpa" else math_attention
            out = attend(q, k, v).transpose(1, 2)  # (N, T, H, d)
        return self.proj(out.reshape(n, t, d))  # (N, T, D)


def pinned_sdpa(q, k, v, kernel: str):
    """SDPA on (N, H, T, d) restricted to one kernel (an SDPBackend name): an input it cannot take raises, no fallback."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        return F.scaled_dot_product_attention(q, k, v)  # (N, H, T, d)


def math_attention(q, k, v):
    """softmax(Q K^T / sqrt(d)) V written out (Vaswani et al., 2017, Eq. 1), on (N, H, T, d)."""
    weights = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (N, H, T, T)
    return weights.softmax(dim=-1) @ v  # (N, H, T, d)


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning (DiT Sec. 3.2, Fig. 3); block options as LightningDiT."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, norm="layernorm", mlp="gelu", qk_norm=False):
        super().__init__()
        self.norm1 = build_part("norm", norm, hidden_size)
        qk = block_option("qk_norm", qk_norm).build
        self.attn = Attention(hidden_size, num_heads, qk_norm=(lambda head_dim: qk(head_dim, norm)) if qk else None)
        self.norm2 = build_part("norm", norm, hidden_size)
        self.mlp = build_part("mlp", mlp, hidden_size, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    # Activations kept for backward (set_grad_checkpointing): None all, "full" recomputes the block, SELECTIVE its
    # pointwise ops; inside forward, so a regionally compiled block traces it into the one graph every block reuses.
    recompute = None

    def forward(self, x, c, rope=None):
        """x (N, T, D) tokens, c (N, D) or per-token (N, T, D) conditioning, rope RotaryEmbedding2d or None -> (N, T, D)."""
        if self.recompute is None or not torch.is_grad_enabled():
            return self._forward(x, c, rope)
        selective = {"context_fn": selective_contexts} if self.recompute == SELECTIVE else {}
        return checkpoint(self._forward, x, c, rope, use_reentrant=False, **selective)

    def _forward(self, x, c, rope=None):
        """The block itself (forward's arguments)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=-1)
        x = x + per_token(gate_msa) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        return x + per_token(gate_mlp) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    """adaLN-modulated norm and a linear map from tokens to p*p*out_channels patch values."""

    def __init__(self, hidden_size, patch_size, out_channels, norm="layernorm"):
        super().__init__()
        self.norm_final = build_part("norm", norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        """x (N, T, D), c (N, D) or per-token (N, T, D) -> (N, T, p*p*out_channels)."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


# --- Initialisation shared by DiT and DiT^DH, called in each model's RNG draw order (initialize_weights) ---

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
    for rope in filter(None, ropes):
        rope.reset_tables()


def adaln_zero_(blocks, final_layer: FinalLayer) -> None:
    """adaLN-Zero (DiT Sec. 3.2): every block starts as the identity, the output as zero; no RNG draw."""
    for layer in [b.adaLN_modulation[-1] for b in blocks] + [final_layer.adaLN_modulation[-1], final_layer.linear]:
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


# --- What DiT and DiT^DH share, and DiT ---

class Backbone(nn.Module):
    """What DiT and DiT^DH share: blocks from the option table, attention kernels, checkpointing, routing, patch order."""
    # A subclass builds its parts below in its release's RNG draw order, then calls finish().

    def __init__(self, input_size, patch_size, in_channels, depth, num_heads, num_classes, learn_sigma, mlp_ratio,
                 options: dict):
        super().__init__()
        check_block_options(options)
        if input_size % patch_size:
            raise UserError(f"input size {input_size} is not a multiple of patch size {patch_size}; "
                            "pick a preset whose patch size divides the latent size.")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.num_heads, self.num_classes, self.learn_sigma = num_heads, num_classes, learn_sigma
        self.null_label = num_classes  # the one owner of the null-class index
        self.depth = depth  # blocks that token routing may span (a DiT^DH's body)
        self.mlp_ratio, self.block_options = mlp_ratio, dict(options)
        self.route = None  # (start, end): blocks that see only the kept tokens in training (set_routing)

    @property
    def grid(self):
        """Tokens per side."""
        return self.input_size // self.patch_size

    def rope_table(self, width, heads):
        """The rope option's rotary table for heads of width / heads channels (None when off)."""
        return build_part("rope", self.block_options["rope"], width // heads, self.grid)

    def make_blocks(self, width, heads, count):
        """`count` blocks of the chosen options at this width."""
        options = {k: self.block_options[k] for k in ("norm", "mlp", "qk_norm")}
        return [DiTBlock(width, heads, self.mlp_ratio, **options) for _ in range(count)]

    def finish(self, attention, grad_checkpoint_every):
        """Initialise the weights, pick the attention kernel and the checkpointing: the end of every __init__."""
        self.initialize_weights()
        self.set_attention(attention)
        self.set_grad_checkpointing(grad_checkpoint_every)

    def set_attention(self, backend):
        """Switch every block's attention kernel: "auto"|"sdpa"|"xformers"|"math"; UserError if unusable."""
        self.attention = resolve_attention(backend)
        for block in self.blocks:
            block.attn.backend = self.attention

    def set_grad_checkpointing(self, every):
        """Recompute every `every`-th block (0, k, 2k, ...) in backward; 0: off; SELECTIVE: every block's pointwise ops."""
        if every != SELECTIVE and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise UserError(f"gradient checkpointing interval must be a whole number >= 0 (0 = off, 1 = every "
                            f"block) or {SELECTIVE!r}, got {every!r}.")
        self.grad_checkpoint_every = every
        k = 1 if every == SELECTIVE else every
        for index, block in enumerate(self.blocks):
            block.recompute = (SELECTIVE if every == SELECTIVE else "full") if k > 0 and index % k == 0 else None

    def set_routing(self, start=None, end=None):
        """Token routing in training (routing.py): blocks start..end see only the kept tokens; None: off. Not architecture."""
        if start is not None and not 0 <= start <= end < self.depth:
            raise UserError(f"a route over blocks {start}..{end} does not fit this model's {self.depth} routable blocks "
                            f"(0 <= start <= end <= {self.depth - 1}; a DiT^DH head is never routed).")
        self.route = None if start is None else (start, end)

    def _active_route(self, route_keep, return_hidden_at):
        """(start, end) of the route this forward takes ((-1, -1): none); SettingError for REPA inside it."""
        start, end = self.route if self.training and self.route and route_keep is not None else (-1, -1)
        if return_hidden_at is not None and start <= return_hidden_at - 1 <= end:
            raise SettingError(f"block {return_hidden_at}'s output is inside the token route (blocks {start}.."
                               f"{end}), where only some tokens are present; align a block before the route.")
        return start, end

    def _run_blocks(self, x, c, rope, indices, route=(-1, -1), route_keep=None, return_hidden_at=None):
        """x (N, T, D) through blocks `indices` -> (x, block return_hidden_at's output or None); routed: see below."""
        # Blocks route[0]..route[1] see only route_keep's (N, K) tokens (TREAD, shared/network/routing.py).
        start, end = route
        hidden, table = None, rope
        for i in indices:
            if i == start:  # the route starts: the skipped tokens wait in `full` (N, T, D)
                full, x = x, gather_tokens(x, route_keep)  # (N, K, D)
                rope = RoutedRope(table, route_keep) if table is not None else None
            x = self.blocks[i](x, c, rope)  # (N, T or K, D), recomputed in backward as the block says
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
            rope = (f" Its rotary position tables are built for a {self.grid}x{self.grid} token grid, so it cannot "
                    "run at another size either.") if self.feat_rope is not None else ""
            raise UserError(f"the model expects latents of shape (N, {', '.join(map(str, expected))}) but got "
                            f"{tuple(x.shape)}; the latents' image size or VAE does not match this model's input_size "
                            f"and in_channels.{rope} Use latents extracted at the size the model was built for.")


class DiT(Backbone):
    """Diffusion Transformer over latent patches, conditioned on timestep and class."""

    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28,
                 num_heads=16, mlp_ratio=4.0, class_dropout_prob=CLASS_DROPOUT_PROB, num_classes=1000,
                 learn_sigma=True, attention="auto", grad_checkpoint_every=0, norm="layernorm", mlp="gelu",
                 rope=False, qk_norm=False, interval_time=False, guidance_inputs=False):
        super().__init__(input_size, patch_size, in_channels, depth, num_heads, num_classes, learn_sigma, mlp_ratio,
                         dict(norm=norm, mlp=mlp, rope=rope, qk_norm=qk_norm))
        # Registration order is the official one: initialize_weights draws in self.modules() order.
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        # MeanFlow (Geng et al. 2025): t - r embedded and summed in, as its models_dit.py's h_embedder (None: none)
        self.h_embedder = TimestepEmbedder(hidden_size) if interval_time else None
        # Improved MeanFlow (arXiv 2512.02012): 1 - 1/w, t_min, t_max summed in (not in-context: every layout loads)
        self.g_embedders = nn.ModuleList(TimestepEmbedder(hidden_size) for _ in range(GUIDANCE_INPUTS)) \
            if guidance_inputs else None
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # The fixed sin-cos table, a frozen parameter so it is in the state dict as official.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid ** 2, hidden_size), requires_grad=False)  # (1, T, D)
        # LightningDiT keeps the absolute sin-cos embedding above and adds RoPE inside attention.
        self.feat_rope = self.rope_table(hidden_size, num_heads)
        self.blocks = nn.ModuleList(self.make_blocks(hidden_size, num_heads, depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm=norm)
        self.finish(attention, grad_checkpoint_every)

    @torch.no_grad()
    def initialize_weights(self):
        """Official init: xavier linears, sin-cos positions, N(0, 0.02) embeddings, adaLN-Zero (norm gains 1)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        set_positions_(self.pos_embed, self.grid, [self.feat_rope])
        init_patch_embed_(self.x_embedder)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        init_condition_mlp_(self.t_embedder.mlp)
        if self.h_embedder is not None:
            init_condition_mlp_(self.h_embedder.mlp)
        for embedder in self.g_embedders or ():
            init_condition_mlp_(embedder.mlp)
            nn.init.zeros_(embedder.mlp[-1].weight)  # 0 at every guidance: a flow model's conditioning, bitwise
        adaln_zero_(self.blocks, self.final_layer)

    @property
    def time_width(self) -> int:
        """Columns of the time input: 1 (a time), 2 (MeanFlow: t, t - r), or 5 (improved MeanFlow: and its guidance)."""
        return 1 if self.h_embedder is None else 2 + (GUIDANCE_INPUTS if self.g_embedders is not None else 0)

    def time_embedding(self, t):
        """(N,) times, (N, 2) (t, t - r) with the interval embedder, (N, 5) (and 1 - 1/w, t_min, t_max) -> (N, D)."""
        if self.h_embedder is None:
            return self.t_embedder(t)
        width = self.time_width
        if t.dim() != 2 or t.shape[1] != width:
            raise UserError(f"this model embeds {width} times (MeanFlow: t and t - r; improved MeanFlow: and its "
                            f"guidance) and needs them as an (N, {width}) tensor, but got shape {tuple(t.shape)}; "
                            "sample it with a meanflow sampler (--sampler meanflow).")
        c = self.t_embedder(t[:, 0]) + self.h_embedder(t[:, 1])  # (N, D)
        for k, embedder in enumerate(self.g_embedders or ()):
            c = c + embedder(t[:, 2 + k])
        return c

    def forward(self, x, t, y, force_drop_ids=None, return_hidden_at=None, route_keep=None):
        """x (N, C, H, W) latents, t (N,) times ((N, 2) with the interval embedder), y (N,) -> (N, out, H, W)."""
        # force_drop_ids (N,) bool/0-1: labels made the null class (training's per-sample coin: train/loop.py
        # TrainingDraws). return_hidden_at k (1..depth): (output, block k's tokens (N, T, D)), for REPA. route_keep
        # (N, K) int64: in train mode with set_routing on, only these tokens pass the routed blocks (TREAD).
        self._check_input(x)
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D), T = H * W / p**2
        c = self.time_embedding(t) + self.y_embedder(y, self.training, force_drop_ids)  # (N, D)
        route = self._active_route(route_keep, return_hidden_at)
        x, hidden = self._run_blocks(x, c, self.feat_rope, range(self.depth), route, route_keep, return_hidden_at)
        x = self.unpatchify(self.final_layer(x, c))  # (N, out_channels, H, W)
        return x if return_hidden_at is None else (x, hidden)
