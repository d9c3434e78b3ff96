"""The run folder's full training state: atomic checkpoints, retention, RNG capture, safe loading.

Names and lookups come from shared/runtime/rundir.py (the run folder's one owner); durability from shared/runtime/fsio.py.
A checkpoint is assembled in RUN/checkpoints/.tmp-step-XXXXXXX/ and published by one rename once
complete, so a process killed at any moment leaves either no checkpoint or a whole one; leftovers are
removed on the next start. Every .pt file holds only tensors and plain Python values and is read with
torch.load(weights_only=True): nothing is ever unpickled as an arbitrary object.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from shared.runtime import rundir
from shared.runtime.errors import UserError
from shared.runtime.export import load_weights, read_config, save_weights, write_safetensors
from shared.runtime.fsio import atomic_write_json, publish_dir, remove_tree


def remove_partial(run_dir: Path) -> list[Path]:
    """Delete half-written checkpoint folders left by a killed run; returns what was removed."""
    stale = rundir.list_partial(run_dir)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all); returns the deleted ones."""
    found = rundir.list_checkpoints(run_dir)
    doomed = found[:-keep_last] if keep_last > 0 else []
    for path in doomed:
        remove_tree(path)  # renamed first: a kill mid-delete leaves a .tmp- folder, never a damaged step-X
    return doomed


# ---------------------------------------------------------------------------------------------------------
# RNG state as plain values (loadable with weights_only=True)
# ---------------------------------------------------------------------------------------------------------

def prune_exports(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` slim EMA exports (0 keeps all); returns the deleted ones."""
    found = rundir.list_exports(run_dir)
    doomed = found[:-keep] if keep > 0 else []
    for path in doomed:
        path.unlink(missing_ok=True)  # one file: its deletion is atomic
    return doomed


def capture_rng() -> dict:
    """Python, numpy, torch CPU and CUDA generator states as tensors and plain values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
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


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------

def make_staging(run_dir: Path, step: int) -> Path:
    """A fresh staging folder for the checkpoint of `step` (any leftover from a killed run is removed first)."""
    tmp = rundir.staging_path(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def discard_staging(tmp: Path) -> None:
    """Drop a staging folder whose checkpoint could not be finished (e.g. the disk filled up)."""
    shutil.rmtree(tmp, ignore_errors=True)


def save_rank_state(tmp: Path, rank: int) -> None:
    """Each process writes its own RNG state into the staging folder."""
    torch.save(capture_rng(), tmp / rundir.rng_file(rank))


def save_main_state(tmp: Path, *, model_state: dict, ema_state: dict, model_config, space,
                    optimizer_state: dict, scaler_state: dict, state: dict, heads: dict | None = None) -> None:
    """Main process: weights via shared/runtime/export.py, optimizer, scaler, {file: state} of the column heads (REPA's
    projector), then state.json last."""
    step = int(state["step"])
    for name, head in (heads or {}).items():
        write_safetensors(tmp / name, {k: v.detach().cpu().contiguous() for k, v in head.items()})
    save_weights(tmp / rundir.MODEL_FILE, model_state, model_config, space, step)
    save_weights(tmp / rundir.EMA_FILE, ema_state, model_config, space, step)
    torch.save(optimizer_state, tmp / rundir.OPTIMIZER_FILE)
    torch.save(scaler_state, tmp / rundir.SCALER_FILE)
    atomic_write_json(tmp / rundir.STATE_FILE, state, indent=2)


def publish(tmp: Path, run_dir: Path, step: int) -> Path:
    """Make a staged checkpoint visible under its final name (fsync, then one atomic rename)."""
    return publish_dir(tmp, rundir.checkpoint_path(run_dir, step))


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------

def _load_pt(path: Path) -> dict:
    """torch.load with weights_only=True (tensors and plain values only) on the CPU; UserError if unreadable."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise UserError(f"its file {path.name} is missing.") from err
    except Exception as err:  # a truncated or foreign file: say which one (torch's text is one line here)
        raise UserError(f"its file {path.name} is unreadable ({str(err).splitlines()[0][:200]}).") from err


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


def checkpoint_config(ckpt: Path):
    """The ModelConfig a checkpoint's model file records (header only); an unreadable file names the one to delete."""
    try:
        return read_config(Path(ckpt) / rundir.MODEL_FILE)
    except UserError as err:
        raise UserError(f"the checkpoint {ckpt} cannot be resumed: {err} {damaged_advice(ckpt)}") from None


def load_checkpoint(ckpt: Path, rank: int) -> dict:
    """Everything a checkpoint holds, on the CPU; an unreadable file names the checkpoint to delete."""
    try:
        return _load_checkpoint(Path(ckpt), rank)
    except UserError as err:
        raise UserError(f"the checkpoint {ckpt} cannot be resumed: {err} {damaged_advice(ckpt)}") from None


def _load_checkpoint(ckpt: Path, rank: int) -> dict:
    """Everything a checkpoint holds, on the CPU: weights, optimizer, scaler, this rank's RNG, state."""
    state = read_state(ckpt)
    model_state, _, _, _ = load_weights(ckpt / rundir.MODEL_FILE)  # the space: config.json holds its hash
    ema_state, _, _, _ = load_weights(ckpt / rundir.EMA_FILE)
    rng_path = ckpt / rundir.rng_file(rank)
    return {
        "state": state,
        "model": model_state,
        "ema": ema_state,
        "optimizer": _load_pt(ckpt / rundir.OPTIMIZER_FILE),
        "scaler": _load_pt(ckpt / rundir.SCALER_FILE),
        "rng": _load_pt(rng_path) if rng_path.is_file() else None,  # absent when resuming on more processes
    }


def load_head(path: Path) -> dict | None:
    """A column head's weights (REPA's projector), or None when the run has none; UserError if unreadable."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as err:  # a truncated file
        raise UserError(f"its file {path.name} is unreadable ({str(err).splitlines()[0][:200]}).") from err
