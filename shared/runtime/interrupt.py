"""Ctrl-C at any point of a command, its imports included: one line on stderr, exit status 130, no traceback.

A CLI module calls `guard_imports(__name__)` before its heavy imports (an interrupt there leaves at once: nothing is
written yet) and runs its work inside `interruptible(PROG)`: the first SIGINT unwinds through every `finally`, later
ones are ignored so cleanup is never cut short.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, NoReturn

MESSAGE = "interrupted; what is written is kept; rerun the same command to resume"
EXIT_STATUS = 128 + signal.SIGINT  # 130: what a shell reports for a command ended by Ctrl-C
# Set by a command that runs others (data.demo) and says the line itself: its stages stay silent.
QUIET_ENV = "DIT_INTERRUPT_REPORTED_BY_PARENT"


def say(prog: str) -> None:
    """Print the one line (main process only: under a launcher every rank is interrupted alike)."""
    if os.environ.get(QUIET_ENV) or os.environ.get("RANK", "0") != "0":
        return
    with contextlib.suppress(OSError, ValueError):  # a closed terminal: nothing left to tell, and no traceback about it
        sys.stderr.write(f"{prog}: {MESSAGE}\n")
        sys.stderr.flush()


def _leave_now(signum, frame) -> NoReturn:
    """SIGINT during the imports: nothing is written yet, so leave at once with the line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m <module>` of the running command
    say(f"python -m {spec.name.removesuffix('.__main__') if spec is not None else os.path.basename(sys.argv[0])}")
    os._exit(EXIT_STATUS)


def _raise_once(signum, frame) -> NoReturn:
    """SIGINT during the work: unwind through every `finally`; a second Ctrl-C must not cut that cleanup short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def guard_imports(module: str) -> None:
    """First statement of a CLI module: when it runs as the command, Ctrl-C during its imports leaves cleanly."""
    if module == "__main__" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _leave_now)


@contextlib.contextmanager
def interruptible(prog: str) -> Iterator[None]:
    """Around a command's work: Ctrl-C unwinds (temp files removed), says the line, exits with status 130."""
    # signal handlers can only be set from the main thread (an in-process caller may be another)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _raise_once) if main else None
    try:
        yield
    except KeyboardInterrupt:
        if previous is not None:  # stays ignored while a command exits (a second line would follow otherwise)
            signal.signal(signal.SIGINT, signal.SIG_IGN if previous is _leave_now else previous)
            previous = None
        say(prog)
        raise SystemExit(EXIT_STATUS) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
