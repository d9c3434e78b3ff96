"""One small type for every registry of the package: records by name, in order, extended by --plugin modules.

A registry maps a name to a record (an objective class, a SamplerSpec, ...); `lookup` raises ChoiceError under its
domain name, which each stage's `__main__` turns into flag advice. Modules in `imports` register the package's own
records, imported before the first read and before another module's record is added.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Callable, Generic, Iterator, TypeVar

from shared.runtime.errors import ChoiceError

R = TypeVar("R")
PACKAGE = "shared"  # modules of the package: what they register needs no --plugin


def plugin_module(module: str) -> str:
    """The --plugin module a record registered by `module` needs ("" for one of the package's)."""
    return "" if module == PACKAGE or module.startswith(f"{PACKAGE}.") else module


class Registry(Mapping, Generic[R]):
    """name -> record in registration order; `owner(record)` names who registered it, `describe(record)` one line."""

    def __init__(self, domain: str, owner: Callable[[R], str], describe: Callable[[R], str] | None = None,
                 imports: tuple[str, ...] = ()):
        self.domain, self.owner, self.describe, self.imports = domain, owner, describe, imports
        self._records: dict = {}

    def register(self, name, record: R, first: bool = False) -> R:
        """Add `record` under `name` (`first`: ahead of the others); TypeError if another owner holds the name."""
        if plugin_module(self.owner(record)):  # a user's record comes after the package's, and meets their names
            self._load()
        old = self._records.get(name)
        if old is not None and self.owner(old) != self.owner(record):
            raise TypeError(f"{self.domain} {name!r} is taken by {self.owner(old)}")
        if first and old is None:
            self._records = {name: record, **self._records}
        else:
            self._records[name] = record
        return record

    def unregister(self, name) -> None:
        """Drop `name` (a test's plugin, after the test)."""
        self._records.pop(name, None)

    def copy(self) -> Registry[R]:
        """Another registry holding the same records (a test registers into it, leaving this one as it was)."""
        other = Registry(self.domain, self.owner, self.describe, self.imports)
        other._records = dict(self._load())
        return other

    def lookup(self, name) -> R:
        """The record of `name`; ChoiceError naming the registered ones (and each one's line) for another."""
        if name in self:
            return self._records[name]
        detail = "; ".join(self.describe(r) for r in self.values()) if self.describe else ""
        raise ChoiceError(self.domain, name, self.names(), detail)

    def names(self) -> tuple:
        """The registered names (the package's, then plugins' in import order)."""
        return tuple(self)

    def _load(self) -> dict:
        """The records, the package's modules in `imports` imported first."""
        for module in self.imports:
            importlib.import_module(module)
        return self._records

    def __getitem__(self, name) -> R:
        return self._load()[name]

    def __iter__(self) -> Iterator:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __repr__(self) -> str:
        return f"Registry({self.domain!r}, {list(self._records)})"
