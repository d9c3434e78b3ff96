"""Finding and loading a tokenizer: a --vae spec (a short name, a converted release, a diffusers folder, a single
weight file with its config, a Hugging Face Hub id) located without reading weights, then loaded into a `Tokenizer`.

Locating is cheap (at most a config.json and a safetensors header are read), so every stage checks a spec before it
starts; `load_tokenizer` is the one place weights are read and diffusers is imported. What the tokenizer then does
with pixels and latents is shared/tokenizers/tokenizer.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from shared.runtime.errors import SettingError
from shared.tokenizers.tokenizer import Tokenizer, tokenizer_class


VAE_SHORT_NAMES = {"ema": "stabilityai/sd-vae-ft-ema", "mse": "stabilityai/sd-vae-ft-mse",
                   # DC-AE's ImageNet releases (Chen et al. 2024, mit-han-lab), diffusers folders on the Hub
                   "dc-ae-f32c32": "mit-han-lab/dc-ae-f32c32-in-1.0-diffusers",
                   "dc-ae-f64c128": "mit-han-lab/dc-ae-f64c128-in-1.0-diffusers"}
# --vae NAME of a released tokenizer converted once into a folder: NAME -> locate(NAME) (`register_converted`).
CONVERTED: dict = {}
BUILT_IN_CONVERTED = ("shared.tokenizers.vavae", "shared.tokenizers.rae")  # they register VA-VAE's, RAE's
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The options every "cannot find the VAE" message names.
_LOCAL_OPTIONS = (
    "Pass a local VAE instead: a diffusers folder (config.json + diffusion_pytorch_model.safetensors), e.g. "
    "downloaded once on a machine with internet by `huggingface-cli download stabilityai/sd-vae-ft-ema "
    "--local-dir PATH` and then given as {vae} PATH; or a single .safetensors/.ckpt/.pt file with a config.json "
    "beside it (or given as {vae config}).")


@dataclass(frozen=True)
class _Located:
    """Where a VAE spec points: its public name, what kind it is, and the files to read."""
    name: str          # hub id or absolute path: what `identity["source"]` records
    kind: str          # "folder" | "file" | "hub"
    path: Path | None  # folder or single file on disk (None for a hub id not yet downloaded)
    config_path: Path | None


# ---- Locating a spec (cheap: reads at most a config.json, never weights) ----

def looks_like_hub_id(text: str) -> bool:
    """owner/name with no path markers: what a name means as a Hugging Face Hub repo when no such path exists."""
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "/", "~"))


def _hub_offline() -> bool:
    """True when HF_HUB_OFFLINE is set or the hub's host does not resolve (no network)."""
    from huggingface_hub import constants
    if not constants.HF_HUB_OFFLINE:
        with contextlib.suppress(OSError):
            socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname or "huggingface.co", 443)
            return False
    return True


