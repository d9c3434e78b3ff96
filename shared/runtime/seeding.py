"""The one seed mixer: (seed, key, ...) -> an independent 64-bit generator seed (numpy's SeedSequence).

Training draws sample p's randomness from mix_seed(seed, p), sampling image i's from mix_seed(seed, i).
"""
import numpy as np
import torch


def mix_seed(seed: int, *keys: int) -> int:
    """A well-mixed 64-bit seed for (seed, *keys) (numpy SeedSequence; no collisions between runs)."""
    return int(np.random.SeedSequence([int(seed), *(int(k) for k in keys)]).generate_state(1, dtype=np.uint64)[0])


def generator_for(seed: int, *keys: int) -> torch.Generator:
    """A CPU torch.Generator seeded with mix_seed(seed, *keys)."""
    return torch.Generator().manual_seed(mix_seed(seed, *keys))
