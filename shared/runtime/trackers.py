"""The experiment trackers a command may report to (--report-to) and the check that the one asked for is there.

Why a check: Accelerate drops a tracker whose package is missing with only a debug message, so a researcher
would find out days later that nothing was recorded. `python -m train` and `python -m sample watch` use it.
"""
from __future__ import annotations

import importlib.util
import sys

from shared.runtime.errors import UserError

REPORT_TO = ("tensorboard", "wandb", "none")
DEFAULT_REPORT_TO = "tensorboard"  # what diffusers' training examples default to, and needs no account


def check_report_to(name: str, written: str, choices=REPORT_TO) -> None:
    """UserError when the tracker asked for is unknown or its package is not installed ("auto" is not checked)."""
    if name not in choices:
        raise UserError(f"--report-to {name!r} is not a tracker this command knows; pass one of: "
                        f"{', '.join(choices)}.")
    if name in ("none", "auto") or importlib.util.find_spec(name) is not None:
        return
    raise UserError(f"--report-to {name} needs the {name} package, which is not installed in this Python "
                    f"environment ({sys.executable}). Install it with `pip install {name}`"
                    f"{' (it is in requirements.txt)' if name == DEFAULT_REPORT_TO else ''}, or pass "
                    f"--report-to none: {written}.")