def _locate_hub(repo_id: str) -> _Located:
    """A hub id: use the local HF cache if it holds the VAE, else fetch only config.json (online)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    with contextlib.suppress(Exception):  # any cache miss means "not cached"; the message below says what to do
        folder = Path(snapshot_download(repo_id, local_files_only=True))
        if (folder / "config.json").is_file() and any((folder / n).is_file() for n in WEIGHT_FILES):
            return _Located(repo_id, "folder", folder, folder / "config.json")
    if _hub_offline():
        raise SettingError(f"The VAE {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached "
                           f"(offline). {_LOCAL_OPTIONS}")
    try:
        config_path = Path(hf_hub_download(repo_id, "config.json"))
    except Exception as err:  # noqa: BLE001 - network and missing-repo errors alike become one message
        raise SettingError(
            f"Could not fetch the VAE {repo_id!r} from the Hugging Face hub ({type(err).__name__}). Check the "
            f"name (short names: {', '.join(VAE_SHORT_NAMES)}). {_LOCAL_OPTIONS}"
        ) from None
    return _Located(repo_id, "hub", None, config_path)


def _hub_file(repo_id: str, filename: str) -> Path:
    """A file of a Hub repository from the local Hugging Face cache, downloaded into it when online."""
    from huggingface_hub import hf_hub_download
    try:
        return Path(hf_hub_download(repo_id, filename, local_files_only=_hub_offline()))
    except Exception as err:  # noqa: BLE001 - a cache miss offline, a network or missing-file error: one message
        raise SettingError(
            f"{filename} of {repo_id} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(err).__name__}). On a machine with internet run `huggingface-cli download {repo_id} {filename}` "
            f"(the cache folder can then be copied here), or pass a diffusers folder as {{vae}}.") from None


def file_stamps(paths) -> list[str]:
    """'path:size' of each release file: what names its converted folder."""
    return [f"{p.resolve()}:{p.stat().st_size}" for p in paths]


def converted_folder(name: str, key: str, build) -> Path:
    """The diffusers folder `build()` converts from release files, named by the hash of `key`, published once."""
    from shared.runtime.fsio import publish_dir, remove_tree, user_cache
    folder = user_cache("tokenizers") / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return folder
    model, staging = build(), folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    try:
        model.save_pretrained(staging, safe_serialization=True)
    except BaseException:  # a full disk or a Ctrl-C: no half-written folder is left in the cache
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if folder.exists():  # another process converted it meanwhile
        remove_tree(staging)
    else:
        publish_dir(staging, folder)
    return folder


def register_converted(names, locate) -> None:
    """--vae NAME for each of `names`: locate(NAME) -> (the source the identity records, the converted folder)."""
    CONVERTED.update(dict.fromkeys(names, locate))


def converted_names() -> dict:
    """The registered names of converted tokenizers (the package's imported first)."""
    for module in BUILT_IN_CONVERTED:
        importlib.import_module(module)
    return CONVERTED


def _locate(spec, config=None) -> _Located:
    """Turn a VAE spec into a _Located without loading weights; UserError when it cannot work."""
    text = str(spec).strip()
    if text in converted_names():
        source, folder = CONVERTED[text](text)
        return _Located(source, "folder", folder, folder / "config.json")
    if text in VAE_SHORT_NAMES:
        return _locate_hub(VAE_SHORT_NAMES[text])
    path = Path(text).expanduser()
    if path.is_dir():  # a diffusers folder, or a pipeline folder holding one in vae/
        if not (path / "config.json").is_file() and (path / "vae" / "config.json").is_file():
            path = path / "vae"
        if not (path / "config.json").is_file():
            raise SettingError(f"The VAE folder {path} has no config.json. {_LOCAL_OPTIONS}")
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            raise SettingError(f"The VAE folder {path} has a config.json but no weights "
                               f"({' or '.join(WEIGHT_FILES)}). {_LOCAL_OPTIONS}")
        path = path.resolve()
        return _Located(str(path), "folder", path, path / "config.json")
    if path.is_file():  # a single weight file: its architecture from config.json beside it or from `config`
        if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
            raise SettingError(
                f"The VAE file {path} is not a weight file ({', '.join(SINGLE_FILE_SUFFIXES)}). {_LOCAL_OPTIONS}")
        config_path = Path(config) if config is not None else path.parent / "config.json"
        if not config_path.is_file():
            raise SettingError(
                f"The VAE file {path} needs its architecture: put the VAE's diffusers config.json beside it or "
                f"pass {{vae config}} PATH/config.json (e.g. the config.json of stabilityai/sd-vae-ft-ema).")
        path = path.resolve()
        return _Located(str(path), "file", path, config_path.resolve())
    if looks_like_hub_id(text):
        return _locate_hub(text)
    raise SettingError(
        f"Unknown VAE {text!r}: it is not a short name ({', '.join([*VAE_SHORT_NAMES, *converted_names()])}"
        f"; a name a module of yours registers needs --plugin MODULE), not an existing folder or file, and not a hub "
        f"id like stabilityai/sd-vae-ft-ema. {_LOCAL_OPTIONS}")


def resolve_vae_spec(spec, config=None) -> str:
    """Check a VAE spec cheaply and return its canonical name (hub id or absolute path)."""
    return _locate(spec, config).name


def read_vae_config(spec, config=None) -> dict:
    """The VAE's diffusers config.json as a dict, read without loading any weights."""
    located = _locate(spec, config)
    try:
        data = json.loads(located.config_path.read_text())
    except (OSError, ValueError) as err:
        raise SettingError(f"Cannot read the VAE config {located.config_path}: {err}. {_LOCAL_OPTIONS}") from None
    kind = tokenizer_class(data, located.name)
    if located.kind == "folder" and (located.path / WEIGHT_FILES[0]).is_file():
        kind.check_weights(located.path / WEIGHT_FILES[0], data, located.name)
    return data


# ---- Loading weights (diffusers imported here only) ----

def _load_single_file(located: _Located):
    """Build the config's class and load a single file (diffusers or, for AutoencoderKL, original LDM key names)."""
    from shared.weights.export import load_torch_file, safetensors_problem
    config = json.loads(located.config_path.read_text())
    kind = tokenizer_class(config, located.config_path)
    vae = kind.diffusers_class().from_config(config)
    path = located.path
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file
        if problem := safetensors_problem(path):
            raise SettingError(f"The VAE file {path} cannot be read ({problem}): it is truncated or not a "
                               f"safetensors file. Copy it again, or pass another {{vae}}.")
        state = load_file(str(path))
    else:  # .ckpt, .pt, .pth, .bin: PyTorch files, read by the weights-only loader
        state = load_torch_file(path, f"Pass another {{vae}}: {_LOCAL_OPTIONS[len('Pass a local VAE instead: '):]}")
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # as .ckpt files often wrap them
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise SettingError(f"The VAE file {path} does not hold a state dict. {_LOCAL_OPTIONS}")
    if not set(vae.state_dict()) <= set(state) and kind.name == "AutoencoderKL":
        # Original (CompVis/LDM) names such as encoder.down.0.block.0..., possibly under first_stage_model.
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
        state = convert_ldm_vae_checkpoint(state, dict(vae.config))
    try:
        vae.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise SettingError(f"The VAE file {path} does not match its config {located.config_path} "
                           f"({str(err).splitlines()[0]}). Pass the config.json that belongs to these weights as "
                           f"{{vae config}}.") from None
    return vae


def _load_folder(located: _Located):
    """from_pretrained on a local folder, or a hub id (downloading the weights when online); every tensor must load."""
    from diffusers.utils import logging as diffusers_logging
    from shared.weights.export import safetensors_problem
    source = str(located.path) if located.path is not None else located.name
    weights = located.path / WEIGHT_FILES[0] if located.path is not None else None
    if weights is not None and weights.is_file() and (problem := safetensors_problem(weights)):
        raise SettingError(f"The VAE weight file {weights} cannot be read ({problem}): it is truncated (an "
                           f"interrupted download or copy) or damaged. Download the folder again, or pass another "
                           f"{{vae}}.")
    cls = tokenizer_class(json.loads(located.config_path.read_text()), source).diffusers_class()
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its missing-weights warning is replaced by the refusal below
    try:
        vae, info = cls.from_pretrained(source, torch_dtype=torch.float32, output_loading_info=True)
    except (ValueError, RuntimeError, OSError) as err:  # shapes that do not fit the config; unreadable files
        text = " ".join(str(err).split())  # in one clause, without diffusers' advice to overwrite weights randomly
        text = text.split(" If you want to instead overwrite")[0].replace("Cannot load because ", "").rstrip(". ")
        raise SettingError(f"The VAE {source} cannot be loaded: {text[:300] or type(err).__name__}. "
                           f"{_FOLDER_FIX}") from None
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


def load_tokenizer(spec, device="cpu", dtype=torch.float32, config=None, tiling: bool = False,
                   slicing: bool = False) -> Tokenizer:
    """The tokenizer `spec` names (short name, folder, single file + config, hub id) on `device`, decoding in dtype."""
    located = _locate(spec, config)
    vae = _load_single_file(located) if located.kind == "file" else _load_folder(located)
    tokenizer = Tokenizer(vae, located.name, device, dtype)
    if tiling:
        tokenizer.enable_tiling()
    if slicing:
        tokenizer.enable_slicing()
    return tokenizer
