"""Attention backends: the names, xformers' import, and SDPA's fused-kernel choice (the Attention layer: dit.py)."""
import importlib
import sys

import torch
import torch.nn.functional as F

from shared.runtime.errors import ChoiceError, SettingError

ATTENTION_BACKENDS = ("auto", "sdpa", "xformers", "math")


def import_xformers_ops():
    """Import xformers.ops or raise a UserError naming the fix."""
    try:
        return importlib.import_module("xformers.ops")
    except Exception as err:  # ImportError, or a broken build raising anything at import time
        raise SettingError(f"attention backend 'xformers' was requested but xformers cannot be imported ({err}). "
                           "Install the xformers wheel that matches your torch and CUDA build (see "
                           "requirements-xformers.txt), or use {attention backend} sdpa, which needs nothing "
                           "extra.") from err


def resolve_attention(backend):
    """Check an attention backend name and return the concrete one ("auto" means "sdpa")."""
    if backend not in ATTENTION_BACKENDS:
        raise ChoiceError("attention backend", backend, ATTENTION_BACKENDS,
                          "'auto' uses torch's scaled_dot_product_attention")
    if backend == "xformers":
        import_xformers_ops()
    return "sdpa" if backend == "auto" else backend


# SDPA's fused kernels on CUDA, fastest first (cuDNN, flash: Ampere+, head sizes to 128/256; memory-efficient: fp32
# and older GPUs too). The math kernel, materialising (N, H, T, T), is the named fallback, never a silent one.
SDPA_KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
SDPA_FALLBACK = "MATH"
SDPA_NAMES = {"CUDNN_ATTENTION": "cuDNN", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient",
              "MATH": "math"}
_sdpa_choices: dict = {}  # (device, dtype, head size) -> the SDPBackend name chosen there, probed once per process


def probe_sdpa_kernel(kernel: str, device, dtype, head_dim: int) -> bool:
    """Whether SDPA restricted to `kernel` (an SDPBackend name) runs forward and backward at this dtype and head size."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 2, 64, head_dim, device=device, dtype=dtype, requires_grad=True)  # (N, H, T, d)
    try:
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            F.scaled_dot_product_attention(q, q, q).float().sum().backward()
    except RuntimeError:  # "No available kernel": this kernel does not take these inputs on this GPU
        return False
    return True


def choose_sdpa_kernel(device, dtype, head_dim: int, say=lambda line: print(line, file=sys.stderr, flush=True)) -> str:
    """The first of SDPA_KERNELS that runs here (probed once per device, dtype, head size), else SDPA_FALLBACK, said."""
    key = (str(device), dtype, head_dim)
    if key not in _sdpa_choices:
        chosen = next((k for k in SDPA_KERNELS if probe_sdpa_kernel(k, device, dtype, head_dim)), SDPA_FALLBACK)
        _sdpa_choices[key] = chosen
        where = f"head size {head_dim} in {str(dtype).removeprefix('torch.')} on {device_name(device)}"
        if chosen == SDPA_FALLBACK:
            say(f"attention: notice: none of SDPA's fused kernels ({', '.join(SDPA_NAMES[k] for k in SDPA_KERNELS)}) "
                f"runs at {where}; using the math kernel, which is slower and stores the full attention matrix")
        else:
            say(f"attention: SDPA's {SDPA_NAMES[chosen]} kernel at {where}")
    return _sdpa_choices[key]


def device_name(device) -> str:
    """The GPU's name for messages (the device string elsewhere)."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def prepare_attention(model, device, dtype, choose=choose_sdpa_kernel) -> None:
    """On CUDA, pin each sdpa block to the kernel chosen for its head size at `dtype`, before any forward or compile."""
    if torch.device(device).type != "cuda":
        return
    for block in model.blocks:
        if block.attn.backend == "sdpa":
            block.attn.sdpa_kernel = choose(device, dtype, block.attn.head_dim)
