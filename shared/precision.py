"""Precision names shared by every CLI (--mixed-precision, --precision, --vae-precision) and their dtypes."""
import torch

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def autocast_dtype(name: str):
    """The autocast dtype for a precision name; None for full precision ("no" or "fp32": autocast off)."""
    return None if name in ("no", "fp32") else PRECISIONS[name]

# Training's --mixed-precision vocabulary ("no" = fp32 weights and math, as Accelerate names it).
MIXED_PRECISIONS = ("no", "fp16", "bf16")
