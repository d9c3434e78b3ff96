"""Our weight files ("exports"): slim safetensors files with the model config inside.

Metadata keys (all JSON strings, as safetensors metadata must be str -> str):
  "dit_config": ModelConfig.to_dict(), "latent_space": the LatentSpace's JSON (its statistics are the tensors
  "latent_space.*" beside the weights: shared/tokenizers/space.py), "step": the optimiser step.
"""
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from shared.network.models import ModelConfig
from shared.runtime.errors import ChoiceError, UserError
from shared.runtime.tensorfiles import read_tensor_file, save_tensors


SPACE_KEY = "latent_space"  # metadata key of the latent space's JSON, prefix of its statistics' tensors


def save_weights(path, state_dict, model_config, space, step):
    """Write state_dict, the latent space and metadata to path atomically (fsio.atomic_write); returns the path."""
    if not isinstance(model_config, ModelConfig):
        model_config = ModelConfig.from_dict(dict(model_config))  # fail now, not when someone loads it
    config = model_config.to_dict()
    space_metadata, space_tensors = space.file_parts() if space is not None else ({}, {})
    metadata = {"dit_config": json.dumps(config, sort_keys=True), **space_metadata, "step": str(int(step))}
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
