"""The VAE wrapper: locate and load an AutoencoderKL, encode to posterior moments, decode, draw latents.

This module is the one owner of the latent scaling factor: it is read from the VAE's config (diffusers'
`scaling_factor`), never written as a number. diffusers is imported lazily inside the functions that load
weights, so `draw_latents` and the cheap checks are usable from `train/` without it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from shared.runtime.errors import SettingError, UserError

VAE_SHORT_NAMES = {"ema": "stabilityai/sd-vae-ft-ema", "mse": "stabilityai/sd-vae-ft-mse"}
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
DECODE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The options every "cannot find the VAE" message names.
_LOCAL_OPTIONS = (
    "Pass a local VAE instead: a diffusers folder (config.json + diffusion_pytorch_model.safetensors), e.g. "
    "downloaded once on a machine with internet by `huggingface-cli download stabilityai/sd-vae-ft-ema "
    "--local-dir PATH` and then given as {vae} PATH; or a single .safetensors/.ckpt/.pt file with a config.json "
    "beside it (or given as {vae config})."
)


@dataclass(frozen=True)
class _Located:
    """Where a VAE spec points: its public name, what kind it is, and the files to read."""

    name: str          # hub id or absolute path: what `identity["source"]` records
    kind: str          # "folder" | "file" | "hub"
    path: Path | None  # folder or single file on disk (None for a hub id not yet downloaded)
    config_path: Path | None


# ----------------------------------------------------------------------------------------------------------
# Locating a spec (cheap: reads at most a config.json, never weights)
# ----------------------------------------------------------------------------------------------------------

def _locate_folder(folder: Path) -> _Located:
    """A diffusers folder, or a pipeline folder holding one in vae/."""
    if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    if not (folder / "config.json").is_file():
        raise SettingError(f"The VAE folder {folder} has no config.json. {_LOCAL_OPTIONS}")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise SettingError(
            f"The VAE folder {folder} has a config.json but no weights ({' or '.join(WEIGHT_FILES)}). "
            f"{_LOCAL_OPTIONS}"
        )
    folder = folder.resolve()
    return _Located(str(folder), "folder", folder, folder / "config.json")


def _locate_file(path: Path, config: str | os.PathLike | None) -> _Located:
    """A single weight file whose architecture comes from config.json beside it or from `config`."""
    if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise SettingError(
            f"The VAE file {path} is not a weight file ({', '.join(SINGLE_FILE_SUFFIXES)}). {_LOCAL_OPTIONS}"
        )
    config_path = Path(config) if config is not None else path.parent / "config.json"
    if not config_path.is_file():
        raise SettingError(
            f"The VAE file {path} needs its architecture: put the VAE's diffusers config.json beside it or "
            f"pass {{vae config}} PATH/config.json (e.g. the config.json of stabilityai/sd-vae-ft-ema)."
        )
    path = path.resolve()
    return _Located(str(path), "file", path, config_path.resolve())


def _hub_offline() -> bool:
    """True when HF_HUB_OFFLINE is set or the hub's host does not resolve (no network)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return True
    return False


def _locate_hub(repo_id: str) -> _Located:
    """A hub id: use the local HF cache if it holds the VAE, else fetch only config.json (online)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
        if (folder / "config.json").is_file() and any((folder / n).is_file() for n in WEIGHT_FILES):
            return _Located(repo_id, "folder", folder, folder / "config.json")
    except Exception:  # noqa: BLE001 - any cache miss means "not cached"; the message below says what to do
        pass
    if _hub_offline():
        raise SettingError(
            f"The VAE {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached "
            f"(offline). {_LOCAL_OPTIONS}"
        )
    try:
        config_path = Path(hf_hub_download(repo_id, "config.json"))
    except Exception as err:  # noqa: BLE001 - network and missing-repo errors alike become one message
        raise SettingError(
            f"Could not fetch the VAE {repo_id!r} from the Hugging Face hub ({type(err).__name__}). Check the "
            f"name (short names: {', '.join(VAE_SHORT_NAMES)}). {_LOCAL_OPTIONS}"
        ) from None
    return _Located(repo_id, "hub", None, config_path)


def _locate(spec, config=None) -> _Located:
    """Turn a VAE spec into a _Located without loading weights; UserError when it cannot work."""
    text = str(spec).strip()
    if text in VAE_SHORT_NAMES:
        return _locate_hub(VAE_SHORT_NAMES[text])
    path = Path(text).expanduser()
    if path.is_dir():
        return _locate_folder(path)
    if path.is_file():
        return _locate_file(path, config)
    if _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return _locate_hub(text)
    raise SettingError(
        f"Unknown VAE {text!r}: it is not a short name ({', '.join(VAE_SHORT_NAMES)}), not an existing folder "
        f"or file, and not a hub id like stabilityai/sd-vae-ft-ema. {_LOCAL_OPTIONS}"
    )


def resolve_vae_spec(spec, config=None) -> str:
    """Check a VAE spec cheaply and return its canonical name (hub id or absolute path)."""
    return _locate(spec, config).name


def read_vae_config(spec, config=None) -> dict:
    """The VAE's diffusers config.json as a dict, read without loading any weights."""
    located = _locate(spec, config)
    try:
        return json.loads(located.config_path.read_text())
    except (OSError, ValueError) as err:
        raise SettingError(f"Cannot read the VAE config {located.config_path}: {err}. {_LOCAL_OPTIONS}") from None


