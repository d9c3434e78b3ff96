"""What `accelerate launch` (or `accelerate config`) asked for, read before any Accelerator or file exists.

`accelerate launch` passes its config through environment variables (accelerate/utils/launch.py). The trainer applies
precision itself (train/step.py) and builds `Accelerator(mixed_precision="no")`, which would silently override a
launcher's bf16: so the launcher's precision becomes the run's (--precision auto) or, contradicting an explicit
--precision, stops the launch. Sharded strategies are refused: checkpoints, EMA and the cross-rank consistency check
assume every process holds the whole model (DDP).
"""
from __future__ import annotations

import os

from shared.runtime.errors import UserError

# Environment flags of the sharded / model-parallel strategies, with the name a user sees in `accelerate config`.
SHARDED = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
           "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM"}


def launcher_precision() -> str | None:
    """The precision the accelerate config asks for (our name), or None when it asks for none."""
    # "no" counts as none: `accelerate launch` writes it whenever no precision was configured (fp32 or not set?)
    value = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if value == "no":
        return None
    if value not in ("fp16", "bf16"):  # Accelerate's names are ours (shared/runtime/precision.py); fp8 has none
        raise UserError(f"the accelerate config asks for mixed_precision {value}, which this trainer does not "
                        f"implement (it supports no, fp16 and bf16). Run `accelerate config` and pick one of those, or "
                        "launch with --mixed_precision bf16.")
    return value


def check_strategy() -> None:
    """UserError for FSDP / DeepSpeed / Megatron-LM launcher configs (refused before anything is written)."""
    if asked := [name for var, name in SHARDED.items()  # an environment flag's truth, as accelerate writes it
                 if str(os.environ.get(var)).strip().lower() in ("1", "true", "yes")]:
        raise UserError(
            f"the accelerate config asks for {asked[0]}, which this trainer does not support: it trains with "
            "plain data parallelism (DDP), every process holding the whole model, and its checkpoints, EMA and "
            "cross-process consistency check rely on that. Run `accelerate config` and choose multi-GPU (or "
            "pass --config_file with distributed_type MULTI_GPU), or launch with `accelerate launch "
            "--multi_gpu --num_processes N -m train ...`. To fit DiT-XL/2 on 24 GB cards without sharding, "
            "keep --micro-batch-size/--grad-checkpoint auto, or add --optimizer adamw8bit or --ema-device cpu.")


def resolve_precision_with_launcher(requested: str) -> str:
    """The launcher's precision, the requested one, or 'auto' (the device decides); a contradiction stops."""
    launcher = launcher_precision()
    if launcher is None:
        return requested
    if requested in ("auto", launcher):
        return launcher
    raise UserError(f"--precision {requested}, but the accelerate config asks for mixed_precision {launcher}; one "
                    f"of them would be silently ignored. Pass --precision {launcher} (or --precision auto, which "
                    f"follows the launcher), or change the accelerate config (`accelerate config`, or `accelerate "
                    f"launch --mixed_precision {'no' if requested == 'fp32' else requested}`).")
