"""REPA (Yu et al. 2024, "Representation Alignment for Generation"): projector, token matching and the loss.

The hidden tokens h (N, T, D) of block `depth` of the diffusion transformer go through a small MLP
h_phi: D -> P -> P -> E (SiLU; REPA's build_mlp) and are pulled towards a frozen encoder's patch tokens y*
(N, T, E) by the mean negative cosine similarity over tokens (REPA Eq. 8):

    L_REPA = -E_n [ 1/T sum_t cos(y*_{n,t}, h_phi(h_{n,t})) ],     L = L_objective + lambda L_REPA.

REPA's setting: depth 8 of 28 for SiT-XL/2, P = 2048, lambda = 0.5, DINOv2-B/14 at 224 px (E = 768). Its token
grids match (256 px, patch 2: 16 x 16 DiT tokens; 224 px / 14: 16 x 16 encoder tokens). At other sizes the
encoder's token grid (an image of E channels) is resized to the DiT's (`match_tokens`): a coarser DiT grid
takes the mean of the encoder tokens over each DiT token's region (adaptive average pooling), a finer one
interpolates them bilinearly, so each DiT token is aligned with encoder features of the same image region.
The encoder never runs in training here: its tokens are read from the latent folder ("repr", written by
`python -m extract --repr-encoder`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.runtime.errors import UserError

REPR_TENSOR = "repr"  # the shard tensor holding an encoder's patch tokens (F, T, E)


class Projector(nn.Module):
    """REPA's h_phi: Linear(D, P) SiLU Linear(P, P) SiLU Linear(P, E), applied per token."""

    def __init__(self, hidden_size: int, projector_dim: int, feature_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, feature_dim))
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):  # REPA initialises every linear layer of SiT this way
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)

    @property
    def feature_dim(self) -> int:
        return self.mlp[-1].out_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(N, T, D) -> (N, T, E)."""
        return self.mlp(h)


def match_tokens(features: torch.Tensor, tokens: int) -> torch.Tensor:
    """Encoder tokens (N, T_e, E) on a square grid -> (N, tokens, E) on the DiT's square grid (same region each)."""
    n, count, dim = features.shape
    if count == tokens:
        return features
    src, dst = math.isqrt(count), math.isqrt(tokens)
    grid = features.transpose(1, 2).reshape(n, dim, src, src).float()  # (N, E, g_e, g_e), row-major like ViT
    if dst < src:  # each DiT token gets the mean of the encoder tokens over its image region
        grid = F.adaptive_avg_pool2d(grid, dst)  # (N, E, g, g)
    else:  # finer DiT grid: bilinear, pixel-centre aligned
        grid = F.interpolate(grid, size=(dst, dst), mode="bilinear", align_corners=False)  # (N, E, g, g)
    return grid.flatten(2).transpose(1, 2)  # (N, tokens, E)


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """REPA Eq. 8 per sample: -1/T sum_t cos(target_t, projected_t) -> (N,); target (N, T, E) is not trained."""
    cos = F.cosine_similarity(projected.float(), target.float(), dim=-1)  # (N, T)
    return -cos.mean(dim=1)


def check_depth(depth: int, model_depth: int, model: str) -> None:
    """REPA's depth counts blocks from 1 (block `depth`'s output is aligned); beyond the model is refused."""
    if not 1 <= depth <= model_depth:
        raise UserError(f"--repa-depth {depth} is outside the {model_depth} blocks of {model}: REPA aligns the output "
                        f"of block k for 1 <= k <= depth (REPA: 8 of 28 for SiT-XL/2, about a third of the way "
                        f"in). Pass --repa-depth between 1 and {model_depth}.")


def check_grid(count: int, what: str) -> None:
    """Token counts must be square grids (ViT patch tokens, DiT patches)."""
    if math.isqrt(count) ** 2 != count:
        raise UserError(f"{what} has {count} tokens, not a square grid; REPA here needs square token grids "
                        f"(a ViT's patch tokens without class or register tokens).")


def features_of(meta: dict, root, tensor_names) -> dict:
    """The encoder identity a latent folder records, or the one-paragraph refusal when it has no features."""
    if REPR_TENSOR not in tensor_names or "repr_encoder" not in meta:
        raise UserError(f"REPA was asked for (--repa-weight > 0), but the latent folder {root} holds no encoder "
                        f"features (no {REPR_TENSOR!r} tensor in its index.json): REPA reads them instead of running "
                        f"the encoder in training. Extract a folder with them (`python -m extract ... "
                        f"--repr-encoder facebook/dinov2-base` or a local DINOv2 folder, into a new --out) and "
                        f"train on it, or drop --repa-weight.")
    return dict(meta["repr_encoder"])


def same_features(saved: dict, current: dict) -> list[str]:
    """What differs between the encoder a run started with and the folder's (ignoring where it was read from)."""
    keys = ("model_type", "config_sha256", "input_size", "patch_size", "tokens", "dim", "normalisation", "dtype")
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


REPA_PROJECTOR_PREFIX = "projectors."  # REPA's released SiT-XL/2 keeps its projector under this name (build_mlp)
