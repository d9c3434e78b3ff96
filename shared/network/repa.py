"""REPA (Yu et al. 2024, "Representation Alignment for Generation"): projector, token matching and the loss.

The hidden tokens h (N, T, D) of block `depth` of the diffusion transformer go through a small MLP
h_phi: D -> P -> P -> E (SiLU; REPA's build_mlp) and are pulled towards a frozen encoder's patch tokens y*
(N, T, E) by the mean negative cosine similarity over tokens (REPA Eq. 8):

    L_REPA = -E_n [ 1/T sum_t cos(y*_{n,t}, h_phi(h_{n,t})) ],     L = L_objective + lambda L_REPA.

REPA's setting: depth 8 of 28 for SiT-XL/2, P = 2048, lambda = 0.5, DINOv2-B/14 at 224 px (E = 768): 16 x 16
tokens on both sides at 256 px, patch 2. At other sizes `match_tokens` resizes the encoder's token grid to the
DiT's (mean pooling onto a coarser grid, bilinear onto a finer one), so each DiT token meets its region's features.
The encoder never runs in training: its tokens are the shard column "repr" (F, T, E) that `python -m extract
--repr-encoder` writes; `REPR_COLUMN` at the end is its record (shared/datasets/columns.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.datasets.columns import ShardColumn, register_column
from shared.datasets.shards import FLAG_DTYPES
from shared.runtime.cli import option
from shared.runtime.errors import UserError
from shared.runtime.rundir import PROJECTOR_FILE


class Projector(nn.Module):
    """REPA's h_phi: Linear(D, P) SiLU Linear(P, P) SiLU Linear(P, E), applied per token."""

    def __init__(self, hidden_size: int, projector_dim: int, feature_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, feature_dim))
        for layer in self.mlp[::2]:  # the Linears: REPA initialises every linear layer of SiT this way
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

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


def same_features(saved: dict, current: dict) -> list[str]:
    """What differs between the encoder a run started with and the folder's (ignoring where it was read from)."""
    keys = ("model_type", "config_sha256", "input_size", "patch_size", "tokens", "dim", "normalisation", "dtype")
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


REPA_PROJECTOR_PREFIX = "projectors."  # REPA's released SiT-XL/2 keeps its projector under this name (build_mlp)


# --- The shard column "repr": DINOv2's tokens stored at extraction (shared/tokenizers/repr_encoder.py) ---

@dataclass(kw_only=True)
class ReprFlags:
    """`python -m extract`'s flags of the encoder whose tokens REPA aligns to."""

    repr_encoder: str | None = option(
        None, "Also store a frozen encoder's patch tokens for REPA (train --repa-weight): a DINOv2 folder saved by "
              "transformers' save_pretrained or a Hub id such as facebook/dinov2-base; run once per image and stored "
              "flip, fp32 (default: none). The dry run prints the storage.")
    repr_image_size: int | None = option(
        None, "Pixels per side the encoder sees, a multiple of its patch size (default: REPA's, image-size / 16 "
              "patches: 224 for DINOv2/14 at 256 px).")
    repr_dtype: str = option("fp16", "Storage dtype of the encoder tokens (DINOv2-B at 256 px: ~384 KiB per image and "
                                     "flip in fp16)", choices=tuple(FLAG_DTYPES))


@dataclass(kw_only=True)
class RepaFlags:
    """`python -m train`'s REPA flags: align block `repa_depth`'s tokens through an MLP D -> P -> P -> E."""

    repa_weight: float = option(0.0, "REPA: weight lambda of the alignment loss (REPA: 0.5); 0 turns REPA off "
                                     "(default). Needs a latent folder extracted with --repr-encoder", min=0)
    repa_depth: int = option(8, "REPA: align the output of this block, counted from 1 (REPA: 8 of SiT-XL's 28)")
    repa_projector_dim: int = option(2048, "REPA: hidden width P of the projector MLP D -> P -> P -> E (REPA: 2048)",
                                     min=1)
    repa_feature_dim: int | None = option(
        None, "REPA: the projector's output E, which must equal the stored features' width (REPA's "
              "--projector-embed-dims, 768 for DINOv2-B); default: read from the latent folder")


