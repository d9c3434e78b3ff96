"""Run `python -m MODULE ...` as on a smaller card: the CUDA allocator capped at CAP GiB, and every CUDA memory query
the code makes answering as that card would.

Patched wherever the name is bound (torch.cuda, torch.cuda.memory, and any module that imported it before the patch):
mem_get_info (free: what is left under the cap; total: the cap; what `--micro-batch-size auto` and train.bench's
changes-gpu plan with), get_device_properties (total_memory: the cap), set_/get_per_process_memory_fraction (a
fraction of the capped card, so train.plan --verify's own cap stays inside this one).

Run: python tests/bench/capped.py 23.3 -m train --latents ... (23.3 GiB: an RTX 3090's usable memory)
"""
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


class CappedProperties:
    """A device's properties with total_memory the cap (every other field the card's own)."""
    def __init__(self, real, cap_bytes: int):
        self._real, self.total_memory = real, min(cap_bytes, real.total_memory)

    def __getattr__(self, name):
        return getattr(self._real, name)


def rebind(original, replacement) -> int:
    """Point every module-level name bound to `original` at `replacement` (also `from torch.cuda import ...`)."""
    count = 0
    for module in list(sys.modules.values()):
        names = [k for k, v in list(getattr(module, "__dict__", {}).items()) if v is original]
        for name in names:
            setattr(module, name, replacement)
        count += len(names)
    return count


def capped_queries(cap_bytes: int, device: int) -> dict:
    """{the real query function: its capped stand-in}."""
    cuda = torch.cuda
    real_free, real_props = cuda.mem_get_info, cuda.get_device_properties
    real_set, real_get = cuda.set_per_process_memory_fraction, getattr(cuda, "get_per_process_memory_fraction", None)
    scale = min(1.0, cap_bytes / real_props(device).total_memory)  # the capped card as a fraction of the real one

    def mem_get_info(device=None):
        free, total = real_free(device)
        return max(0, min(free, cap_bytes - cuda.memory_reserved(device))), min(cap_bytes, total)

    def get_device_properties(device=None):
        return CappedProperties(real_props(device), cap_bytes)

    def set_per_process_memory_fraction(fraction, device=None):
        real_set(fraction * scale, device)

    def get_per_process_memory_fraction(device=None):
        return real_get(device) / scale

    stand_ins = {real_free: mem_get_info, real_props: get_device_properties, real_set: set_per_process_memory_fraction}
    return stand_ins | ({real_get: get_per_process_memory_fraction} if real_get is not None else {})


def cap_memory(cap_bytes: int, device: int = 0) -> None:
    """Allocator cap plus memory queries that see the cap (the card's own free memory when that is smaller)."""
    stand_ins = capped_queries(cap_bytes, device)
    for real, stand_in in stand_ins.items():
        assert rebind(real, stand_in), f"{real.__name__} is bound nowhere: the cap would not reach it"
    torch.cuda.set_per_process_memory_fraction(1.0, device)  # the stand-in: all of the capped card


def main(argv=None):
    """capped.py CAP_GIB -m MODULE [ARGS ...]."""
    argv = sys.argv[1:] if argv is None else argv
    cap = float(argv[0]) if len(argv) >= 3 and argv[1] == "-m" else -1.0
    if cap < 0 or (cap and not torch.cuda.is_available()):
        sys.exit("usage: python tests/bench/capped.py CAP_GIB -m MODULE [ARGS ...] (needs a CUDA GPU; CAP_GIB 0: no "
                 "cap, any machine: gpu_check.sh's dry run)")
    if cap:
        cap_memory(int(cap * GiB))
        print(f"capped.py: CUDA allocator capped at {cap:g} GiB", file=sys.stderr, flush=True)
    sys.path.insert(0, str(ROOT))  # python puts tests/bench first, where MODULE (train, ...) is not
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
