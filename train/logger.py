"""Run logging: RUN/log.txt (human lines), RUN/metrics.jsonl (one JSON per log step), and the --report-to tracker.

Only the main process writes; the others get a disabled logger, so callers never branch on rank.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from shared.runtime import rundir
from shared.runtime.fsio import atomic_write_text


class RunLogger:
    """Writes log lines and metrics for the main process; a no-op elsewhere."""
    def __init__(self, run_dir: Path, enabled: bool, write_files: bool = True):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.write_files = enabled and write_files
        self.tracker = None  # a train.trackers.Tracker once attached (main process, files written)

    def attach(self, tracker) -> None:
        """Send every later metrics() call to `tracker` as well (anything with log(step, values) and close())."""
        if self.write_files:
            self.tracker = tracker

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
        self.info(f"step {step:07d} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in values.items()))
        if not self.write_files:
            return
        with open(rundir.metrics_path(self.run_dir), "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.tracker is not None:
            self.tracker.log(step, values)

    def truncate_after(self, step: int) -> None:
        """Drop metrics logged after `step` (a resumed run repeats those steps)."""
        path = rundir.metrics_path(self.run_dir)
        if not self.write_files or not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        atomic_write_text(path, "".join(line + "\n" for line in kept))

    def close(self) -> None:
        """Flush and close the tracker (its event files are complete afterwards)."""
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
