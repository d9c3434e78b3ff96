"""DiT^DH: a DiT body with a wide, shallow head (RAE: Zheng, Ma, Tong, Xie 2025, "Diffusion Transformers with
Representation Autoencoders", Sec. 4; github bytetriper/RAE `src/stage2/models/DDT.py`, MIT; our own code).

RAE diffuses 16x16x768 DINOv2 tokens, which a transformer narrower than a token cannot fit (its Sec. 4.1), so
after the body (DiT-XL: 28 blocks of width 1152) a head of 2 blocks of width 2048 sees the noisy tokens again,
embedded afresh, conditioned *per token* on the body's output (DDT's idea: Wang et al. 2025, "DDT: Decoupled
Diffusion Transformer"). Differences from our DiT, each as RAE's DiTwDDTHead:

- time features: Gaussian Fourier features sin/cos(2 pi t W) of fixed random W ~ N(0, 1) (Tancik et al. 2020),
  512 of them, then DiT's two-layer SiLU MLP (`t_embedder.W`, `t_embedder.mlp`), instead of DiT's sinusoids;
- the body's conditioning is c = SiLU(t_emb + y_emb) (each block's adaLN applies SiLU once more);
- the head's and the final layer's conditioning is s = Linear(SiLU(t_emb + body tokens)) (N, T, D_head);
- sin-cos positions on the body's input only; each stage its own 2-D RoPE table (`enc_feat_rope`, `dec_feat_rope`);
- no learned variance by default (velocity prediction): out_channels = in_channels.

Tensor names are RAE's (`s_embedder` the body's patch embedding, `x_embedder` the head's, `s_projector`,
`blocks.0..depth-1` the body and `blocks.depth..` the head), so its released DiT^DH-XL loads with strict=True.
Token routing (TREAD) routes within the body only. RAE runs patch size 1 only; larger patches use DiT's order.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.network.dit import (CLASS_DROPOUT_PROB, Backbone, FinalLayer, LabelEmbedder, PatchEmbed, adaln_zero_,
                                init_condition_mlp_, init_patch_embed_, set_positions_)
from shared.runtime.errors import SettingError

FOURIER_FEATURES = 256  # RAE's GaussianFourierEmbedding(embedding_size=256): 512 sin/cos features


class FourierTimestepEmbedder(nn.Module):
    """sin/cos(2 pi t W) for fixed W ~ N(0, 1), then a two-layer SiLU MLP (RAE's GaussianFourierEmbedding)."""

    def __init__(self, hidden_size, features=FOURIER_FEATURES):
        super().__init__()
        # A frozen parameter, as RAE's (so `t_embedder.W` is in the state dict and the EMA copies it).
        self.W = nn.Parameter(torch.zeros(features), requires_grad=False)  # (F,)
        self.mlp = nn.Sequential(nn.Linear(2 * features, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))

    def forward(self, t):
        """(N,) times in [0, 1] -> (N, D); features in RAE's order (t W) 2 pi, in fp32 (a float64 model: float64)."""
        dtype = torch.promote_types(self.W.dtype, torch.float32)  # the model's precision, whatever t arrives in
        angles = t[:, None].to(dtype) * self.W[None, :].to(dtype) * 2 * math.pi  # (N, F)
        features = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)  # (N, 2F), sine half first
        return self.mlp(features.to(self.mlp[0].weight.dtype))  # (N, D)


def check_head(head_depth, head_width, head_heads):
    """UserError unless the head is off (depth 0) or a whole shape: depth >= 1, width divisible by heads."""
    if head_depth and (head_depth < 0 or head_width <= 0 or head_heads <= 0 or head_width % head_heads):
        raise SettingError(f"the DiT^DH head needs depth >= 1 and a width divisible by its attention heads, got depth "
                           f"{head_depth}, width {head_width}, heads {head_heads} (RAE: 2 blocks, width 2048, 16 "
                           "heads); fix {head depth}/{head width}/{head heads}, or use a DiTDH preset as it is.")


