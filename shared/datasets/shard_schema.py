"""The named per-sample tensors of a latent shard payload: how they are described and found.

A payload (KEY.latent.safetensors) always holds the VAE posterior moments "mean" and "std" (F, C, h, w) and may
hold more named tensors beside them, e.g. "repr": a frozen encoder's patch tokens (F, T, D) for REPA. Every
payload of a folder shares one safetensors header, so a folder's layout records each tensor once:

    layout = {"dtype", "shape"            the moments' dtype and (F, C, h, w): the format's first version
              "header_size", "payload_size",
              "tensors": {name: offset}   byte offset of every tensor's data inside a payload
              "extra": {name: {"dtype", "shape"}}}   only when tensors besides the moments are stored

Folders written before extra tensors existed have no "extra" and read unchanged. index.json also lists every
tensor as {"name", "dtype", "shape"} under "tensors" (`describe`), for people and other tools.
"""
from __future__ import annotations

import json

import numpy as np
import torch

MOMENT_NAMES = ("mean", "std")  # always stored, in every version of the format
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Storage dtypes an extra tensor may take (the flag vocabulary of extract --repr-dtype).
EXTRA_STORAGE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def payload_header(payload: bytes) -> tuple[dict, int]:
    """(safetensors header without __metadata__, byte offset where tensor data starts)."""
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    header.pop("__metadata__", None)
    return header, 8 + header_len


def payload_layout(payload: bytes) -> dict:
    """The layout of a payload's header (see the module docstring); extras appear only when present."""
    header, data_start = payload_header(payload)
    moments = header[MOMENT_NAMES[0]]
    layout = {
        "dtype": SAFETENSORS_DTYPES[moments["dtype"]],
        "shape": list(moments["shape"]),  # (F, C, h, w)
        "header_size": data_start,
        "payload_size": len(payload),
        # byte offset of each tensor's data relative to the start of the payload
        "tensors": {name: data_start + header[name]["data_offsets"][0] for name in sorted(header)},
    }
    extra = {name: {"dtype": SAFETENSORS_DTYPES[spec["dtype"]], "shape": list(spec["shape"])}
             for name, spec in sorted(header.items()) if name not in MOMENT_NAMES}
    if extra:
        layout["extra"] = extra
    else:  # exactly the first version's layout: old and new moment-only folders are indistinguishable
        layout["tensors"] = {name: layout["tensors"][name] for name in MOMENT_NAMES}
    return layout


def tensor_specs(layout: dict) -> dict:
    """name -> {"dtype", "shape", "offset"} of every tensor in a payload of this layout (moments first)."""
    specs = {name: {"dtype": layout["dtype"], "shape": list(layout["shape"]), "offset": layout["tensors"][name]}
             for name in MOMENT_NAMES}
    for name, spec in layout.get("extra", {}).items():
        specs[name] = {"dtype": spec["dtype"], "shape": list(spec["shape"]), "offset": layout["tensors"][name]}
    return specs


def describe(layout: dict) -> list[dict]:
    """index.json's "tensors": [{name, dtype, shape}] of every per-sample tensor."""
    return [{"name": name, "dtype": s["dtype"], "shape": s["shape"]} for name, s in tensor_specs(layout).items()]


def spec_nbytes(spec: dict) -> int:
    """Bytes of one sample's tensor of this spec."""
    return int(np.prod(spec["shape"])) * torch.empty((), dtype=TORCH_DTYPES[spec["dtype"]]).element_size()


def serialise(tensors: dict) -> bytes:
    """A safetensors payload of CPU tensors (torch's writer: it knows bf16, which numpy does not)."""
    import safetensors.torch

    return safetensors.torch.save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