def downsample_factor(config: dict) -> int:
    """Pixels per latent cell: each encoder level after the first halves the resolution."""
    # diffusers' AutoencoderKL default block_out_channels is (64,): one level, no downsampling.
    return 2 ** (len(config.get("block_out_channels", (64,))) - 1)


def config_sha256(config: dict) -> str:
    """A hash of the architecture (keys starting with '_' are bookkeeping, e.g. the diffusers version)."""
    public = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(public, sort_keys=True, default=list).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Loading weights (diffusers imported here only)
# ----------------------------------------------------------------------------------------------------------

def _read_state_dict(path: Path) -> dict:
    """Tensors of a single weight file (.safetensors, else a PyTorch file); .ckpt files often wrap them in 'state_dict'."""
    from shared.runtime.export import load_torch_file, safetensors_problem

    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        problem = safetensors_problem(path)
        if problem:
            raise SettingError(f"The VAE file {path} cannot be read ({problem}): it is truncated or not a "
                               f"safetensors file. Copy it again, or pass another {{vae}}.")
        state = load_file(str(path))
    else:  # .ckpt, .pt, .pth, .bin: PyTorch files, read by the weights-only loader
        state = load_torch_file(path, f"Pass another {{vae}}: {_LOCAL_OPTIONS[len('Pass a local VAE instead: '):]}")
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise SettingError(f"The VAE file {path} does not hold a state dict. {_LOCAL_OPTIONS}")
    return state


def _load_single_file(located: _Located):
    """Build AutoencoderKL from the config and load a single file (diffusers or original LDM key names)."""
    from diffusers import AutoencoderKL

    config = json.loads(located.config_path.read_text())
    vae = AutoencoderKL.from_config(config)
    state = _read_state_dict(located.path)
    if not set(vae.state_dict()) <= set(state):
        # Original (CompVis/LDM) names such as encoder.down.0.block.0..., possibly under first_stage_model.
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

        state = convert_ldm_vae_checkpoint(state, dict(vae.config))
    try:
        vae.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise SettingError(
            f"The VAE file {located.path} does not match its config {located.config_path} ({first}). Pass the "
            f"config.json that belongs to these weights as {{vae config}}."
        ) from None
    return vae


def _load_folder(located: _Located):
    """from_pretrained on a local folder, or a hub id (downloading the weights when online); every tensor must load."""
    from diffusers import AutoencoderKL

    from diffusers.utils import logging as diffusers_logging
    from shared.runtime.export import safetensors_problem

    source = str(located.path) if located.path is not None else located.name
    weights = located.path / WEIGHT_FILES[0] if located.path is not None else None
    if weights is not None and weights.is_file() and (problem := safetensors_problem(weights)):
        raise SettingError(f"The VAE weight file {weights} cannot be read ({problem}): it is truncated (an "
                           f"interrupted download or copy) or damaged. Download the folder again, or pass another "
                           f"{{vae}}.")
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its missing-weights warning is replaced by the refusal below
    try:
        vae, info = AutoencoderKL.from_pretrained(source, torch_dtype=torch.float32, output_loading_info=True)
    except (ValueError, RuntimeError, OSError) as err:  # shapes that do not fit the config; unreadable files
        raise SettingError(f"The VAE {source} cannot be loaded: {_loading_problem(err)}. {_FOLDER_FIX}") from None
    finally:
        diffusers_logging.set_verbosity(verbosity)
    # diffusers only warns about missing tensors and leaves them randomly initialised: noise images, no error.
    missing, unexpected = info.get("missing_keys", []), info.get("unexpected_keys", [])
    if missing or unexpected:
        parts = [f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in
                 (("tensors its config needs are missing from the weights", missing),
                  ("tensors in the weights are not in its config", unexpected)) if keys]
        raise SettingError(f"The VAE {source} does not fit its config.json: {'; '.join(parts)}. {_FOLDER_FIX}")
    return vae


