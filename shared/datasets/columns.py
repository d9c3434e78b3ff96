"""The registry of extra shard columns: one record per column, its producer at extraction and its consumer in training.

A column is a per-sample tensor (F, ...) stored beside the latent in every payload (shared/datasets/shards.py),
computed at extraction when its `plan` returns a record (written to index.json under `meta_key`), and trained on by
a head when its `weight` flag is > 0 (weight x its `loss` added to the objective's). REPA (shared/network/repa.py) is
the first record. A user's module registers another with `register_column` and is named by `--plugin MODULE`;
index.json records it (`plugins`), and train refuses a folder whose module is not imported.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Callable

from shared.runtime.errors import UserError
from shared.runtime.registry import Registry, plugin_module

BUILT_IN_COLUMNS = ("shared.network.repa",)  # imported before the registry is read


@dataclass(frozen=True)
class ShardColumn:
    """One extra column: how extraction makes it and what training does with it."""

    name: str  # the payload tensor, e.g. "repr"
    meta_key: str  # index.json's (and the extraction settings') key of its record, e.g. "repr_encoder"
    what: str  # what it holds, for refusals ("encoder features")
    how: str  # the extract flags that store it ("--repr-encoder facebook/dinov2-base")
    extract_flags: type  # dataclass of its `python -m extract` flags (option(...) fields)
    plan: Callable  # (flags, image_size) -> record {..., "dtype": fp16|bf16|fp32} or None (not stored); no weights
    load: Callable  # (flags, record, device) -> producer: uint8 pixels (B, 3, S, S) -> (B, ...) fp32
    storage: Callable  # (record, frames) -> (bytes per image, the dry run's line with "{size}" for them)
    train_flags: type  # dataclass of its `python -m train` flags
    weight: str  # the train flag whose value > 0 turns its consumer on
    depth: str  # the train flag naming the block (counted from 1) whose output tokens its head sees
    resolve: Callable  # (flags, record, shape (F, ...), model preset, root) -> flags with defaults filled; UserError
    build_head: Callable  # (flags, hidden size D) -> nn.Module on block tokens (N, T, D)
    loss: Callable  # (head output, column batch (N, ...) fp32) -> (N,)
    loss_name: str = ""  # metrics.jsonl key prefix ("repa" -> repa_loss); default the column name
    head_file: str = ""  # the checkpoint file of its head; default "<name>-head.safetensors"
    describe_change: Callable = lambda saved, now: []  # record keys that differ in a way that changes the target

    @property
    def checkpoint_file(self) -> str:
        return self.head_file or f"{self.name}-head.safetensors"

    def extract_options(self, values: dict):
        """Its extract flags' dataclass from {field: value} (missing fields: their defaults)."""
        return self.extract_flags(**{f.name: values[f.name] for f in fields(self.extract_flags) if f.name in values})

    def train_options(self, values: dict):
        """Its train flags' dataclass from {field: value} (missing fields: their defaults)."""
        return self.train_flags(**{f.name: values[f.name] for f in fields(self.train_flags) if f.name in values})


def module_of(record) -> str:
    """The module that defines a record's functions (a column's `plan`, a tokenizer's `encode`)."""
    return (record.plan if isinstance(record, ShardColumn) else record.encode).__module__


COLUMNS: Registry[ShardColumn] = Registry("shard column", module_of, imports=BUILT_IN_COLUMNS)


def register_column(column: ShardColumn) -> ShardColumn:
    """Add a column to the registry (another record under the same name is refused)."""
    return COLUMNS.register(column.name, column)


def columns() -> Registry[ShardColumn]:
    """Every registered column (the built-in ones imported first)."""
    return COLUMNS


def plugin_of(record) -> str:
    """The --plugin module that registers `record`, or "" for one of the package's."""
    return plugin_module(module_of(record))


def flag_values(cls_of, args) -> dict:
    """{field: value} of every registered column's flags of one stage (`cls_of`: record -> flags dataclass)."""
    return {f.name: getattr(args, f.name) for c in columns().values() for f in fields(cls_of(c)) if hasattr(args, f.name)}


def check_plugins(meta: dict, where, prog: str) -> None:
    """Refuse a latent folder whose columns or tokenizer come from a module this process has not imported."""
    missing = [m for m in meta.get("plugins", ()) if m not in sys.modules]
    if missing:
        flags = " ".join(f"--plugin {m}" for m in missing)
        raise UserError(f"the latent folder {where} was extracted with a tokenizer class or shard column that the "
                        f"module {', '.join(missing)} registers (recorded in its index.json under \"plugins\"); "
                        f"pass {flags} to {prog} so it is imported (its folder on PYTHONPATH).")
