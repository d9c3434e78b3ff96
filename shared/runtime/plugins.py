"""Code of the user's: `--plugin MODULE` imports a module before a command's parser is built, so what it registers
(objectives, samplers, block options, tokenizer classes, shard columns: docs/objectives.md) exists; a model or latent
folder made with one records the module and asks for it."""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from shared.runtime.cli import Flag, add_flags
from shared.runtime.errors import UserError

PLUGIN = Flag("import MODULE first (a dotted module path, e.g. myproject.objectives), so what it registers can be used: "
              "objectives, samplers, block options, tokenizer classes, shard columns (register_objective, "
              "register_sampler, register_block_option, register_tokenizer, register_column); repeatable "
              "(docs/objectives.md). A model or latent folder made with one records the module and asks for it "
              "(default: none)", None, action="append", metavar="MODULE")


@dataclass(kw_only=True)
class PluginFlags:
    """The --plugin flag alone: read before a command's parser is built (a plugin adds flags and choices)."""

    plugin: list | None = PLUGIN.field()


def load_plugins(argv) -> list[str]:
    """Import the --plugin modules named in `argv` (UserError for one not found); returns their names."""
    modules = add_flags(argparse.ArgumentParser(add_help=False), PluginFlags).parse_known_args(argv)[0].plugin or []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not module.startswith(err.name):  # the module itself imports a missing one
                raise
            raise UserError(f"--plugin {module}: no module of that name can be imported ({err}); pass a dotted "
                            f"module path importable from here (its folder on PYTHONPATH).") from err
    return list(modules)