class DiTDH(Backbone):
    """A DiT body of `depth` blocks at `hidden_size`, then `head_depth` blocks at `head_width` conditioned per token."""

    def __init__(self, input_size=16, patch_size=1, in_channels=768, hidden_size=1152, depth=28, num_heads=16,
                 head_depth=2, head_width=2048, head_heads=16, mlp_ratio=4.0, class_dropout_prob=CLASS_DROPOUT_PROB,
                 num_classes=1000, learn_sigma=False, attention="auto", grad_checkpoint_every=0, norm="rmsnorm",
                 mlp="swiglu", rope=True, qk_norm=False):
        check_head(head_depth, head_width, head_heads)
        assert head_depth, "a DiT^DH model needs a head (head depth >= 1); for no head, use a DiT preset"
        super().__init__(input_size, patch_size, in_channels, depth, num_heads, num_classes, learn_sigma, mlp_ratio,
                         dict(norm=norm, mlp=mlp, rope=rope, qk_norm=qk_norm))
        self.head_depth = head_depth
        # RAE's tensor names, built in its order: the Linears keep torch's init, drawn in this order.
        self.s_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)  # the body's input
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, head_width)  # the head's input
        self.s_projector = nn.Linear(hidden_size, head_width) if hidden_size != head_width else nn.Identity()
        self.t_embedder = FourierTimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.final_layer = FinalLayer(head_width, patch_size, self.out_channels, norm=norm)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid ** 2, hidden_size), requires_grad=False)  # (1, T, D)
        self.enc_feat_rope = self.rope_table(hidden_size, num_heads)
        self.dec_feat_rope = self.rope_table(head_width, head_heads)
        self.blocks = nn.ModuleList(self.make_blocks(hidden_size, num_heads, depth)
                                    + self.make_blocks(head_width, head_heads, head_depth))
        self.finish(attention, grad_checkpoint_every)

    @property
    def feat_rope(self):
        """The body's rotary table (what the planner and the input check ask DiT for)."""
        return self.enc_feat_rope

    @torch.no_grad()
    def initialize_weights(self):
        """RAE's init: torch's Linear init kept; patch embeddings as linears; adaLN-Zero; zero output; W ~ N(0, 1)."""
        init_patch_embed_(self.s_embedder)
        init_patch_embed_(self.x_embedder)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        set_positions_(self.pos_embed, self.grid, [self.enc_feat_rope, self.dec_feat_rope])  # DiT's table, as RAE's
        nn.init.normal_(self.t_embedder.W, std=1.0)
        init_condition_mlp_(self.t_embedder.mlp)
        adaln_zero_(self.blocks, self.final_layer)

    def forward(self, x, t, y, force_drop_ids=None, return_hidden_at=None, route_keep=None):
        """x (N, C, H, W), t (N,) in [0, 1], y (N,) -> (N, out, H, W); routing (TREAD) spans the body only, as DiT's."""
        self._check_input(x)
        t_emb = self.t_embedder(t)  # (N, D)
        c = F.silu(t_emb + self.y_embedder(y, self.training, force_drop_ids))  # (N, D)
        s = self.s_embedder(x) + self.pos_embed  # (N, T, D)
        route = self._active_route(route_keep, return_hidden_at)
        s, hidden = self._run_blocks(s, c, self.enc_feat_rope, range(self.depth), route, route_keep, return_hidden_at)
        s = self.s_projector(F.silu(t_emb.unsqueeze(1) + s))  # (N, T, D_head): the head's per-token condition
        h = self.x_embedder(x)  # (N, T, D_head): the noisy input again, no absolute positions (as RAE)
        h, _ = self._run_blocks(h, s, self.dec_feat_rope, range(self.depth, self.depth + self.head_depth))
        out = self.unpatchify(self.final_layer(h, s))  # (N, out_channels, H, W)
        return out if return_hidden_at is None else (out, hidden)
