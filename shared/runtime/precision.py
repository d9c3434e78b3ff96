"""Precision names shared by every CLI (--precision, --vae-precision) and their dtypes."""
import torch

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def autocast_dtype(name: str):
    """The autocast dtype for a precision name; None for full precision ("fp32": autocast off)."""
    return None if canonical_precision(name) == "fp32" else PRECISIONS[name]


# REPA's and fast-DiT's spelling (`--mixed-precision no`, Accelerate's name for fp32), so their commands carry over.
PRECISION_ALIASES = {"no": "fp32"}
PRECISION_CHOICES = (*PRECISIONS, *PRECISION_ALIASES)  # what the flags accept


def set_tf32(device, allowed: bool = True) -> None:
    """TF32 matmuls and convolutions on Ampere+ GPUs, as DiT's release enables (its issue #22: 0.51 -> 0.81 steps/s)."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allowed
        torch.backends.cudnn.allow_tf32 = allowed


def canonical_precision(name: str) -> str:
    """'no' -> 'fp32'; every other name as is."""
    return PRECISION_ALIASES.get(name, name)
