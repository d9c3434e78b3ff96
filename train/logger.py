"""Run logging: the step window a log line averages, RUN/log.txt, RUN/metrics.jsonl, the --report-to tracker.

Only the main process writes; the others get a disabled logger, so callers never branch on rank.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from shared.runtime import rundir
from shared.runtime.fsio import atomic_write_text
from train.step import lr_at


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
            with open(rundir.log_path(self.run_dir), "a") as f:
                f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")

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


class Meter:
    """Averages step results over a logging window and measures speed; the results stay on the device until then."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.results: list[dict] = []  # each step's {loss, grad_norm, skipped[, diffusion_loss, *_loss]}: () tensors
        self.start = time.perf_counter()

    def add(self, result: dict) -> None:
        """Record one step's result (device tensors: nothing is read here)."""
        self.results.append(result)

    def window(self) -> dict[str, list[float]]:
        """{name: the window's values} read from the device in one transfer (the log point's host sync)."""
        names = list(self.results[0])
        table = torch.stack([torch.stack([r[n].detach().float() for n in names]) for r in self.results])  # (S, K)
        return dict(zip(names, map(list, zip(*table.cpu().tolist()))))

    def summary(self, run) -> dict:
        """Metrics of the window for a train.loop.Run; resets it."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        window = self.window()
        steps, cfg, learner = len(self.results), run.cfg, run.learner
        values = {
            "loss": float(np.mean(window["loss"])), "lr": lr_at(run.step - 1, cfg),
            "grad_norm": float(np.mean(window["grad_norm"])), "steps_per_s": steps / seconds,
            "images_per_s": steps * cfg.global_batch_size / seconds, "skipped": int(sum(window["skipped"])),
            "skipped_total": learner.skipped_steps, "data_position": run.data_position,
            "epoch": run.data_position / len(run.dataset),
            **{name: float(np.mean(v)) for name, v in window.items() if name.endswith("_loss")},  # each head's
        }
        if learner.scaler.is_enabled():
            values["loss_scale"] = learner.scaler.get_scale()
        if run.device.type == "cuda":
            values["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
        self.reset()
        return values
