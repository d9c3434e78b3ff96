"""What watches a run from the training side: the --report-to tracker, curves at checkpoints, the preview watcher.

The tracker is Accelerate's (TensorBoard in RUN/tensorboard/train/, or wandb). The watcher (--watch-vae) is a
separate CPU process, `python -m sample watch`: the VAE (and diffusers) never enter the training process or its GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shared.runtime import rundir
from shared.runtime.errors import UserError
from shared.runtime.trackers import check_report_to
from train.callbacks import Callback

WANDB_PROJECT = "dit"  # wandb project when WANDB_PROJECT is not set; the wandb run is named after RUN
WATCH_THREADS = 2  # CPU threads of the watcher: decoding a preview must not starve the data loaders
WATCH_INTERVAL_S = 2  # seconds between the watcher's looks for new previews (a folder listing: nothing)
WATCH_GRACE_S = 120  # at the end, wait this long for the watcher to decode the last previews
ROOT = Path(__file__).resolve().parents[1]  # the repository: the watcher runs as `python -m sample` from here


def tracking(cfg) -> bool:
    """Whether this launch reports to a tracker (--debug and --dry-run write nothing)."""
    return cfg.report_to != "none" and not (cfg.debug or cfg.dry_run)


def accelerator_kwargs(cfg) -> dict:
    """Arguments for `Accelerator(...)` that set up --report-to (after checking its package is installed)."""
    check_report_to(cfg.report_to, "log.txt and metrics.jsonl are written either way, and `python -m train.plot "
                                    "RUN` draws their curves")
    if not tracking(cfg):
        return {}
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(cfg.results_dir),
                                   logging_dir=str(rundir.tracker_dir(cfg.results_dir)))
    return {"log_with": cfg.report_to, "project_config": project}


class Tracker:
    """The started trackers of the main process: scalars under train/, closed at the end."""
    def __init__(self, accelerator):
        self.accelerator = accelerator

    @classmethod
    def start(cls, accelerator, cfg, step: int) -> "Tracker":
        """init_trackers for --report-to; on resume TensorBoard hides what a killed launch logged after `step`."""
        run_dir = Path(cfg.results_dir)
        if cfg.report_to == "wandb":
            project = os.environ.get("WANDB_PROJECT", WANDB_PROJECT)
            kwargs = {"wandb": {"dir": str(run_dir), "name": run_dir.name}}
            # the flat scalar dict trackers accept: lists and dicts as JSON text
            flat = {k: v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)
                    for k, v in cfg.to_dict().items()}
            accelerator.init_trackers(project, config=flat, init_kwargs=kwargs)
        else:
            # No config here: torch's add_hparams makes one extra TensorBoard run per launch; config.json has it.
            kwargs = {"tensorboard": {"purge_step": step + 1}} if step > 0 else {}
            accelerator.init_trackers(rundir.TRACKER_TRAIN, init_kwargs=kwargs)
        return cls(accelerator)

    def log(self, step: int, values: dict) -> None:
        """Numeric metrics as train/<name> scalars at `step`."""
        scalars = {f"train/{k}": float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.accelerator.log(scalars, step=step)

    def close(self) -> None:
        """Finish every tracker (not accelerator.end_training: that also tears down the process group)."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers.clear()


class TrackerCallback(Callback):
    """Starts the tracker once the run is restored and attaches it to the run's logger."""
    def on_setup(self, run) -> None:
        if run.is_main and tracking(run.cfg):
            run.logger.attach(Tracker.start(run.accelerator, run.cfg, run.step))


class CurvesCallback(Callback):
    """Redraws RUN/curves.png after each checkpoint (main process); a failure is logged, never raised."""
    def on_checkpoint(self, run, path) -> None:
        if not run.is_main or run.cfg.debug:
            return
        start = time.perf_counter()
        try:
            from train.plot import plot_run

            out = plot_run(run.run_dir)
        except Exception as err:  # noqa: BLE001 - a picture must never end days of training; say why instead
            run.logger.info(f"could not draw {rundir.CURVES_FILE} ({type(err).__name__}: {err}); training goes "
                            "on, and `python -m train.plot RUN` draws it later")
            return
        run.logger.info(f"drew {out} ({time.perf_counter() - start:.2f} s)")


