"""The run folder: every name in it and every lookup, in one place (train writes it, sample reads it).

    RUN/config.json  log.txt  metrics.jsonl  eval.jsonl  eval.png  curves.png  watch.log  tensorboard/{train,previews}
    RUN/eval-samples/step-0000100-<tag>/     images drawn to evaluate an export (kept with --keep-samples)
    RUN/checkpoints/step-0000100/            model, ema, optimizer, scaler, rng-<rank>; state.json written last
    RUN/checkpoints/.tmp-step-0000100/       a checkpoint being assembled (removed on the next start)
    RUN/exports/ema-step-0000100.safetensors slim EMA weights for sampling
    RUN/samples/step-0000100.safetensors     preview latents; step-0000100/ and step-0000100.png decoded
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from shared.runtime.fsio import TMP_PREFIX

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TRACKER_TRAIN = "train"  # RUN/tensorboard/train: the training scalars (one TensorBoard run)
TRACKER_PREVIEWS = "previews"  # RUN/tensorboard/previews: decoded preview grids, written by sample watch
EVAL_FILE = "eval.jsonl"
EVAL_SAMPLES = "eval-samples"
CURVES_FILE = "curves.png"
CHECKPOINTS = "checkpoints"
EXPORTS = "exports"
SAMPLES = "samples"

# Inside a checkpoint folder.
MODEL_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCALER_FILE = "scaler.pt"
PROJECTOR_FILE = "projector.safetensors"  # REPA runs only: the projector (shared/network/repa.py), never exported
STATE_FILE = "state.json"

_STEP = re.compile(r"^step-(\d{7,})$")
_EXPORT = re.compile(r"^ema-step-(\d{7,})\.safetensors$")
_SAMPLE = re.compile(r"^step-(\d{7,})\.safetensors$")


def step_name(step: int) -> str:
    """'step-0000100': the name of what belongs to the state after `step` optimizer steps."""
    return f"step-{int(step):07d}"


def rng_file(rank: int) -> str:
    """The per-process RNG file inside a checkpoint."""
    return f"rng-{int(rank)}.pt"


def config_path(run_dir) -> Path:
    return Path(run_dir) / CONFIG_FILE


def log_path(run_dir) -> Path:
    return Path(run_dir) / "log.txt"


def metrics_path(run_dir) -> Path:
    return Path(run_dir) / METRICS_FILE


def tracker_dir(run_dir) -> Path:
    return Path(run_dir) / "tensorboard"


def tracker_run_dir(run_dir, name: str) -> Path:
    """RUN/tensorboard/<name>: one TensorBoard run (TRACKER_TRAIN or TRACKER_PREVIEWS)."""
    return tracker_dir(run_dir) / name


def eval_path(run_dir) -> Path:
    return Path(run_dir) / EVAL_FILE


def eval_plot_path(run_dir) -> Path:
    return Path(run_dir) / "eval.png"


def eval_samples_dir(run_dir, step: int, tag: str) -> Path:
    """RUN/eval-samples/step-XXXXXXX-<tag>: the images drawn to evaluate the export of `step` with settings `tag`."""
    return Path(run_dir) / EVAL_SAMPLES / f"{step_name(step)}-{tag}"


def curves_path(run_dir) -> Path:
    return Path(run_dir) / CURVES_FILE


def watch_log_path(run_dir) -> Path:
    return Path(run_dir) / "watch.log"


def checkpoints_dir(run_dir) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_path(run_dir, step: int) -> Path:
    """RUN/checkpoints/step-XXXXXXX (complete only when its state.json exists)."""
    return checkpoints_dir(run_dir) / step_name(step)


def staging_path(run_dir, step: int) -> Path:
    """RUN/checkpoints/.tmp-step-XXXXXXX: where the checkpoint of `step` is assembled."""
    return checkpoints_dir(run_dir) / f"{TMP_PREFIX}{step_name(step)}"


def export_path(run_dir, step: int) -> Path:
    """RUN/exports/ema-step-XXXXXXX.safetensors."""
    return Path(run_dir) / EXPORTS / f"ema-{step_name(step)}.safetensors"


def sample_path(run_dir, step: int) -> Path:
    """RUN/samples/step-XXXXXXX.safetensors: preview latents."""
    return Path(run_dir) / SAMPLES / f"{step_name(step)}.safetensors"


def decoded_dir(run_dir, step: int) -> Path:
    """RUN/samples/step-XXXXXXX/: the decoded previews of `step` (one PNG per image + grid.png, as sample decode)."""
    return Path(run_dir) / SAMPLES / step_name(step)


def preview_grid_path(run_dir, step: int) -> Path:
    """RUN/samples/step-XXXXXXX.png: the labelled grid of the previews of `step` (sample watch)."""
    return Path(run_dir) / SAMPLES / f"{step_name(step)}.png"


def is_complete_checkpoint(folder) -> bool:
    """Whether a folder is a published checkpoint (its state.json exists)."""
    return (Path(folder) / STATE_FILE).is_file()


def _by_step(folder: Path, pattern, keep=lambda p: True) -> list[tuple[int, Path]]:
    """(step, path) of the entries of folder whose name matches pattern, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := pattern.match(p.name)) and keep(p))


def step_of(path) -> int | None:
    """The step a run-folder entry belongs to (checkpoint, export or sample), or None."""
    name = Path(path).name
    for pattern in (_STEP, _EXPORT, _SAMPLE):
        if m := pattern.match(name):
            return int(m.group(1))
    return None


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    return [p for _, p in _by_step(checkpoints_dir(run_dir), _STEP, keep=is_complete_checkpoint)]


def latest_checkpoint(run_dir) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    return next(reversed(list_checkpoints(run_dir)), None)


def list_partial(run_dir) -> list[Path]:
    """Leftovers of interrupted writes inside RUN/checkpoints (staging folders, half-deleted ones)."""
    root = checkpoints_dir(run_dir)
    return sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []


def list_exports(run_dir) -> list[Path]:
    """Slim EMA exports of a run, oldest first."""
    return [p for _, p in _by_step(Path(run_dir) / EXPORTS, _EXPORT)]


def list_samples(run_dir) -> list[Path]:
    """Preview latent files of a run, oldest first."""
    return [p for _, p in _by_step(Path(run_dir) / SAMPLES, _SAMPLE)]


def looks_like_run(path) -> bool:
    """Whether a folder is (or is becoming) a training run folder."""
    path = Path(path)
    return path.is_dir() and ((path / CHECKPOINTS).is_dir() or (path / EXPORTS).is_dir()
                              or (path / CONFIG_FILE).is_file())


def read_step_rows(path: Path) -> list[dict]:
    """The JSON objects of a run's .jsonl file that carry a step, by step; a line cut short by a kill is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and not isinstance(row["step"], bool):
            rows.append(row)
    return sorted(rows, key=lambda r: r["step"])
