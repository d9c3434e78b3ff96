"""Hooks to watch a training run from outside the loop (a tracker, a watcher, a test-side launcher).

`train.loop.train(cfg, callbacks=[...])` calls each hook on every process; the loop never branches on
who is listening. A hook that raises stops the run like any other error.
"""
from __future__ import annotations


class Callback:
    """Base class: override the hooks you need; each receives the train.loop.Run."""

    def on_setup(self, run) -> None:
        """After the model, optimizer and EMA exist (and a resume was restored), before the first step."""

    def on_micro_batch(self, run, batch: dict) -> None:
        """Just before a micro-batch's forward; `batch` is the loader's dict (x0, label, drop, t, noise, position)."""

    def on_step_end(self, run, result: dict) -> None:
        """After an optimizer step: result = {loss, grad_norm, skipped} as () device tensors (reading one waits for the
        device); run.step is already advanced."""

    def on_publish(self, run, path) -> None:
        """Main process only: the checkpoint folder `path` was just renamed into place, and its EMA export is not
        written yet (the moment a kill leaves a checkpoint without its export)."""

    def on_checkpoint(self, run, path) -> None:
        """After a checkpoint was published and exported (all processes)."""

    def on_train_end(self, run) -> None:
        """After the last step and its checkpoint."""


class CallbackList(Callback):
    """Calls every registered callback in order."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)

    def _each(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def on_setup(self, run) -> None:
        self._each("on_setup", run)

    def on_micro_batch(self, run, batch: dict) -> None:
        self._each("on_micro_batch", run, batch)

    def on_step_end(self, run, result: dict) -> None:
        self._each("on_step_end", run, result)

    def on_publish(self, run, path) -> None:
        self._each("on_publish", run, path)

    def on_checkpoint(self, run, path) -> None:
        self._each("on_checkpoint", run, path)

    def on_train_end(self, run) -> None:
        self._each("on_train_end", run)
