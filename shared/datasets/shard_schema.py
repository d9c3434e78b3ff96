"""The columns of a latent shard payload: named per-sample tensors, their dtypes, and where each one lies.

A payload (KEY.latent.safetensors) is one safetensors file of named columns, each (F, ...) with F flip frames.
A folder's column set is declared once, when its shards are written (mosaicml streaming's `columns={name:
encoding}`), e.g. `{"mean": torch.float16, "std": torch.float16, "repr": torch.bfloat16}`:

    "mean"   (F, C, h, w)  the latent: a VAE's posterior mean, or a deterministic tokenizer's latent; always stored
    "std"    (F, C, h, w)  the posterior std, same dtype and shape as "mean"; no "std" column = deterministic
                           tokenizer (AutoencoderDC, RAE): the latent is "mean" itself, nothing is drawn
    any other name         (F, ...) e.g. "repr": a frozen encoder's patch tokens (F, T, D) for REPA

Every payload of a folder shares one safetensors header, so a folder's layout records each column once:

    layout = {"dtype", "shape"            the latent's ("mean") dtype and (F, C, h, w): the format's first version
              "header_size", "payload_size",
              "tensors": {name: offset}   byte offset of every column's data inside a payload
              "extra": {name: {"dtype", "shape"}}}   only when columns besides "mean" and "std" are stored

A mean+std folder written before other columns existed has no "extra" and reads unchanged; the writer gives the
same bytes as then. index.json also lists every column as {"name", "dtype", "shape"} under "tensors" (`describe`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

LATENT = "mean"  # the column every payload holds
STD = "std"  # the posterior spread; absent for a deterministic tokenizer
MOMENT_NAMES = (LATENT, STD)  # described by the layout's own "dtype"/"shape", never under "extra"


# ---------------------------------------------------------------------------------------------------------
# The one dtype vocabulary: the word of index.json, of a command line, of a safetensors header, torch's dtype
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StorageDtype:
    """One storage dtype under each of its names."""

    name: str  # index.json and the layout ("float16")
    flag: str  # the command-line word (extract --dtype / --repr-dtype: "fp16")
    safetensors: str  # the payload header's word ("F16")
    torch: torch.dtype


DTYPES = (StorageDtype("float16", "fp16", "F16", torch.float16),
          StorageDtype("bfloat16", "bf16", "BF16", torch.bfloat16),
          StorageDtype("float32", "fp32", "F32", torch.float32))
FLAG_DTYPES = {d.flag: d.torch for d in DTYPES}  # a flag word -> torch dtype (the word a column record names)


def storage_dtype(dtype) -> StorageDtype:
    """The vocabulary entry of a torch/numpy dtype or any of its words ("float16", "fp16", "F16")."""
    for d in DTYPES:
        if dtype is d.torch or dtype in (d.name, d.flag, d.safetensors):
            return d
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    for d in DTYPES:
        if name == d.name:
            return d
    raise ValueError(f"storage dtype must be one of {[d.name for d in DTYPES]}, got {dtype}")


# ---------------------------------------------------------------------------------------------------------
# Layout: a payload header <-> the columns of every payload of a folder
# ---------------------------------------------------------------------------------------------------------

def payload_header(payload: bytes) -> tuple[dict, int]:
    """(safetensors header without __metadata__, byte offset where tensor data starts)."""
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    header.pop("__metadata__", None)
    return header, 8 + header_len


def payload_layout(payload: bytes) -> dict:
    """The layout of a payload's header (see the module docstring); "extra" appears only when present."""
    header, data_start = payload_header(payload)
    latent = header[LATENT]
    layout = {
        "dtype": storage_dtype(latent["dtype"]).name,
        "shape": list(latent["shape"]),  # (F, C, h, w)
        "header_size": data_start,
        "payload_size": len(payload),
        # byte offset of each column's data relative to the start of the payload
        "tensors": {name: data_start + header[name]["data_offsets"][0] for name in sorted(header)},
    }
    extra = {name: {"dtype": storage_dtype(spec["dtype"]).name, "shape": list(spec["shape"])}
             for name, spec in sorted(header.items()) if name not in MOMENT_NAMES}
    if extra:
        layout["extra"] = extra
    return layout


