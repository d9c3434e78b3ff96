"""`python -m sample watch RUN`: decode training's preview latents into labelled grids as they appear.

Runs beside training in its own process, so the VAE never enters training: each new RUN/samples/step-X.safetensors
is decoded by `sample decode`'s decode_file, then a labelled grid RUN/samples/step-X.png is written (and logged to
TensorBoard). Stops after the file in hand on SIGINT/SIGTERM, or per --exit-when-done, --until-step, --until-pid.
"""
from __future__ import annotations

import importlib.util
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.runtime import rundir
from shared.runtime.cli import option
from shared.runtime.distributed import process_state
from shared.runtime.errors import UserError
from shared.runtime.precision import PRECISIONS
from shared.sampling.flags import DecodeFlags
from shared.runtime.lock import LOCK_NAME, FolderBusyError, hold_lock, pid_alive
from shared.sampling.previews import read_preview
from shared.runtime.trackers import check_report_to
from shared.tokenizers.locate import load_tokenizer, read_vae_config
from shared.tokenizers.space import LatentSpace, choose_tokenizer

from sample.decode import decode_file
from shared.sampling.generate import captions_for, labelled_grid, save_png

REPORT_TO = ("auto", "tensorboard", "none")


@dataclass
class WatchOptions(DecodeFlags):
    """Everything `python -m sample watch` accepts (one field per flag: its default and help; the VAE flags too)."""
    run: str = option(help="the training run folder (train's --results-dir)", positional=True, metavar="RUN")
    interval: float = option(5.0, "seconds between looks for new preview files", above=0, below=math.inf)
    exit_when_done: bool = option(False, "stop once no training process holds RUN (finished, stopped or killed), "
                                         "after decoding every preview; without it, run until Ctrl-C or SIGTERM")
    until_step: int | None = option(None, "stop once the checkpoint of STEP exists, after decoding every preview "
                                          "(train --watch-vae passes its last step)", metavar="STEP", min=0)
    until_pid: int | None = option(None, "stop once process PID has ended, after decoding every preview (train "
                                         "--watch-vae passes its own PID)", metavar="PID")
    report_to: str = option("auto", "log each grid as a TensorBoard image under RUN/tensorboard/previews: auto = when "
                                    "the run was launched with --report-to tensorboard", choices=REPORT_TO)
    threads: int | None = option(None, "CPU threads for decoding (default: torch's choice)", min=1)
    batch_size: int = option(16, "latents decoded per VAE call", min=1)


