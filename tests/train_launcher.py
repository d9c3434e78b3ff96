"""Test-side launcher: `python tests/train_launcher.py <train flags>` runs python -m train with callbacks.

Everything here belongs to the tests, not to the product: it registers train.callbacks hooks (and, for
the prune pause point, wraps one product function) according to environment variables:

  TRACE_DIR=DIR        each rank writes DIR/rank-<r>.json: stream positions seen, DDP all-reduce calls per
                       micro-step, a weight hash, and whether diffusers was imported in this process at any
                       point it was looked at (setup, every step, every checkpoint after the product's own
                       callbacks drew curves or started the preview watcher, the end)
  PAUSE_AT=KIND:STEP   write DIR/paused and sleep (for the test to SIGKILL) at a fixed point:
                       checkpoint:S  right after checkpoint S is complete (published, exported, pruned)
                       export:S      after checkpoint S is published, before its EMA export is written
                       prune:S       in the middle of deleting an old checkpoint at step S (renamed, not gone)
                       staging:S     in the middle of writing checkpoint S (its model file written, not its EMA)
  PERTURB_RANK=R       after the first step, rank R nudges one weight (the cross-rank check must catch it)

The trace also lists the shard files this process sha256-hashed, when it read a checkpoint for resume
(monotonic start and end: processes of one machine must take turns), and with $DIT_LATENT_CACHE set the
largest size of that cache folder seen after any step (a streamed --cache-limit run must stay under it).
"""
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from shared.datasets import integrity
from shared.runtime import rundir  # noqa: E402
from train import checkpoint as ckpt_io  # noqa: E402
from train import loop as train_loop  # noqa: E402
from train.__main__ import main  # noqa: E402
from train.callbacks import Callback  # noqa: E402


def pause(where: str) -> None:
    """Tell the test we arrived, then wait to be killed."""
    folder = Path(os.environ["TRACE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "paused").write_text(where)
    time.sleep(3600)


HASHED, LOADS = [], []  # shard names this process hashed; (start, end) of each checkpoint read


def _record_io() -> None:
    """Wrap the shard hasher and the checkpoint reader to note what this process did and when."""
    real_hash, real_load = integrity._hash_files, ckpt_io.load_checkpoint

    def hash_files(root, entries, progress):
        HASHED.extend(e["name"] for e in entries)
        return real_hash(root, entries, progress)

    def load_checkpoint(ckpt, rank):
        start = time.monotonic()
        try:
            return real_load(ckpt, rank)
        finally:
            LOADS.append((start, time.monotonic()))

    integrity._hash_files, ckpt_io.load_checkpoint = hash_files, load_checkpoint


class Trace(Callback):
    """Records what this rank saw and did."""

    def __init__(self):
        self.positions, self.allreduce_calls, self.pending, self.in_step = [], [], 0, False
        self.diffusers_seen = False

    def _look_for_diffusers(self):
        self.diffusers_seen = self.diffusers_seen or "diffusers" in sys.modules

    def on_checkpoint(self, run, path):
        self._look_for_diffusers()

    def on_setup(self, run):
        self._look_for_diffusers()
        model = run.learner.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting(state, bucket):
                self.pending += 1
                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, counting)

    def _close_micro_step(self):
        self.allreduce_calls.append(self.pending)
        self.pending = 0

    def on_micro_batch(self, run, batch):
        if self.in_step:  # the previous micro-step's backward is done
            self._close_micro_step()
        self.in_step = True
        self.positions += batch["position"].tolist()

    def on_step_end(self, run, result):
        self._close_micro_step()
        self.in_step = False
        self._look_for_diffusers()
        cache = os.environ.get("DIT_LATENT_CACHE")
        if cache:  # a streamed --cache-limit run: how large the node's cache folder got
            self.cache_bytes = max(getattr(self, "cache_bytes", 0),
                                   sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file()))

    def on_train_end(self, run):
        digest = hashlib.sha256()
        for name, tensor in sorted(run.learner.dit.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        rank = run.accelerator.process_index
        record = {"rank": rank, "world_size": run.accelerator.num_processes, "step": run.step,
                  "positions": self.positions, "allreduce_calls": self.allreduce_calls,
                  "weights_sha256": digest.hexdigest(),
                  "diffusers_imported": self.diffusers_seen or "diffusers" in sys.modules,
                  "hashed": HASHED, "checkpoint_loads": LOADS, "cache_bytes": getattr(self, "cache_bytes", None)}
        folder = Path(os.environ["TRACE_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{rank}.json").write_text(json.dumps(record))


class PauseAfterCheckpoint(Callback):
    def __init__(self, step):
        self.step = step

    def on_checkpoint(self, run, path):
        if run.step == self.step:
            pause(f"checkpoint:{self.step}")


class PauseBeforeExport(Callback):
    def __init__(self, step):
        self.step = step

    def on_publish(self, run, path):
        if run.step == self.step:
            pause(f"export:{self.step}")


class Perturb(Callback):
    def __init__(self, rank):
        self.rank = rank

    def on_step_end(self, run, result):
        if run.accelerator.process_index == self.rank and run.step == 1:
            with torch.no_grad():
                next(run.learner.dit.parameters()).view(-1)[0] += 1e-3


def install_pause(kind: str, step: int, callbacks: list) -> None:
    """Arrange to stop at a fixed point of the checkpoint sequence."""
    if kind == "checkpoint":
        callbacks.append(PauseAfterCheckpoint(step))
    elif kind == "export":
        callbacks.append(PauseBeforeExport(step))
    elif kind == "staging":
        real_save = train_loop.save_weights

        def save_weights(path, state_dict, model_config, latent_meta, at):
            if at == step and Path(path).name == rundir.EMA_FILE:
                pause(f"staging:{step}")  # the staging folder holds the model file, not yet the EMA
            return real_save(path, state_dict, model_config, latent_meta, at)

        train_loop.save_weights = save_weights
    elif kind == "prune":
        def remove_tree(path):
            os.replace(path, path.with_name(f".tmp-del-{path.name}"))  # renamed, not deleted: a kill mid-prune
            pause(f"prune:{step}")

        ckpt_io.remove_tree = remove_tree
    else:
        raise SystemExit(f"unknown PAUSE_AT kind {kind!r}")


def launch(argv) -> int:
    """Register the callbacks asked for by the environment and run python -m train."""
    callbacks = [Trace()] if os.environ.get("TRACE_DIR") else []
    if callbacks:
        _record_io()
    if os.environ.get("PAUSE_AT"):
        kind, step = os.environ["PAUSE_AT"].split(":")
        install_pause(kind, int(step), callbacks)
    if os.environ.get("PERTURB_RANK"):
        callbacks.append(Perturb(int(os.environ["PERTURB_RANK"])))
    return main(argv, callbacks)


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