_FOLDER_FIX = ("The weights and config.json of a VAE folder must come from the same VAE (a folder mixed from two "
               "VAEs, or an interrupted download); download the folder again, or pass another {vae}.")


def _loading_problem(err: BaseException) -> str:
    """diffusers' loading error in one clause, without its advice to overwrite weights randomly."""
    text = " ".join(str(err).split())
    text = text.split(" If you want to instead overwrite")[0].replace("Cannot load because ", "")
    return text.rstrip(". ")[:300] or type(err).__name__


class LatentVAE:
    """An AutoencoderKL whose encoder runs in fp32 and whose decoder runs in the requested dtype."""

    def __init__(self, vae, source: str, device, dtype=torch.float32):
        """Wrap a loaded diffusers AutoencoderKL (use `LatentVAE.load` to build one from a spec)."""
        if dtype not in DECODE_DTYPES:
            raise UserError(f"VAE decode dtype {dtype} is not supported; use float32, float16 or bfloat16.")
        self.vae = vae.eval().requires_grad_(False).to(device)  # loaded in fp32
        self.device = torch.device(device)
        self.dtype = dtype
        # Only the decoder side is cast: the moments must come from an fp32 encoder (they are stored).
        for part in (self.vae.decoder, self.vae.post_quant_conv):
            if part is not None:
                part.to(dtype)
        config = dict(self.vae.config)
        self.scaling_factor = float(config["scaling_factor"])
        self.latent_channels = int(config["latent_channels"])
        self.downsample_factor = downsample_factor(config)
        self.identity = {
            "source": source,
            "scaling_factor": self.scaling_factor,
            "latent_channels": self.latent_channels,
            "downsample_factor": self.downsample_factor,
            "config_sha256": config_sha256(config),
        }

    @classmethod
    def load(cls, spec, device="cpu", dtype=torch.float32, config=None) -> "LatentVAE":
        """Load the VAE named by spec (short name, folder, single file + config, or hub id) onto device."""
        located = _locate(spec, config)
        vae = _load_single_file(located) if located.kind == "file" else _load_folder(located)
        return cls(vae, located.name, device, dtype)

    @torch.no_grad()
    def encode_moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and std of images (N,3,H,W) in [-1,1]; fp32, unscaled, each (N,C,H/f,W/f)."""
        x = images.to(self.device, torch.float32, non_blocking=True)
        # Autocast from a caller must not turn the stored moments into half precision.
        with torch.autocast(self.device.type, enabled=False):
            posterior = self.vae.encode(x).latent_dist
        # diffusers clamps logvar to [-30, 20] and returns std = exp(0.5 * logvar).
        return posterior.mean.float(), posterior.std.float()  # (N, C, h, w) each

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (N,3,H,W) in [-1,1], fp32, from latents (N,C,h,w) scaled by `scaling_factor`."""
        z = latents.to(self.device, self.dtype) / self.scaling_factor
        with torch.autocast(self.device.type, enabled=False):
            images = self.vae.decode(z).sample  # (N, 3, H, W)
        return images.float().clamp_(-1.0, 1.0)

    def enable_tiling(self):
        """Encode/decode large images tile by tile (diffusers' switch; lower memory, slight seams)."""
        self.vae.enable_tiling()

    def enable_slicing(self):
        """Encode/decode a batch one image at a time (diffusers' switch; lower peak memory)."""
        self.vae.enable_slicing()


def draw_latents(mean, std, scaling_factor, generator=None) -> torch.Tensor:
    """A fresh posterior sample z = (mean + std * eps) * scaling_factor, in fp32 on mean's device.

    `generator` is None, one torch.Generator, or a list with one generator per batch row (so a row's
    draw does not depend on the batch it is in). Noise is drawn on the generator's device.
    """
    mean, std = mean.float(), std.float()
    if isinstance(generator, (list, tuple)):
        if len(generator) != mean.shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {mean.shape[0]}")
        eps = torch.stack([_randn(mean.shape[1:], g, mean.device) for g in generator])  # (N, C, h, w)
    else:
        eps = _randn(mean.shape, generator, mean.device)
    return (mean + std * eps) * scaling_factor


def _randn(shape, generator, device) -> torch.Tensor:
    """Standard normal noise drawn on the generator's device (else on `device`), moved to `device`."""
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where, dtype=torch.float32).to(device)
