"""Error types for bad user input, printed as a single paragraph by every CLI.

`shared/` speaks the domain, not the command line: it raises `ChoiceError` carrying the bad value and the
allowed choices under a domain name ("sampler", "attention", ...). Each stage's `__main__` knows which
flag sets that name and turns the error into flag advice with `advise`.
"""
import re
import sys
import textwrap
from typing import NoReturn


class UserError(Exception):
    """A problem the user can fix; the message says what went wrong and how to fix it."""


class ChoiceError(UserError):
    """A value outside a known vocabulary: carries the domain name, the bad value and the allowed choices."""

    def __init__(self, kind: str, value, choices, detail: str = ""):
        self.kind, self.value, self.choices, self.detail = kind, value, list(choices), detail
        allowed = ", ".join(str(c) for c in self.choices)
        super().__init__(f"unknown {kind} {value!r}{f' ({detail})' if detail else ''}; choose one of: {allowed}.")

    def advise(self, flag: str) -> UserError:
        """The same error phrased for the flag that set the value."""
        allowed = ", ".join(str(c) for c in self.choices)
        extra = f" ({self.detail})" if self.detail else ""
        return UserError(f"{flag} {self.value!r} is not a valid {self.kind}{extra}; pass {flag} with one of: "
                         f"{allowed}.")


class SettingError(UserError):
    """A problem whose text names settings by their domain kind, written as `{kind}` fields.

    str(err) writes each field as the kind itself ("use {cfg scale} 1" reads "use cfg scale 1"); `advise`
    writes the flag of every kind a stage knows instead ("use --cfg-scale 1").
    """

    _FIELD = re.compile(r"\{([a-z][a-z -]*)\}")

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.phrase({}))

    def phrase(self, flags: dict) -> str:
        """The text with each {kind} replaced by flags[kind], or by the kind where no flag is known."""
        return self._FIELD.sub(lambda m: flags.get(m.group(1), m.group(1)), self.template)


def advise(error: UserError, flags: dict) -> UserError:
    """Turn a domain ChoiceError or SettingError into flag advice for the kinds this stage has flags for."""
    if isinstance(error, ChoiceError) and error.kind in flags:
        return error.advise(flags[error.kind])
    if isinstance(error, SettingError):
        return UserError(error.phrase(flags))
    return error


def exit_with(error: UserError, prog: str, flags: dict | None = None) -> NoReturn:
    """Print a UserError as one wrapped paragraph on stderr and exit with status 2."""
    text = " ".join(str(advise(error, flags or {})).split())
    print(textwrap.fill(f"{prog}: error: {text}", width=100), file=sys.stderr)
    sys.exit(2)
