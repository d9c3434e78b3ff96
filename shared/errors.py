"""One error type for bad user input, printed as a single paragraph by every CLI."""
import sys
import textwrap
from typing import NoReturn


class UserError(Exception):
    """A problem the user can fix; the message says what went wrong and how to fix it."""


def exit_with(error: UserError, prog: str) -> NoReturn:
    """Print a UserError as one wrapped paragraph on stderr and exit with status 2."""
    text = " ".join(str(error).split())
    print(textwrap.fill(f"{prog}: error: {text}", width=100), file=sys.stderr)
    sys.exit(2)