def plan_repr(flags: ReprFlags, image_size: int) -> dict | None:
    """The encoder's record for index.json (its identity and storage dtype, no weights read), or None without one."""
    if flags.repr_encoder is None:
        if flags.repr_image_size is not None:
            raise UserError("--repr-image-size applies to the representation encoder; pass --repr-encoder too, or "
                            "drop --repr-image-size.")
        return None
    from shared.tokenizers.repr_encoder import plan_identity

    return {**plan_identity(flags.repr_encoder, image_size, flags.repr_image_size), "dtype": flags.repr_dtype}


def load_repr(flags: ReprFlags, record: dict, device):
    """The frozen DINOv2's `encode`: uint8 (B, 3, S, S) -> patch tokens (B, T, D) fp32."""
    from shared.tokenizers.repr_encoder import load_encoder

    return load_encoder(flags.repr_encoder, record, device)


def repr_storage(record: dict, frames: int) -> tuple[int, str]:
    """(bytes per image, the dry run's line with {size} for them) of the stored encoder tokens (F, T, D)."""
    return (frames * record["tokens"] * record["dim"] * FLAG_DTYPES[record["dtype"]].itemsize,
            f"encoder tokens {{size}} per image ({frames} flip(s) x {record['tokens']} tokens x {record['dim']} "
            f"{record['dtype']}; {record['grid']}x{record['grid']} patches of {record['patch_size']} px at "
            f"{record['input_size']} px); --repr-dtype bf16 or fp16 halves fp32")


def resolve_repa(flags: RepaFlags, record: dict, shape, model: str, root) -> RepaFlags:
    """The depth fits the model, E matches the stored features (one paragraph each); E filled in."""
    from shared.network.models import PRESETS

    depth, model_depth = flags.repa_depth, PRESETS[model]["depth"]
    if not 1 <= depth <= model_depth:  # REPA counts blocks from 1: block `depth`'s output is aligned
        raise UserError(f"--repa-depth {depth} is outside the {model_depth} blocks of {model}: REPA aligns the output "
                        f"of block k for 1 <= k <= depth (REPA: 8 of 28 for SiT-XL/2, about a third of the way "
                        f"in). Pass --repa-depth between 1 and {model_depth}.")
    _, tokens, dim = shape  # (F, T, E)
    if flags.repa_feature_dim is not None and flags.repa_feature_dim != dim:
        raise UserError(f"--repa-feature-dim {flags.repa_feature_dim} does not match the features stored in "
                        f"{root}: {tokens} tokens of width {dim} from {record.get('source')}. The projector's "
                        f"output must have the features' width: pass --repa-feature-dim {dim} (or omit it), or "
                        f"extract features of width {flags.repa_feature_dim} with another --repr-encoder into a new "
                        f"folder.")
    if math.isqrt(tokens) ** 2 != tokens:
        raise UserError(f"the encoder features in {root} has {tokens} tokens, not a square grid; REPA here needs "
                        f"square token grids (a ViT's patch tokens without class or register tokens).")
    return replace(flags, repa_feature_dim=dim)


def repa_loss(projected: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """REPA Eq. 8 per sample (N,): projected block tokens (N, T, E) against the stored tokens (N, T_e, E)."""
    return alignment_loss(projected, match_tokens(features, projected.shape[1]))


REPR_COLUMN = register_column(ShardColumn(
    name="repr", meta_key="repr_encoder", what="encoder features",
    how="--repr-encoder facebook/dinov2-base or a local DINOv2 folder",
    extract_flags=ReprFlags, plan=plan_repr, load=load_repr, storage=repr_storage,
    train_flags=RepaFlags, weight="repa_weight", depth="repa_depth", resolve=resolve_repa,
    build_head=lambda flags, width: Projector(width, flags.repa_projector_dim, flags.repa_feature_dim),
    loss=repa_loss, loss_name="repa", head_file=PROJECTOR_FILE, describe_change=same_features))
