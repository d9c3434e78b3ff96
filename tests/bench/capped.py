"""Run `python -m MODULE ...` as on a smaller card: the CUDA allocator capped at CAP GiB, and the free memory that
torch.cuda.mem_get_info reports (what `--micro-batch-size auto` plans with) what is left under the cap.

Run: python tests/bench/capped.py 23.3 -m train --latents ... (23.3 GiB: an RTX 3090's usable memory)
"""
import runpy
import sys

import torch

GiB = 2**30


def cap_memory(cap_bytes: int, device: int = 0) -> None:
    """Allocator cap plus a mem_get_info that sees the cap (the card's own free memory when that is smaller)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    real = torch.cuda.mem_get_info

    def capped(device=None):
        free, _ = real(device)
        return min(free, cap_bytes - torch.cuda.memory_reserved(device)), cap_bytes

    torch.cuda.mem_get_info = capped


def main(argv=None):
    """capped.py CAP_GIB -m MODULE [ARGS ...]."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "-m" or not torch.cuda.is_available():
        sys.exit("usage: python tests/bench/capped.py CAP_GIB -m MODULE [ARGS ...] (needs a CUDA GPU)")
    cap_memory(int(float(argv[0]) * GiB))
    print(f"capped.py: CUDA allocator capped at {float(argv[0]):g} GiB", file=sys.stderr, flush=True)
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
