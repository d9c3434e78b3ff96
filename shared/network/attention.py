"""Multi-head self-attention with swappable kernels (SDPA, xformers, written-out math) and SDPA's kernel choice."""
import importlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.runtime.errors import ChoiceError, SettingError, UserError

ATTENTION_BACKENDS = ("auto", "sdpa", "xformers", "math")


def _import_xformers_ops():
    """Import xformers.ops or raise a UserError naming the fix."""
    try:
        return importlib.import_module("xformers.ops")
    except Exception as err:  # ImportError, or a broken build raising anything at import time
        raise SettingError(
            f"attention backend 'xformers' was requested but xformers cannot be imported ({err}). "
            "Install the xformers wheel that matches your torch and CUDA build (see "
            "requirements-xformers.txt), or use {attention backend} sdpa, which needs nothing extra."
        ) from err


def resolve_attention(backend):
    """Check an attention backend name and return the concrete one ("auto" means "sdpa")."""
    if backend not in ATTENTION_BACKENDS:
        raise ChoiceError("attention backend", backend, ATTENTION_BACKENDS,
                          "'auto' uses torch's scaled_dot_product_attention")
    if backend == "xformers":
        _import_xformers_ops()
    return "sdpa" if backend == "auto" else backend


# SDPA's fused kernels on CUDA, in the order tried at first use (the fastest first where it runs: cuDNN and flash on
# Ampere and later at head sizes up to 128/256, XL/2's 72 included; the memory-efficient kernel also in fp32 and on
# older GPUs). The math kernel, which materialises the (N, H, T, T) matrix, is the named fallback, never a silent one.
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


def _say(line: str) -> None:
    """One line to stderr (the stages' progress stream)."""
    print(line, file=sys.stderr, flush=True)


def choose_sdpa_kernel(device, dtype, head_dim: int, say=_say) -> str:
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


class Attention(nn.Module):
    """Multi-head self-attention, fused qkv (timm's names); QK-norm and RoPE act on q and k before any kernel runs."""

    def __init__(self, dim, num_heads, qk_norm=None):
        super().__init__()
        if dim % num_heads:
            raise UserError(f"hidden size {dim} is not divisible by {num_heads} heads; pick a width that is.")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.qk_norm = qk_norm is not None
        # nn.Identity has no tensors, so the official block's state dict is unchanged.
        self.q_norm = qk_norm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = qk_norm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=True)
        self.backend = "sdpa"
        self.sdpa_kernel = None  # an SDPBackend name SDPA is restricted to (prepare_attention), or None: torch's choice

    def forward(self, x, rope=None):
        """(N, T, D) -> (N, T, D); rope: a RotaryEmbedding2d for this token grid, or None."""
        n, t, d = x.shape
        qkv = self.qkv(x).reshape(n, t, 3, self.num_heads, self.head_dim)  # (N, T, 3, H, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (N, H, T, d)
        q, k = self._position_and_norm(q, k, v.dtype, rope)
        if self.backend == "xformers":
            out = self._xformers(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (N, T, H, d)
        elif self.backend == "sdpa" and self.sdpa_kernel is not None:
            out = pinned_sdpa(q, k, v, self.sdpa_kernel).transpose(1, 2)  # (N, T, H, d)
        else:
            attend = F.scaled_dot_product_attention if self.backend == "sdpa" else math_attention
            out = attend(q, k, v).transpose(1, 2)  # (N, T, H, d)
        return self.proj(out.reshape(n, t, d))  # (N, T, D)

    def _position_and_norm(self, q, k, dtype, rope):
        """QK-norm then RoPE on (N, H, T, d), as LightningDiT; cast back to v's dtype for the kernels."""
        if not self.qk_norm and rope is None:
            return q, k  # the official block: untouched
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q), rope(k)
        return q.to(dtype), k.to(dtype)

    def _xformers(self, q, k, v):
        """xformers memory-efficient attention on (N, T, H, d); CUDA only, never a silent fallback."""
        if not q.is_cuda:
            raise SettingError(
                f"attention backend 'xformers' needs CUDA tensors but the model runs on {q.device}; "
                "its kernels are not implemented there. Use {attention backend} sdpa (or auto) on this device."
            )
        try:
            return _import_xformers_ops().memory_efficient_attention(q, k, v)  # (N, T, H, d)
        except NotImplementedError as err:
            raise SettingError(
                f"xformers has no kernel for this input ({q.dtype}, head dim {q.shape[-1]}, {q.device}): "
                f"{err}. Use {{attention backend}} sdpa, or install an xformers build for your GPU."
            ) from err


def pinned_sdpa(q, k, v, kernel: str):
    """SDPA on (N, H, T, d) restricted to one kernel (an SDPBackend name): an input it cannot take raises, no fallback."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        return F.scaled_dot_product_attention(q, k, v)  # (N, H, T, d)


def math_attention(q, k, v):
    """softmax(Q K^T / sqrt(d)) V written out (Vaswani et al., 2017, Eq. 1), on (N, H, T, d)."""
    weights = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (N, H, T, T)
    return weights.softmax(dim=-1) @ v  # (N, H, T, d)

