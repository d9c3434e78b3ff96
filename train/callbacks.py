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
        """After an optimizer step (run.step advanced): {loss, grad_norm, skipped}: () device tensors (a read syncs)."""

    def on_publish(self, run, path) -> None:
        """Main process only: checkpoint `path` was just renamed into place, its EMA export not yet written."""

    def on_checkpoint(self, run, path) -> None:
        """After a checkpoint was published and exported (all processes)."""

    def on_train_end(self, run) -> None:
        """After the last step and its checkpoint."""


def _on_each(hook: str):
    """A CallbackList method that calls `hook` of every registered callback in order."""
    def call(self, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)
    return call


class CallbackList(Callback):
    """Calls every registered callback in order."""
    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)

    on_setup = _on_each("on_setup")
    on_micro_batch = _on_each("on_micro_batch")
    on_step_end = _on_each("on_step_end")
    on_publish = _on_each("on_publish")
    on_checkpoint = _on_each("on_checkpoint")
    on_train_end = _on_each("on_train_end")
