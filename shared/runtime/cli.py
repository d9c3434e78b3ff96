"""What every stage's command line shares: flags declared once on option dataclasses, and the help formatter.

A flag is one field, `lr: float = option(1e-4, "peak learning rate (DiT: 1e-4)")`: `add_flags` derives the argparse
arguments from the fields and `from_args` turns the parsed namespace back into the dataclass.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from shared.runtime.errors import UserError

FLAG_KEY = "flag"  # the field-metadata key that holds a field's Flag


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and ends every flag's help with its default (unless it says it)."""
    def _get_help_string(self, action):
        text = action.help or ""
        # None means "not given": the help text says what happens then, better than "(default: None)".
        if "default" in text.lower() or action.required or action.default in (None, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if isinstance(action.default, (tuple, list)):  # as typed on the command line: "0.9 0.999"
            return f"{text} (default: {' '.join(map(str, action.default))})"
        return f"{text} (default: %(default)s)"


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: default, help and argparse details, stated once; `.field()` is its dataclass field."""
    help: str
    default: Any = dataclasses.MISSING
    aliases: tuple[str, ...] = ()       # other spellings, e.g. the official DiT names ("--global-seed")
    choices: Sequence | Callable | None = None  # a callable is asked when the parser is built (a registry)
    type: Callable | None = None        # argparse type when the annotation does not say it (or says it wrong)
    metavar: Any = None
    nargs: Any = None
    const: Any = None
    name: str | None = None             # the flag when it is not --field-name
    positional: bool = False
    exclusive: str | None = None        # flags sharing this key are mutually exclusive
    action: Any = None                  # an argparse action class, e.g. BooleanOptionalAction for --x/--no-x
    min: float | None = None            # the least value the flag takes (None: unbounded); checked by from_args
    max: float | None = None            # the greatest value the flag takes
    above: float | None = None          # a strict lower bound: the value must exceed it (a probability's 0 < p)
    below: float | None = None          # a strict upper bound: the value must stay under it (p < 1)
    hint: str | None = None             # why the bound, said in its refusal: "250 as the DiT paper; DDIM often uses 50"

    def field(self, **changes) -> Any:
        """A fresh dataclass field for this flag (changes: e.g. another default or help for one command)."""
        spec = dataclasses.replace(self, **changes)
        return dataclasses.field(default=spec.default, metadata={FLAG_KEY: spec})


def option(default: Any = dataclasses.MISSING, help: str = "", **details) -> Any:
    """A dataclass field that is also a flag: `x: int = option(3, "what x does")` (see Flag for details)."""
    return Flag(help, default, **details).field()


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of an options dataclass that are flags: its own first, then those of its flag families."""
    own = cls.__dict__.get("__annotations__", {})
    return sorted((f for f in dataclasses.fields(cls) if FLAG_KEY in f.metadata), key=lambda f: f.name not in own)


def flag_name(field_name: str) -> str:
    """The flag that sets a field ('keep_last' -> '--keep-last')."""
    return "--" + field_name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls, only: Sequence[str] | None = None, skip: Sequence[str] = (),
              changes: dict[str, dict] | None = None) -> argparse.ArgumentParser:
    """Add one argparse argument per flag field of `cls` (or of the fields named in `only`, in that order)."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in flag_fields(cls)}
    groups: dict[str, Any] = {}
    for f in (by_name[n] for n in (by_name if only is None else only) if n not in skip):
        spec: Flag = dataclasses.replace(f.metadata[FLAG_KEY], **(changes or {}).get(f.name, {}))
        if spec.exclusive and spec.exclusive not in groups:
            groups[spec.exclusive] = parser.add_mutually_exclusive_group()
        target = groups[spec.exclusive] if spec.exclusive else parser
        names, kwargs = argument_of(f.name, spec, hints.get(f.name))
        target.add_argument(*names, **kwargs)
    return parser


def given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The field names the command line set explicitly (parses argv again with every default suppressed)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def from_args(cls, args: argparse.Namespace, **extra):
    """The options dataclass holding the parsed flags (lists become tuples where the default is a tuple)."""
    values = {}
    for f in flag_fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if isinstance(f.default, tuple) and isinstance(value, list):
                value = tuple(value)
            check_bounds(f.name, f.metadata[FLAG_KEY], value)
            values[f.name] = value
    return cls(**values, **extra)


def check_bounds(name: str, spec: Flag, value) -> None:
    """Refuse a number outside the option's declared bounds (None, words such as "auto", unbounded flags pass)."""
    tests = ((spec.min, "at least", lambda x, b: x >= b), (spec.max, "at most", lambda x, b: x <= b),
             (spec.above, "above", lambda x, b: x > b), (spec.below, "below", lambda x, b: x < b))
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue  # not given, or a word resolved later ("auto")
        for bound, says, holds in tests:
            if bound is not None and not holds(item, bound):  # written as "not holds" so that NaN is refused too
                why = f" ({spec.hint})" if spec.hint else ""
                raise UserError(f"{spec.name or flag_name(name)} must be {says} {bound:g}{why}; got {item:g}. "
                                f"Pass a value {valid_range(spec)}.")


def check_flag_bounds(options) -> None:
    """check_bounds on every flag field of an options dataclass instance (one built without from_args)."""
    for f in flag_fields(type(options)):
        check_bounds(f.name, f.metadata[FLAG_KEY], getattr(options, f.name))


def valid_range(spec: Flag) -> str:
    """The values a bounded flag takes, as the refusal says them: 'of 1 or more', 'in [0, 1)', 'above 0'."""
    low = (f"[{spec.min:g}" if spec.min is not None else f"({spec.above:g}" if spec.above is not None else None)
    high = (f"{spec.max:g}]" if spec.max is not None else f"{spec.below:g})" if spec.below is not None else None)
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"of {spec.min:g} or more" if spec.min is not None else f"above {spec.above:g}"
    return f"of {spec.max:g} or less" if spec.max is not None else f"below {spec.below:g}"


def argument_of(name: str, spec: Flag, hint) -> tuple[list[str], dict]:
    """(names, add_argument keywords) of one flag field."""
    kwargs: dict[str, Any] = {"help": spec.help}
    for key in ("choices", "metavar", "nargs", "const"):
        if (value := getattr(spec, key)) is not None:
            kwargs[key] = list(value() if callable(value) else value) if key == "choices" else value
    if spec.positional:
        return [name], kwargs
    names = [spec.name or flag_name(name), *spec.aliases]
    kwargs["dest"] = name
    kwargs.update({"required": True} if spec.default is dataclasses.MISSING else {"default": spec.default})
    if spec.action is not None or isinstance(spec.default, bool):
        kwargs["action"] = spec.action or ("store_false" if spec.default else "store_true")
        return names, kwargs
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]  # `X | None` is X
    if (kind := spec.type or (args[0] if len(args) == 1 and args[0] in (int, float, Path) else None)) is not None:
        kwargs["type"] = kind  # the annotation's int, float or Path (str and anything else: none)
    return names, kwargs


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 shard', '0 shards', '3 shards': a count with its noun in the right number (`plural` where +s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
