"""The training data stream: resumable positions, and every random draw keyed by the sample's position.

The objective (shared/generative/objectives.py) decides how the time is drawn: DiT's integer timestep, or SiT's
flow time. Each sample in the global stream has a position p (samples consumed before it by all processes together,
see shared.datasets.shards.StreamSampler). All of its randomness (timestep, class dropout, flip variant, the fresh
posterior draw, the diffusion noise and, with token routing, the tokens it routes) comes from one generator seeded by (seed, p), as edm2 derives its
randomness from (seed, images seen). So a sample gets the same draws whatever the number of processes,
micro-batch size, DataLoader workers, or where a run was interrupted and resumed.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from shared.network.routing import draw_kept
from shared.runtime.seeding import generator_for
from shared.datasets.shards import LatentDataset, StreamSampler
from train.latents import follow


class PositionedSampler(torch.utils.data.Sampler):
    """StreamSampler that also yields each index's global stream position: (position, index) pairs."""

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int, start: int, counts=None,
                 window: int = 0):
        self.stream = StreamSampler(num_samples, rank=rank, world_size=world_size, seed=seed, start=start,
                                    counts=counts, window=window)
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # Rank r owns the positions p >= start with p % world_size == r, in order (StreamSampler contract).
        position = self.start + (self.rank - self.start) % self.world_size
        for index in self.stream:
            yield position, index
            position += self.world_size


class TrainingDraws(torch.utils.data.Dataset):
    """Wraps a LatentDataset: a batch of (position, index) pairs -> the tensors one training micro-step needs.

    Output of `__getitems__` (B samples): x0 (B,C,h,w) fp32 fresh latents normalised by `norm` (the run's
    shared/tokenizers/norm.py record; default: the tokenizer's own convention), label
    (B,) int64, drop (B,) bool (class dropout), t (B,) the objective's times (int64 DiT timesteps, or float32
    flow times), noise (B,C,h,w) fp32, position
    (B,) int64: each sample's global stream position, which keys all of its draws. With `extra` column names (those a
    head trains on, e.g. REPA's "repr"), also each of them (B, ...) fp32, of the same flip variant as the latent (the
    same image the latent was encoded from). With `route` (tokens T, kept K),
    also route_keep (B,K) int64: the tokens that pass the routed blocks (shared/network/routing.py).
    """

    def __init__(self, dataset: LatentDataset, seed: int, class_dropout_prob: float, objective,
                 extra: tuple = (), route: tuple[int, int] | None = None, norm=None):
        self.dataset, self.seed, self.class_dropout_prob = dataset, seed, class_dropout_prob
        self.norm = norm or dataset.native_norm
        self.objective = objective  # shared.generative.objectives.Objective: draws each sample's time
        self.extra = tuple(extra)  # besides the moments, the only columns read
        self.route = route

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, pair):
        return self.__getitems__([pair])

    def __getitems__(self, pairs) -> dict:
        positions = torch.tensor([p for p, _ in pairs], dtype=torch.int64)  # (B,)
        gens = [generator_for(self.seed, int(p)) for p in positions]
        # Draw order per sample is fixed: timestep, dropout coin, flip variant, posterior eps, diffusion noise.
        t = torch.cat([self.objective.draw_time(g) for g in gens])  # (B,)
        drop = torch.cat([torch.rand(1, generator=g) for g in gens]) < self.class_dropout_prob  # (B,)
        flips = self.dataset.flips
        variant = torch.cat([torch.randint(0, flips, (1,), generator=g) for g in gens])  # (B,)
        # Only the drawn flip of each column is read (the other frames' bytes stay on disk).
        batch = self.dataset.draw(np.array([i for _, i in pairs], dtype=np.int64), variant.tolist(), self.norm, gens,
                                  self.extra)
        x0 = batch["x0"]  # (B, C, h, w) fp32, normalised
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])  # (B, C, h, w)
        out = {"x0": x0, "label": batch["label"].long(), "drop": drop, "t": t, "noise": noise, "position": positions}
        if self.route:  # drawn last, so the draws above are the same with routing on or off
            out["route_keep"] = torch.stack([draw_kept(g, *self.route) for g in gens])  # (B, K)
        out.update({name: batch[name].float() for name in self.extra})  # (B, ...), of flip `variant`
        return out


def _passthrough(batch):
    """collate_fn: TrainingDraws already returns a batched dict."""
    return batch


def make_loader(dataset: LatentDataset, *, micro_batch: int, rank: int, world_size: int, seed: int, start: int,
                class_dropout_prob: float, num_workers: int, pin_memory: bool, objective,
                extra: tuple = (), route: tuple[int, int] | None = None, norm=None, window: int = 0,
                global_batch: int | None = None) -> Iterator[dict]:
    """An endless iterator of micro-batches for this rank, starting at global stream position `start`.

    window K > 0: the shard-aware order (shared.datasets.shards.windowed_permutation). A streamed dataset
    (train/latents.py StreamedLatents) is told, through `follow`, which positions every process has consumed.
    """
    counts = dataset.shard_counts if window else None
    sampler = PositionedSampler(len(dataset), rank, world_size, seed, start, counts, window)
    loader = torch.utils.data.DataLoader(
        TrainingDraws(dataset, seed, class_dropout_prob, objective, extra, route, norm), batch_size=micro_batch,
        sampler=sampler,
        num_workers=num_workers, pin_memory=pin_memory, collate_fn=_passthrough,
        # Its own generator, so worker seeding never consumes the global torch RNG.
        generator=torch.Generator().manual_seed(seed), persistent_workers=False,
    )
    global_batch = global_batch or micro_batch * world_size
    ahead = global_batch + (loader.prefetch_factor or 0) * num_workers * micro_batch * world_size  # positions
    return follow(iter(loader), dataset, seed=seed, window=window, start=start, global_batch=global_batch,
                  accum=max(1, global_batch // (micro_batch * world_size)), readahead=ahead)


def synthetic_batch(shape_of, micro_batch: int, class_dropout_prob: float, objective, seed: int = 0,
                    extra: dict | None = None, route: tuple[int, int] | None = None) -> dict:
    """A micro-batch of the loader's keys, shapes and dtypes from random latents (bench and plan).

    shape_of: a ModelConfig or a DiT (both carry in_channels, input_size and num_classes). extra {column: shape}:
    also random columns of those per-sample shapes (REPA's "repr": (T, E)). route (T, K): the routed tokens' indices.
    """
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
