"""Find and read the DiT weights --ckpt names: a run folder, a slim export, or an official .pt state dict."""
from __future__ import annotations

import argparse
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.errors import ChoiceError, UserError
from shared.export import load_weights
from shared.models import ModelConfig, check_preset, infer_model_config
from shared.rundir import CHECKPOINTS, EMA_FILE, EXPORTS, MODEL_FILE, latest_checkpoint, latest_export

OFFICIAL_SUFFIXES = (".pt", ".pth")
WEIGHTS = ("ema", "raw")  # which weights of a run or checkpoint: the EMA copy or the raw training weights
# Wrappers some trainers leave in front of every key (DDP, torch.compile).
_KEY_PREFIXES = ("module.", "_orig_mod.")


@dataclass
class LoadedWeights:
    """A DiT state dict with what is known about it."""

    state_dict: dict
    config: ModelConfig
    path: Path                        # the file actually read
    kind: str                         # "export" (config in metadata) or "official" (bare state dict)
    latent_meta: dict | None = None   # None for official checkpoints
    step: int | None = None
    notes: list[str] = field(default_factory=list)  # what was inferred; printed for the user


def resolve_ckpt_file(ckpt, weights: str = "ema") -> Path:
    """--ckpt (run folder, checkpoint folder or file) -> the weight file to read; UserError if none."""
    path = Path(ckpt).expanduser()
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist; pass a training run folder, a .safetensors export "
                        f"or an official DiT .pt checkpoint.")
    if path.is_file():
        return path
    if (path / MODEL_FILE).is_file():  # a single RUN/checkpoints/step-* folder
        return path / (EMA_FILE if weights == "ema" else MODEL_FILE)
    if weights == "raw":
        step_dir = latest_checkpoint(path)
        if step_dir is None:
            raise UserError(f"the run folder {path} has no complete checkpoints ({CHECKPOINTS}/step-*/) yet; train "
                            "until the first checkpoint is saved, or pass --weights ema for an export.")
        return step_dir / MODEL_FILE
    export = latest_export(path)
    if export is None:
        raise UserError(f"the run folder {path} has no EMA exports ({EXPORTS}/ema-step-*) yet; train until the first "
                        "export is written, or pass --weights raw to use the newest checkpoint's raw weights.")
    return export


def _strip_prefixes(state_dict: dict) -> dict:
    """Drop a DDP/compile prefix shared by every key."""
    for prefix in _KEY_PREFIXES:
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def _torch_load(path: Path):
    """torch.load with weights_only=True; official training checkpoints also pickle an argparse Namespace."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot read {path} as a PyTorch state dict ({first}); the file is truncated or not "
                        f"a DiT checkpoint. Pass an official DiT .pt file or a .safetensors export.") from err


def _pick_state_dict(obj, path: Path, weights: str) -> dict:
    """A bare state dict, or the 'ema'/'model' entry of a full official training checkpoint."""
    if isinstance(obj, dict) and isinstance(obj.get("ema"), dict) and isinstance(obj.get("model"), dict):
        obj = obj["ema" if weights == "ema" else "model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{path} does not hold a state dict of tensors; pass an official DiT .pt state dict "
                        f"or a .safetensors export of this project.")
    return _strip_prefixes(obj)


def _load_official(path: Path, weights: str, model: str | None) -> LoadedWeights:
    """A bare state dict: config inferred from tensor shapes, checked against --model if given."""
    state_dict = _pick_state_dict(_torch_load(path), path, weights)
    config = infer_model_config(state_dict)
    if model is not None and model != config.model:
        raise UserError(f"--model {model} does not fit {path}: its tensor shapes are those of {config.model} "
                        f"(latent input {config.input_size}). Pass --model {config.model} or drop --model.")
    how = "checked against --model" if model else "inferred from tensor shapes"
    notes = [f"{config.model}, latent {config.in_channels}x{config.input_size}x{config.input_size}, "
             f"{config.num_classes} classes ({how})"]
    return LoadedWeights(state_dict, config, path, "official", notes=notes)


def _load_export(path: Path, model: str | None) -> LoadedWeights:
    """Our safetensors export: config and latent metadata from the file, nothing inferred."""
    state_dict, config, latent_meta, step = load_weights(path)
    if model is not None and model != config.model:
        raise UserError(f"--model {model} contradicts {path}, which holds {config.model} weights (read from "
                        f"its metadata); drop --model, it is only needed for official .pt checkpoints.")
    return LoadedWeights(_strip_prefixes(state_dict), config, path, "export", latent_meta, step,
                         [f"{config.model} step {step} (config read from the file's metadata)"])


def load_checkpoint(ckpt, weights: str = "ema", model: str | None = None) -> LoadedWeights:
    """Resolve --ckpt and read its state dict and ModelConfig (no model is built yet)."""
    if weights not in WEIGHTS:
        raise ChoiceError("weights", weights, WEIGHTS)
    if model is not None:
        check_preset(model)
    path = resolve_ckpt_file(ckpt, weights)
    if path.suffix.lower() in OFFICIAL_SUFFIXES:
        return _load_official(path, weights, model)
    return _load_export(path, model)


def image_size_of(loaded: LoadedWeights, vae_factor: int, image_size: int | None) -> int:
    """Pixels per side the samples will have; UserError when --image-size disagrees with the weights."""
    size = loaded.config.input_size * vae_factor
    if image_size is not None and image_size != size:
        raise UserError(f"--image-size {image_size} does not fit {loaded.path}: a latent input of "
                        f"{loaded.config.input_size} decoded by this VAE (x{vae_factor}) gives {size} pixels. "
                        f"Pass --image-size {size} or drop it.")
    return size


def build_model(loaded: LoadedWeights, device) -> torch.nn.Module:
    """Instantiate the DiT, load the weights strictly, and move it to `device` in eval mode."""
    model = loaded.config.build()
    try:
        model.load_state_dict(loaded.state_dict, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        detail = " ".join(str(err).split())[:400]
        raise UserError(f"the weights in {loaded.path} do not fit {loaded.config.model} ({first} {detail}); "
                        f"the file is damaged or from an incompatible model.") from err
    return model.eval().requires_grad_(False).to(device)
