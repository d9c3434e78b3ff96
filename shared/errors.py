"""Error types for bad user input, printed as a single paragraph by every CLI.

`shared/` speaks the domain, not the command line: it raises `ChoiceError` carrying the bad value and the
allowed choices under a domain name ("sampler", "attention", ...). Each stage's `__main__` knows which
flag sets that name and turns the error into flag advice with `advise`.
"""
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


def advise(error: UserError, flags: dict) -> UserError:
    """Turn a domain ChoiceError into flag advice when this stage knows the flag for its kind."""
    if isinstance(error, ChoiceError) and error.kind in flags:
        return error.advise(flags[error.kind])
    return error


def exit_with(error: UserError, prog: str, flags: dict | None = None) -> NoReturn:
    """Print a UserError as one wrapped paragraph on stderr and exit with status 2."""
    text = " ".join(str(advise(error, flags or {})).split())
    print(textwrap.fill(f"{prog}: error: {text}", width=100), file=sys.stderr)
    sys.exit(2)
