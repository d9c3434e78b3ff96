"""Which process this is and how many there are: the one source of rank and world size for extract and sample.

Both stages run as one process or under `accelerate launch` / torchrun; accelerate's PartialState reads
the launcher's environment, so its process_index and num_processes are the rank and world size.
"""
from __future__ import annotations

import torch


def process_state(cpu: bool = False):
    """accelerate's PartialState; CPU-only when asked (`cpu`, ACCELERATE_USE_CPU) or when no GPU exists."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not (torch.cuda.is_available() or mps)
    return PartialState(cpu=cpu)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS says it, else the machine's count)."""
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_workers(cap: int, num_processes: int = 1) -> int:
    """DataLoader workers per process: up to `cap`, one core per process left for its main loop."""
    return max(0, min(cap, usable_cores() // max(1, num_processes) - 1))
