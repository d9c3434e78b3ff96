"""The run folder's training state: the checkpoint a run resumes from, retention, safe loading, `restore`.

A checkpoint (train.loop.save_checkpoint) is assembled in RUN/checkpoints/.tmp-step-XXXXXXX/ and published by one
rename once complete, so a kill at any moment leaves no checkpoint or a whole one. Every .pt file holds only tensors
and plain values, read with torch.load(weights_only=True): nothing is ever unpickled as an arbitrary object.
"""
from __future__ import annotations

import contextlib
import json
import random
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from shared.runtime import rundir
from shared.runtime.cli import flag_name
from shared.runtime.errors import UserError
from shared.weights.checkpoint import nonfinite_tensors
from shared.weights.export import load_weights, read_config
from shared.runtime.fsio import remove_tree
from train.config import TrainConfig


def prune(run_dir: Path, keep_last: int, keep_exports: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints, then `keep_exports` EMA exports (0 keeps all); the deleted."""
    checkpoints = rundir.list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []
    for path in checkpoints:
        remove_tree(path)  # a kill leaves .tmp-, no step-X
    exports = rundir.list_exports(run_dir)[:-keep_exports] if keep_exports > 0 else []
    for path in exports:
        path.unlink(missing_ok=True)
    return checkpoints + exports


def capture_rng() -> dict:
    """Python, numpy, torch CPU and CUDA generator states as tensors and plain values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of capture_rng."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _read(path: Path, load=lambda path: torch.load(path, map_location="cpu", weights_only=True)):
    """load(path) (default: a .pt of tensors and plain values, on the CPU); UserError if it is missing or unreadable."""
    try:
        return load(path)
    except FileNotFoundError as err:
        raise UserError(f"its file {path.name} is missing.") from err
    except Exception as err:  # a truncated or foreign file: say which one (torch's text is one line here)
        raise UserError(f"its file {path.name} is unreadable ({str(err).splitlines()[0][:200]}).") from err


def check_results_dir(cfg: TrainConfig) -> None:
    """--results-dir must be a folder or not exist yet."""
    if Path(cfg.results_dir).exists() and not Path(cfg.results_dir).is_dir():
        raise UserError(f"--results-dir {cfg.results_dir} is a file; pass a folder (it is created if missing).")


def resume_source(cfg: TrainConfig) -> tuple[Path | None, TrainConfig | None]:
    """(the checkpoint to continue from, the config it records), or (None, None) for a run that starts now."""
    check_results_dir(cfg)
    run_dir = Path(cfg.results_dir)
    if cfg.resume == "none":
        if rundir.list_checkpoints(run_dir):
            raise UserError(f"--resume none, but {run_dir} already holds checkpoints; pass --resume auto to "
                            "continue that run, or a new --results-dir to start another.")
        return None, None
    source = rundir.latest_checkpoint(run_dir) if cfg.resume == "auto" else Path(cfg.resume)
    if source is None:
        return None, None
    return source, TrainConfig.from_dict(read_state(source)["config"], str(source))


def read_state(ckpt: Path) -> dict:
    """state.json of a checkpoint folder; UserError if it is not one."""
    path = Path(ckpt) / rundir.STATE_FILE
    if not path.is_file():
        raise UserError(f"{ckpt} is not a checkpoint folder (no {rundir.STATE_FILE}); pass --resume auto, none, or a "
                        "RUN/checkpoints/step-XXXXXXX folder.")
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise UserError(f"the checkpoint {ckpt} cannot be resumed: its {rundir.STATE_FILE} is unreadable ({err}). "
                        f"{damaged_advice(ckpt)}") from None


def damaged_advice(ckpt: Path) -> str:
    """What to do about an unreadable checkpoint: delete it and resume from the previous one, naming both."""
    ckpt = Path(ckpt)
    step = rundir.step_of(ckpt)
    older = [p for p in rundir.list_checkpoints(ckpt.parent.parent) if step is not None and rundir.step_of(p) < step]
    if older:
        return (f"Delete {ckpt} to resume from {older[-1].name} (the previous complete checkpoint), or pass "
                f"--resume {older[-1]}.")
    return f"No older checkpoint exists: delete {ckpt} and pass --resume none to start the run again."


@contextlib.contextmanager
def _resuming(ckpt: Path):
    """A UserError inside becomes 'the checkpoint C cannot be resumed: ...' naming the checkpoint to delete."""
    try:
        yield
    except UserError as err:
        raise UserError(f"the checkpoint {ckpt} cannot be resumed: {err} {damaged_advice(ckpt)}") from None


def checkpoint_config(ckpt: Path):
    """The ModelConfig a checkpoint's model file records (header only)."""
    with _resuming(ckpt):
        return read_config(Path(ckpt) / rundir.MODEL_FILE)


def load_checkpoint(ckpt: Path, rank: int) -> dict:
    """Everything a checkpoint holds, on the CPU: weights (finite), optimizer, scaler, this rank's RNG, state."""
    ckpt = Path(ckpt)
    rng = ckpt / rundir.rng_file(rank)
    with _resuming(ckpt):
        saved = {"state": read_state(ckpt), "model": load_weights(ckpt / rundir.MODEL_FILE)[0],  # config.json: space
                 "ema": load_weights(ckpt / rundir.EMA_FILE)[0], "optimizer": _read(ckpt / rundir.OPTIMIZER_FILE),
                 "scaler": _read(ckpt / rundir.SCALER_FILE),
                 "rng": _read(rng) if rng.is_file() else None}  # absent when resuming on more processes
    for part in ("model", "ema"):  # NaN/inf weights would train on silently as NaN
        bad = [name for name, _, _ in islice(nonfinite_tensors(saved[part]), 3)]
        if bad:
            raise UserError(f"the checkpoint {ckpt} holds non-finite {part} weights ({', '.join(bad)}); it "
                            f"cannot be resumed. {damaged_advice(ckpt)}")
    return saved


# ---- Resuming a run ----

def restore(run, source: Path) -> None:
    """Resume the train.loop.Run `run` from `source`; the processes of one machine take turns, so one node holds one
    CPU copy at a time (each reads the whole state, ~11 GB for XL/2, into CPU memory: eight at once is ~90 GB)."""
    acc = run.accelerator
    if acc.num_processes == 1:
        return _restore_from(run, source)
    local = torch.tensor([acc.local_process_index], device=run.device)
    turns = int(acc.gather(local).max()) + 1  # the largest node's process count (nodes may differ)
    for turn in range(turns):
        if acc.local_process_index == turn:
            _restore_from(run, source)
        acc.wait_for_everyone()


def _restore_from(run, source: Path) -> None:
    """Load weights, EMA, optimizer, scaler, this rank's RNG, the step and the data position (CPU copy freed)."""
    learner = run.learner
    saved = load_checkpoint(source, run.accelerator.process_index)
    learner.dit.load_state_dict(saved["model"], strict=True)
    learner.ema.load_state_dict(saved["ema"], strict=True)
    for column, _ in learner.consumers:  # each column head (REPA's projector): a missing one or one of other shapes
        head, path = learner.heads[column.name], source / column.checkpoint_file
        if not path.is_file():
            raise UserError(f"the checkpoint {source} has no head of the shard column {column.name!r} ({path.name}): "
                            f"it was not trained with {flag_name(column.weight)}, so it cannot be resumed with it. "
                            f"Resume without it, or start a new --results-dir.")
        state = _read(path, load_file)
        mine = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        saved_shapes = {k: tuple(v.shape) for k, v in state.items()}
        if mine != saved_shapes:
            last = sorted(k for k in saved_shapes if k.endswith("weight"))[-1:]
            raise UserError(f"the head of the shard column {column.name!r} in {source} has shapes "
                            f"{[saved_shapes[k] for k in last]} (output width x input) where this run builds "
                            f"{[mine.get(k) for k in last]}: its width does not match the stored column or its "
                            f"flags. Resume with the latent folder and flags the run was started with, or start a "
                            f"new --results-dir.")
        head.load_state_dict(state, strict=True)
    learner.optimizer.load_state_dict(saved["optimizer"])
    if learner.scaler.is_enabled() and saved["scaler"]:
        learner.scaler.load_state_dict(saved["scaler"])
    if saved["rng"] is not None:  # absent when resuming on more processes: draws are keyed by position anyway
        restore_rng(saved["rng"])
    state = saved["state"]
    learner.step = int(state["step"])
    learner.skipped_before, learner.skipped_since = int(state.get("skipped_steps", 0)), None
    run.data_position = int(state.get("data_position", learner.step * run.cfg.global_batch_size))
    run.last_checkpoint = source
