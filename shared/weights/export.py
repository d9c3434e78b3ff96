"""Weight files: the one safetensors writer (sorted metadata, plain copies, atomic), the readers and whole-file
checks every load needs (the safe `torch.load` among them), and our exports: safetensors with metadata (str -> str)
"dit_config": ModelConfig.to_dict(), "latent_space": the LatentSpace's JSON (its statistics are the tensors
"latent_space.*": shared/tokenizers/space.py), "step": the optimiser step.
"""
import json
import pickle
import re
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared.network.models import ModelConfig
from shared.runtime.errors import ChoiceError, SettingError, UserError
from shared.runtime.fsio import atomic_write


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """safetensors' save_file, then its header rewritten with the metadata keys sorted: equal content, equal bytes."""
    # safetensors writes metadata keys in a random (HashMap) order per process: sorted, a resumed run's bytes match.
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")  # the header: u64 length, then that many bytes of JSON
        header = json.loads(f.read(size))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        # serde_json's compact layout; a permutation of the same entries has the same length.
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        assert len(text) <= size, f"the sorted safetensors header of {path} is longer than the written one"
        f.seek(8)
        f.write(text.ljust(size, b" "))  # the format pads its header with spaces


def save_tensors(path, tensors: dict, metadata: dict | None = None):
    """Plain copies of `tensors` written to `path` as safetensors atomically (fsio.atomic_write); returns the path."""
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}  # no shared storage
    return atomic_write(path, lambda tmp: write_safetensors(tmp, tensors, metadata))


def read_tensor_file(path, device):
    """(tensors, metadata) of a safetensors file; UserError if it is missing or unreadable."""
    if not path.is_file():
        raise UserError(f"weight file {path} does not exist; check the path (a run folder's exports are in "
                        "RUN/exports/, its checkpoints in RUN/checkpoints/step-*/).")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"cannot read {path} as a safetensors weight file ({err}); the file is truncated (an "
                        "interrupted copy or download, a full disk) or not a safetensors file. Copy it again from "
                        "where it was made, or use another weight file.") from err


# --- Checks every weight load needs ---

def safetensors_problem(path) -> str | None:
    """Why a safetensors file is not whole (truncated, not safetensors), from its header alone; None if whole."""
    try:
        with safe_open(str(path), framework="pt"):  # checks the header and that the data covers the file
            return None
    except (SafetensorError, OSError, ValueError) as err:
        return " ".join(str(err).split()) or type(err).__name__


# torch names what its weights-only unpickler refused as "GLOBAL module.name" ("posix.system", a class...).
_BLOCKED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REFUSED = "Weights only load failed"  # the first words of every weights-only refusal


def load_torch_file(path, fix: str, allowed=()):
    """torch.load(weights_only=True) on the CPU -> the object; SettingError, ending in `fix`, for a refused file."""
    # `fix` may name {setting} fields; `allowed`: extra safe globals. torch's text (weights_only=False) is not repeated.
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        blocked = _BLOCKED_GLOBAL.search(str(err)) if _REFUSED in str(err) else None
        if blocked:  # a pickle that asks for a global (a function or class): what it wanted, and that nothing ran
            raise SettingError(
                f"{path} tried to run code while loading: its pickle asks to import and call `{blocked.group(1)}`, "
                f"which is neither a tensor nor a plain container, so the safe loader (torch.load with "
                f"weights_only=True) refused the file and nothing in it was run. Weight files never need code: use "
                f"a file from a source you trust, or a .safetensors copy of the weights. {fix}") from None
        # the one line that says what was refused (torch's advice lines dropped)
        skip = (_REFUSED, "Please file an issue", "Check the documentation")
        lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith(skip)]
        detail = lines[0] if lines else _first_line(err)
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as err:
        detail = _first_line(err)
    raise SettingError(f"cannot read {path} as a PyTorch weight file ({detail}): it is truncated (an interrupted copy "
                       f"or download), not a PyTorch file, or a pickle of more than plain tensors; nothing in it was "
                       f"run. {fix}") from None


def _first_line(err: BaseException) -> str:
    """The first sentence of an error's text (or its type name): torch appends paragraphs of advice."""
    text = str(err).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".")[:200] if text else type(err).__name__


# --- Our weight files: the model config and latent space inside ---

SPACE_KEY = "latent_space"  # metadata key of the latent space's JSON, prefix of its statistics' tensors


def save_weights(path, state_dict, model_config, space, step):
    """Write state_dict, the latent space and metadata to path atomically (fsio.atomic_write); returns the path."""
    if not isinstance(model_config, ModelConfig):
        model_config = ModelConfig.from_dict(dict(model_config))  # fail now, not when someone loads it
    space_metadata, space_tensors = space.file_parts() if space is not None else ({}, {})
    metadata = {"dit_config": json.dumps(model_config.to_dict(), sort_keys=True), **space_metadata,
                "step": str(int(step))}
    return save_tensors(path, {**state_dict, **space_tensors}, metadata)


def _parse_metadata(path, metadata):
    """(ModelConfig, step) from the file's metadata; UserError when dit_config is absent."""
    if "dit_config" not in metadata:
        raise UserError(f"{path} has no 'dit_config' metadata, so the model cannot be rebuilt from it. Use a "
                        "file written by this project's train stage (RUN/exports/*.safetensors), or an official "
                        "DiT .pt state dict, whose preset is inferred from its tensor shapes.")
    try:
        config = ModelConfig.from_dict(json.loads(metadata["dit_config"]))
        step = int(metadata.get("step", 0))
    except ChoiceError as err:  # e.g. a preset this version does not know: the file's fault, not a flag's
        raise UserError(f"the metadata of {path} describes a model this version cannot build ({err}); use the "
                        "code version that wrote it.") from err
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise UserError(f"the metadata of {path} is corrupt ({err}); the file is damaged: copy it again from "
                        "where it was made, or use another weight file.") from err
    return config, step


def read_config(path) -> ModelConfig:
    """The ModelConfig of a save_weights file from its header alone (no tensor is read)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError):
        read_tensor_file(path, "cpu")  # raises the one paragraph about a missing or unreadable file
        raise
    return _parse_metadata(path, metadata)[0]


def load_weights(path, device="cpu"):
    """(state_dict without the latent space's tensors, ModelConfig, metadata, step); LatentSpace.read_file: the space."""
    path = Path(path)
    tensors, metadata = read_tensor_file(path, device)
    config, step = _parse_metadata(path, metadata)
    return {k: v for k, v in tensors.items() if not k.startswith(f"{SPACE_KEY}.")}, config, metadata, step
