"""Token routing (TREAD: Krause et al., ICCV 2025, github CompVis/tread): a cheaper training step, no new weights.

In training, blocks start..end (inclusive, counted from 0 as `blocks.N`) see only a random subset of each sample's
tokens; after block `end` the skipped ones re-enter holding what block start-1 gave them, so later blocks and the
loss see every token. Evaluation and sampling run every token through every block.

TREAD's facts this follows (routing_module.py, dit.py, configs/model/tread.yaml):
- `selection_ratio` (0.5 in the paper): int(T * ratio) tokens skip the route, chosen uniformly per sample.
- The route of its DiT-B/2 config is blocks 2..8 of 12; its guideline scales absolutely, i = 2 and j = depth - 4.
- Routing applies to every sample of the batch, the label-dropped (unconditional) ones included.
Here the choice comes from the sample's stream-position generator (train/loop.py), so a resumed run routes alike.
"""
from __future__ import annotations

import torch

from shared.runtime.errors import UserError

PAPER_RATIO = 0.5  # TREAD's selection ratio: half the tokens skip the route
PAPER_START = 2  # TREAD's route starts at block 2 (counted from 0) ...
PAPER_END_FROM_LAST = 4  # ... and ends at block depth - 4 ("absolute scaling", DiT-B/2: 2..8 of 12)


def paper_end(depth: int) -> int:
    """TREAD's last routed block for a model of `depth` blocks: depth - 4."""
    return depth - PAPER_END_FROM_LAST


def kept_tokens(tokens: int, ratio: float) -> int:
    """How many of `tokens` go through the routed blocks: T - int(T * ratio), as TREAD's Router.get_mask."""
    return tokens - int(tokens * ratio)


def check_route(ratio: float, start: int, end: int, depth: int, tokens: int, model: str, body: bool = False) -> None:
    """UserError (one paragraph) unless a route is a ratio in (0, 1) over blocks 0 <= start <= end < depth."""
    # body: the model has a DiT^DH head after its `depth` body blocks; a route lies within the body.
    if not 0 < ratio < 1:
        raise UserError(f"--route-ratio {ratio} must lie strictly between 0 and 1: it is the share of tokens that "
                        f"skip the routed blocks (TREAD: {PAPER_RATIO}). Omit the flag (or pass 0) to train without "
                        "routing.")
    if not 0 <= start <= end < depth:
        blocks = f"{depth} body blocks (a route lies within the body; its DiT^DH head sees every token)" if body \
            else f"{depth} blocks"
        raise UserError(f"the route from block {start} to block {end} does not fit {model}'s {blocks}: "
                        f"--route-start and --route-end are block indices counted from 0 (blocks.N), the route "
                        f"covers both and they need 0 <= start <= end <= {depth - 1}. TREAD routes blocks "
                        f"{PAPER_START}..depth-{PAPER_END_FROM_LAST} ({PAPER_START}..{paper_end(depth)} here); pass "
                        f"--route-start/--route-end inside that range.")
    if int(tokens * ratio) == 0:
        raise UserError(f"--route-ratio {ratio} of {model}'s {tokens} tokens routes int({tokens} x {ratio}) = 0 "
                        f"tokens, so routing would change nothing; pass a ratio of at least {1 / tokens:.3g}.")


def draw_kept(generator: torch.Generator, tokens: int, kept: int) -> torch.Tensor:
    """(kept,) int64 indices of the tokens that go through the route, uniform without replacement, ascending."""
    return torch.rand(tokens, generator=generator).argsort()[:kept].sort().values


def gather_tokens(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x (N, T, D), keep (N, K) -> the kept tokens (N, K, D)."""
    return x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def scatter_tokens(full: torch.Tensor, keep: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """full (N, T, D) with the kept rows replaced by routed (N, K, D); out of place, so `full` stays intact."""
    return full.scatter(1, keep.unsqueeze(-1).expand(-1, -1, full.shape[-1]), routed.to(full.dtype))

