"""Slim weight files: a safetensors state dict with the model config and latent metadata inside.

Metadata keys (all JSON strings, as safetensors metadata must be str -> str):
  "dit_config": ModelConfig.to_dict(), "latents": latent_meta, "step": the optimiser step.
"""
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared.errors import ChoiceError, UserError
from shared.fsio import atomic_write
from shared.models import ModelConfig


def _plain_tensors(state_dict):
    """Detached, contiguous CPU copies without shared storage (what safetensors can write)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}


def save_weights(path, state_dict, model_config, latent_meta, step):
    """Write state_dict + metadata to path atomically (shared.fsio.atomic_write); returns the path."""
    if not isinstance(model_config, ModelConfig):
        model_config = ModelConfig.from_dict(dict(model_config))  # fail now, not when someone loads it
    config = model_config.to_dict()
    metadata = {"dit_config": json.dumps(config), "latents": json.dumps(latent_meta), "step": str(int(step))}
    tensors = _plain_tensors(state_dict)
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _read_file(path, device):
    """(tensors, metadata) of a safetensors file; UserError if it is missing or unreadable."""
    if not path.is_file():
        raise UserError(f"weight file {path} does not exist; check the path (a run folder's exports are in "
                        "RUN/exports/, its checkpoints in RUN/checkpoints/step-*/).")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"cannot read {path} as a safetensors weight file ({err}); the file is truncated or "
                        "not a safetensors file. Re-export it, or pass an official DiT .pt checkpoint.") from err


def _parse_metadata(path, metadata):
    """(ModelConfig, latent_meta, step) from the file's metadata; UserError when dit_config is absent."""
    if "dit_config" not in metadata:
        raise UserError(f"{path} has no 'dit_config' metadata, so the model cannot be rebuilt from it. Use a "
                        "file written by this project's train stage (RUN/exports/*.safetensors), or an official "
                        "DiT .pt state dict, whose preset is inferred from its tensor shapes.")
    try:
        config = ModelConfig.from_dict(json.loads(metadata["dit_config"]))
        latent_meta = json.loads(metadata["latents"]) if "latents" in metadata else None
        step = int(metadata.get("step", 0))
    except ChoiceError as err:  # e.g. a preset this version does not know: the file's fault, not a flag's
        raise UserError(f"the metadata of {path} describes a model this version cannot build ({err}); use the "
                        "code version that wrote it, or re-export the weights.") from err
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise UserError(f"the metadata of {path} is corrupt ({err}); re-export the weights.") from err
    return config, latent_meta, step


def load_weights(path, device="cpu"):
    """Read a file written by save_weights -> (state_dict, ModelConfig, latent_meta, step)."""
    path = Path(path)
    state_dict, metadata = _read_file(path, device)
    config, latent_meta, step = _parse_metadata(path, metadata)
    return state_dict, config, latent_meta, step
