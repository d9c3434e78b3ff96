"""Which process this is and how many there are: the one source of rank and world size for extract and sample.

Both stages run as one process or under `accelerate launch` / torchrun; accelerate's PartialState reads
the launcher's environment, so its process_index and num_processes are the rank and world size.
"""
from __future__ import annotations

import torch


def process_state(cpu: bool = False):
    """accelerate's PartialState; CPU-only when asked (`cpu`, ACCELERATE_USE_CPU) or when no GPU exists.

    Why: PartialState only forms a CPU (gloo) process group under torchrun when told cpu=True, which
    `accelerate launch --cpu` says through ACCELERATE_USE_CPU; on a machine without CUDA or MPS we say it too.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not (torch.cuda.is_available() or mps)
    return PartialState(cpu=cpu)