def check_watch(cfg, dataset) -> None:
    """--watch-vae needs previews and a VAE that can decode these latents (config.json only: no diffusers)."""
    if not cfg.watch_vae:
        return
    if cfg.sample_every == 0:
        raise UserError("--watch-vae decodes the --sample-every previews, but --sample-every is 0 (no previews); "
                        "pass --sample-every N, or drop --watch-vae.")
    dataset.space.check_tokenizer_config(cfg.watch_vae, None, measure=False)


class WatcherCallback(Callback):
    """--watch-vae: the `python -m sample watch` process beside training (main process only)."""
    def __init__(self, vae: str):
        self.vae, self.proc, self.reported = vae, None, False

    def on_setup(self, run) -> None:
        """Start it on the CPU, output appended to RUN/watch.log, ending after the last checkpoint or with us."""
        if not run.is_main or run.cfg.debug:
            return
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # the VAE must never take the training GPU's memory
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        local = Path(self.vae).expanduser()  # an existing local VAE path made absolute (the watcher runs from ROOT)
        # Not --exit-when-done: that waits for the run folder's lock, which this process holds until the watcher ends.
        command = [sys.executable, "-m", "sample", "watch", str(Path(run.run_dir).resolve()), "--vae",
                   str(local.resolve()) if local.exists() else self.vae, "--cpu", "--threads", str(WATCH_THREADS),
                   "--interval", str(WATCH_INTERVAL_S), "--until-step", str(run.cfg.total_steps),
                   "--until-pid", str(os.getpid())]
        with open(rundir.watch_log_path(run.run_dir), "a") as log:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        run.logger.info(f"started the preview watcher (PID {self.proc.pid}): grids appear as "
                        f"{rundir.SAMPLES}/step-XXXXXXX.png, its output in {rundir.watch_log_path(run.run_dir)}")

    def on_step_end(self, run, result: dict) -> None:
        if self.proc is not None and not self.reported and self.proc.poll() is not None:
            self._report(run)  # poll() is a non-blocking waitpid: nothing measurable per step

    def on_train_end(self, run) -> None:
        if self.proc is None or self.reported:
            return
        try:
            self.proc.wait(timeout=WATCH_GRACE_S)
        except subprocess.TimeoutExpired:
            run.logger.info(f"the preview watcher (PID {self.proc.pid}) is still decoding; it stops by itself "
                            f"when done (see {rundir.watch_log_path(run.run_dir)})")
            return
        self._report(run)

    def _report(self, run) -> None:
        """Say how the watcher ended; a failure names its last words (training itself goes on)."""
        self.reported = True
        code = self.proc.returncode
        if code == 0:
            run.logger.info(f"the preview watcher finished: grids in {run.run_dir / rundir.SAMPLES}")
            return
        try:  # the last lines of RUN/watch.log: what the watcher said before it stopped
            text = rundir.watch_log_path(run.run_dir).read_text(errors="replace")
        except OSError:
            text = ""
        words = " | ".join(line.strip() for line in text.splitlines()[-3:] if line.strip())
        run.logger.info(f"the preview watcher stopped with exit status {code}; no more grids are decoded during "
                        f"this run. Its last words: {words}. Training goes on; decode later "
                        f"with `python -m sample watch {run.run_dir} --vae {self.vae} --exit-when-done`.")


def default_callbacks(cfg) -> list[Callback]:
    """The product's own watchers of a run, registered before any caller's callbacks."""
    return [TrackerCallback(), CurvesCallback(), *([WatcherCallback(cfg.watch_vae)] if cfg.watch_vae else [])]
