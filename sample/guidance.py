"""The model function the samplers call: classifier-free guidance as in the DiT release, under autocast."""
from __future__ import annotations

import contextlib

import torch

from shared.errors import UserError
from shared.precision import PRECISIONS



def autocast(device: torch.device, precision: str):
    """Autocast context for fp16/bf16 (weights stay fp32, LayerNorm/softmax stay fp32); none for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=PRECISIONS[precision])


def check_guidance(cfg_scale: float, class_dropout_prob: float) -> None:
    """UserError for a scale below 1, or guidance on a model that never learned the null class."""
    if cfg_scale < 1.0:
        raise UserError(f"--cfg-scale {cfg_scale} is below 1; pass 1 for no guidance or a larger value "
                        f"(4.0 for pictures, 1.5 for FID as in the DiT paper).")
    if cfg_scale > 1.0 and class_dropout_prob <= 0:
        raise UserError("this model was trained without class dropout, so it has no null-class embedding "
                        "and cannot be guided; pass --cfg-scale 1.")


def make_model_fn(model, cfg_scale: float, guide_channels: int | None, precision: str, device):
    """model_fn(x (N,C,h,w), t (N,), y (N,)) -> (N,out,h,w); guided when cfg_scale > 1."""

    def conditional(x, t, y):
        """Plain conditional prediction: no batch doubling."""
        with autocast(device, precision):
            return model(x, t, y).float()

    def guided(x, t, y):
        """Official DiT CFG: [cond; null] halves in one batch, keep the guided first half."""
        null = torch.full_like(y, model.null_label)
        x_in = torch.cat([x, x])  # (2N, C, h, w)
        t_in = torch.cat([t, t])  # (2N,)
        y_in = torch.cat([y, null])  # (2N,)
        with autocast(device, precision):
            out = model.forward_with_cfg(x_in, t_in, y_in, cfg_scale, guide_channels=guide_channels)
        return out[: len(x)].float()  # (N, out, h, w)

    return guided if cfg_scale > 1.0 else conditional
