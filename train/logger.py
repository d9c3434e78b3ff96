"""Run logging: RUN/log.txt (human lines), RUN/metrics.jsonl (one JSON per log step), TensorBoard if present.

Only the main process writes; the others get a disabled logger, so callers never branch on rank.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from shared import rundir
from shared.fsio import atomic_write_text


def _format(value) -> str:
    """Compact text for one metric value."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class RunLogger:
    """Writes log lines and metrics for the main process; a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool, write_files: bool = True):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.write_files = enabled and write_files
        self._tb = self._open_tensorboard() if self.write_files else None

    def _open_tensorboard(self):
        """A SummaryWriter under RUN/tensorboard when tensorboard is installed, else None."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard is optional; log.txt and metrics.jsonl always exist
            return None
        return SummaryWriter(str(rundir.tracker_dir(self.run_dir)))

    def info(self, message: str) -> None:
        """Print a line (above any progress bar) and append it to log.txt."""
        if not self.enabled:
            return
        tqdm.write(message)
        if self.write_files:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            with open(rundir.log_path(self.run_dir), "a") as f:
                f.write(f"[{stamp}] {message}\n")

    def metrics(self, step: int, values: dict) -> None:
        """Log one step's metrics to every sink."""
        if not self.enabled:
            return
        self.info(f"step {step:07d} " + " ".join(f"{k}={_format(v)}" for k, v in values.items()))
        if not self.write_files:
            return
        with open(rundir.metrics_path(self.run_dir), "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, step)

    def truncate_after(self, step: int) -> None:
        """Drop metrics logged after `step` (a resumed run repeats those steps)."""
        path = rundir.metrics_path(self.run_dir)
        if not self.write_files or not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        atomic_write_text(path, "".join(line + "\n" for line in kept))

    def close(self) -> None:
        """Flush TensorBoard."""
        if self._tb is not None:
            self._tb.close()