def tensor_specs(layout: dict) -> dict:
    """name -> {"dtype", "shape", "offset"} of every column of a payload of this layout ("mean", "std" first)."""
    described = {name: {"dtype": layout["dtype"], "shape": list(layout["shape"])}
                 for name in MOMENT_NAMES if name in layout["tensors"]}
    described.update(layout.get("extra", {}))
    return {name: {"dtype": s["dtype"], "shape": list(s["shape"]), "offset": layout["tensors"][name]}
            for name, s in described.items()}


def deterministic(layout: dict) -> bool:
    """True when the payloads store the latent alone (no "std": a deterministic tokenizer)."""
    return STD not in layout["tensors"]


def describe(layout: dict) -> list[dict]:
    """index.json's "tensors": [{name, dtype, shape}] of every column."""
    return [{"name": name, "dtype": s["dtype"], "shape": s["shape"]} for name, s in tensor_specs(layout).items()]


def spec_nbytes(spec: dict) -> int:
    """Bytes of one sample's tensor of this spec."""
    return int(np.prod(spec["shape"])) * storage_dtype(spec["dtype"]).torch.itemsize


# ---------------------------------------------------------------------------------------------------------
# Writing one payload
# ---------------------------------------------------------------------------------------------------------

def check_columns(columns: dict) -> dict:
    """A writer's column set {name: dtype} -> {name: StorageDtype}; "std" must match "mean" when present."""
    if LATENT not in columns:
        raise ValueError(f"a latent shard stores a {LATENT!r} column (the latent); got columns {sorted(columns)}")
    out = {name: storage_dtype(dtype) for name, dtype in columns.items()}
    if STD in out and out[STD] != out[LATENT]:
        raise ValueError(f"{STD!r} must be stored in the dtype of {LATENT!r} ({out[LATENT].name}), "
                         f"got {out[STD].name}")
    return out


def as_column(x, dtype: StorageDtype) -> torch.Tensor:
    """A contiguous CPU tensor of `x` (torch or numpy) in the column's dtype.

    numpy input is cast by numpy where numpy has the dtype (the bytes the first version wrote); torch by torch.
    """
    if not isinstance(x, torch.Tensor):
        x = np.asarray(x)
        if dtype.torch is not torch.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(x, dtype=dtype.name))
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.detach().to("cpu", dtype.torch).contiguous()


def check_sample(tensors: dict, columns: dict) -> None:
    """One sample's tensors must be exactly the declared columns, the moments (F, C, h, w), all with one F."""
    if set(tensors) != set(columns):
        raise ValueError(f"a sample holds columns {sorted(tensors)}, the shard declares {sorted(columns)}")
    latent = tensors[LATENT]
    if latent.ndim != 4 or (STD in tensors and tensors[STD].shape != latent.shape):
        got = " and ".join(str(tuple(tensors[n].shape)) for n in MOMENT_NAMES if n in tensors)
        raise ValueError(f"{' and '.join(n for n in MOMENT_NAMES if n in tensors)} must be (F, C, h, w); got {got}")
    for name, t in tensors.items():
        if t.ndim < 1 or t.shape[0] != latent.shape[0]:
            raise ValueError(f"column {name!r} {tuple(t.shape)} must lead with the latent's {latent.shape[0]} "
                             f"flip frame(s)")


def serialise(tensors: dict) -> bytes:
    """A safetensors payload of CPU tensors (torch's writer: it knows bf16, which numpy does not)."""
    import safetensors.torch

    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        # safetensors refuses tensors sharing memory (e.g. one array given as "mean" and "std"): copy the repeat
        out[name] = t.clone() if t.untyped_storage().data_ptr() in seen else t
        seen.add(t.untyped_storage().data_ptr())
    return safetensors.torch.save(out)
