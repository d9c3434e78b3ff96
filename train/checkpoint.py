"""The run folder's full training state: atomic checkpoints, retention, RNG capture, safe loading.

Layout (docs/ARCHITECTURE.md, "Run directory"):

    RUN/checkpoints/step-0000100/   model.safetensors ema.safetensors (shared/export.py), optimizer.pt,
                                    scaler.pt, rng-<rank>.pt (one per process), state.json (written last)
    RUN/exports/ema-step-0000100.safetensors   the slim EMA export that `python -m sample` reads

A checkpoint is assembled in RUN/checkpoints/.tmp-step-XXXXXXX/ and renamed into place once complete, so
a process killed at any moment leaves either no checkpoint or a whole one; leftovers are removed on the
next start. Every .pt file holds only tensors and plain Python values and is read with
torch.load(weights_only=True): nothing is ever unpickled as an arbitrary object.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from shared.errors import UserError
from shared.export import CHECKPOINTS, STATE_FILE, checkpoint_name, list_checkpoints, load_weights, save_weights

TMP_PREFIX = ".tmp-"


def remove_partial(run_dir: Path) -> list[Path]:
    """Delete half-written checkpoint folders left by a killed run; returns what was removed."""
    root = Path(run_dir) / CHECKPOINTS
    stale = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all); returns the deleted ones."""
    found = list_checkpoints(run_dir)
    doomed = found[:-keep_last] if keep_last > 0 else []
    for path in doomed:
        # Rename first so a kill mid-delete leaves a .tmp- folder (cleaned later), never a damaged step-X.
        tmp = path.with_name(f"{TMP_PREFIX}del-{path.name}")
        os.replace(path, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------------------------------------------------
# RNG state as plain values (loadable with weights_only=True)
# ---------------------------------------------------------------------------------------------------------

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

def _fsync_dir(folder: Path) -> None:
    """fsync a folder's entry list (so a rename inside it survives a power cut)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file in a folder and the folder itself, so the rename publishes durable data."""
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def staging_path(run_dir: Path, step: int) -> Path:
    """The temporary folder the checkpoint of `step` is assembled in."""
    return Path(run_dir) / CHECKPOINTS / f"{TMP_PREFIX}{checkpoint_name(step)}"


def make_staging(tmp: Path) -> Path:
    """Create a fresh staging folder (any leftover from a killed run is removed first)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_rank_state(tmp: Path, rank: int) -> None:
    """Each process writes its own RNG state into the staging folder."""
    torch.save(capture_rng(), tmp / f"rng-{rank}.pt")


def save_main_state(tmp: Path, *, model_state: dict, ema_state: dict, model_config, latent_meta: dict,
                    optimizer_state: dict, scaler_state: dict, state: dict) -> None:
    """Main process: weights via shared/export.py, optimizer and scaler, then state.json last."""
    step = int(state["step"])
    save_weights(tmp / "model.safetensors", model_state, model_config, latent_meta, step)
    save_weights(tmp / "ema.safetensors", ema_state, model_config, latent_meta, step)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(scaler_state, tmp / "scaler.pt")
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def publish(tmp: Path, run_dir: Path, step: int) -> Path:
    """Make a staged checkpoint visible under its final name (atomic rename)."""
    final = Path(run_dir) / CHECKPOINTS / checkpoint_name(step)
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again (e.g. a rerun of a finished run): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------

def _load_pt(path: Path) -> dict:
    """torch.load with weights_only=True (tensors and plain values only) on the CPU; UserError if unreadable."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete. Delete that "
                        "checkpoint folder to resume from the previous one.") from err
    except Exception as err:  # a truncated or foreign file: say which one
        raise UserError(f"cannot read checkpoint file {path} ({err}); delete that checkpoint folder to resume "
                        "from the previous one.") from err


def read_state(ckpt: Path) -> dict:
    """state.json of a checkpoint folder; UserError if it is not one."""
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise UserError(f"{ckpt} is not a checkpoint folder (no {STATE_FILE}); pass --resume auto, none, or a "
                        "RUN/checkpoints/step-XXXXXXX folder.")
    return json.loads(path.read_text())


def load_checkpoint(ckpt: Path, rank: int) -> dict:
    """Everything a checkpoint holds, on the CPU: weights, optimizer, scaler, this rank's RNG, state."""
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    model_state, _, _, _ = load_weights(ckpt / "model.safetensors")
    ema_state, _, _, _ = load_weights(ckpt / "ema.safetensors")
    rng_path = ckpt / f"rng-{rank}.pt"
    return {
        "state": state,
        "model": model_state,
        "ema": ema_state,
        "optimizer": _load_pt(ckpt / "optimizer.pt"),
        "scaler": _load_pt(ckpt / "scaler.pt"),
        "rng": _load_pt(rng_path) if rng_path.is_file() else None,  # absent when resuming on more processes
    }