class StopFlag:
    """Set by SIGINT/SIGTERM: the watcher finishes the file in hand, then leaves (a second signal leaves now)."""
    def __init__(self):
        self.requested, self._previous = False, {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # leave now: the one interrupt line and status 130 (shared/runtime/interrupt.py)
            raise SystemExit(128 + signum)
        self.requested = True
        print(f"{signal.Signals(signum).name}: stopping after the file in hand (again to stop now)", flush=True)

    def sleep(self, seconds: float) -> None:
        """Sleep in short slices so a signal ends the wait at once."""
        end = time.monotonic() + seconds
        while not self.requested and time.monotonic() < end:
            time.sleep(min(0.2, max(end - time.monotonic(), 0)))


def run_is_locked(run: Path) -> bool:
    """Whether a live training process holds RUN/.lock (shared/runtime/lock.py's flock; freed by the OS when it dies)."""
    path = run / LOCK_NAME
    if not path.is_file():
        return False
    try:
        import fcntl
    except ImportError:  # Windows: no flock to probe; the run counts as ended once its final checkpoint exists
        return False
    with open(path, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return False


def end_reason(run: Path, o: WatchOptions) -> str | None:
    """Why the watching should end after this round of decoding, or None to go on."""
    if o.until_pid is not None and not pid_alive(o.until_pid):
        return f"process {o.until_pid} has ended"
    if o.until_step is not None:
        latest = rundir.latest_checkpoint(run)
        if latest is not None and rundir.step_of(latest) >= o.until_step:
            return f"the checkpoint of step {o.until_step} exists"
    if o.exit_when_done and not run_is_locked(run):
        return "no training process holds the run folder"
    return None


def pending(run: Path) -> list[tuple[int, Path]]:
    """(step, latents file) of every preview whose labelled grid is missing or older than it, oldest first."""
    found = []
    for path in rundir.list_samples(run):
        step = rundir.step_of(path)
        grid = rundir.preview_grid_path(run, step)
        try:
            if not grid.exists() or grid.stat().st_mtime_ns < path.stat().st_mtime_ns:
                found.append((step, path))
        except FileNotFoundError:  # removed while we looked: nothing to decode
            continue
    return found


class PreviewTracker:
    """Writes each labelled grid as image 'previews' into RUN/tensorboard/previews/ (a separate writer)."""
    def __init__(self, run: Path, mode: str):
        self.run, self.mode, self.writer, self.said = run, mode, None, False

    def _active(self) -> bool:
        """Whether to write: --report-to tensorboard, or auto and the run's config says tensorboard."""
        wanted = self.mode
        if wanted == "auto":  # the --report-to the run was launched with (RUN/config.json)
            try:
                wanted = json.loads(rundir.config_path(self.run).read_text()).get("report_to") or "none"
            except (OSError, ValueError):
                wanted = "none"
        if wanted == "tensorboard" and importlib.util.find_spec("tensorboard") is not None:
            return True
        if wanted in ("wandb", "tensorboard") and not self.said:  # said once: wandb, or tensorboard not installed
            self.said = True
            print("note: the run reports to wandb; the watcher logs no images there (a second process would open a "
                  f"second wandb run): the grids are in {self.run / rundir.SAMPLES}" if wanted == "wandb" else
                  "note: the run reports to tensorboard, but tensorboard is not installed here (pip install "
                  "tensorboard): the grids are written, not logged", flush=True)
        return False

    def log(self, step: int, grid: np.ndarray) -> None:
        """Add the grid at `step` (HWC uint8) and flush, so TensorBoard shows it at once."""
        if not self._active():
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(rundir.tracker_run_dir(self.run, rundir.TRACKER_PREVIEWS)))
        self.writer.add_image("previews", grid, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Decoder:
    """The VAE, loaded when the first preview arrives (checked against every file's latent metadata)."""
    def __init__(self, o: WatchOptions):
        self.o, self.vae, self.name, self.how = o, None, None, None

    def decode(self, run: Path, step: int, path: Path, tracker: PreviewTracker) -> Path:
        """`sample decode` of one preview into RUN/samples/step-X/, then its labelled grid: written last, logged."""
        start = time.perf_counter()
        latents, labels, space = data = read_preview(path)
        spec, how = choose_tokenizer(self.o.vae, space)
        space = LatentSpace.or_unknown(space, latents.shape[1])
        name, _ = space.check_tokenizer_config(spec, self.o.vae_config, self.o.allow_other_vae)
        if self.vae is None or name != self.name:
            self.vae = load_tokenizer(name, process_state(self.o.cpu).device, PRECISIONS[self.o.vae_precision],
                                      self.o.vae_config, self.o.vae_tiling, self.o.vae_slicing)
            self.name, self.how = name, how
        _, images = decode_file(self.vae, name, self.how, data, path, rundir.decoded_dir(run, step), self.o)
        grid = labelled_grid(lambda i: images[i], labels.tolist(), captions_for(labels.tolist(), space.class_names),
                             f"{run.name} · step {step:,}")
        out = rundir.preview_grid_path(run, step)
        save_png(out, grid)  # last, atomic: its presence marks the step done; a half-written one would count
        tracker.log(step, grid)
        print(f"step {step}: {out} ({time.perf_counter() - start:.1f} s)", flush=True)
        return out


def run_watch(o: WatchOptions) -> list[Path]:
    """Decode previews as they appear until told to stop; returns the labelled grids written."""
    run = Path(o.run).expanduser()  # the cheap checks of every flag first, before any waiting
    if not run.is_dir():
        raise UserError(f"RUN {run} is not a folder; pass the --results-dir of a training run (it may still be "
                        "starting: the folder exists from the first second of a launch).")
    if o.vae:
        read_vae_config(o.vae, o.vae_config)  # a bad --vae is said now, not when the first preview arrives
    check_report_to(o.report_to, "the grids are written either way", REPORT_TO)  # auto only notes an absence
    if o.threads:
        torch.set_num_threads(o.threads)
    while True:  # RUN/samples/.lock, or FolderBusyError naming the other watcher
        try:
            lock = hold_lock(run / rundir.SAMPLES, "preview folder")
            break
        except FolderBusyError as err:
            if o.until_pid is None or end_reason(run, o):
                raise
            print(f"waiting: {err}", flush=True)
            time.sleep(o.interval)
    decoder, tracker, written = Decoder(o), PreviewTracker(run, o.report_to), []
    try:
        with StopFlag() as stop:  # before the first line: whoever reads it may signal at once
            if not (rundir.looks_like_run(run) or (run / rundir.SAMPLES).is_dir()):
                print(f"note: {run} holds no training run yet (no {rundir.CONFIG_FILE}, checkpoints or samples)")
            print(f"watching {run / rundir.SAMPLES} for preview latents every {o.interval:g} s (Ctrl-C stops)",
                  flush=True)
            while True:
                reason = end_reason(run, o)  # before listing: previews written before the end are still decoded
                for step, path in pending(run):
                    if stop.requested:
                        break
                    written.append(decoder.decode(run, step, path, tracker))
                if stop.requested or reason:
                    break
                stop.sleep(o.interval)
        print(f"stopped ({reason or 'asked to'}): {len(written)} grid(s) written this time", flush=True)
    finally:
        tracker.close()
        lock.release()
    return written

