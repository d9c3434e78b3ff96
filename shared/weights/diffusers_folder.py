"""Find and read a diffusers DiT: a DiTPipeline folder (model_index.json, transformer/ with config.json and
diffusion_pytorch_model.safetensors, .bin or a sharded *.index.json, vae/ used when --vae is omitted), its transformer/
folder or weight file, or a Hub repo id (read from the local Hugging Face cache, else downloaded into it: the
transformer, VAE and configs only)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.runtime.errors import UserError
from shared.weights.export import load_torch_file, safetensors_problem

MODEL_INDEX = "model_index.json"
CONFIG = "config.json"
TRANSFORMER, VAE = "transformer", "vae"
# diffusers' weight file names, in the order they are preferred (safetensors first: no pickle at all).
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                "diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json")
# What a Hub download fetches: configs and weights of the parts sampling uses, no half-precision variants.
_HUB_FIRST = ["model_index.json", "*config.json", "*.safetensors", "*.safetensors.index.json"]
_HUB_PICKLES = ["*.bin", "*.bin.index.json"]
_HUB_SKIP = ["*.fp16.*", "*.ckpt", "*.msgpack", "*.onnx", "*.h5"]


@dataclass
class DiffusersSource:
    """A diffusers DiT on disk: its transformer folder, the weight file read, and the pipeline's VAE if any."""

    transformer: Path          # folder holding config.json
    weights: Path              # the weight file (or shard index) read
    vae: Path | None           # PIPELINE/vae, when the transformer belongs to a pipeline folder that has one
    label: str                 # short name for output folders


def read_json(path: Path) -> dict:
    """A JSON object from disk; UserError naming the file when it is unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} ({err}); the diffusers folder is damaged or incomplete: download or "
                        f"export it again.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; the diffusers folder is damaged: download or export it again.")
    return data


def _has_class_config(folder: Path) -> bool:
    """Whether a folder holds a diffusers model config (config.json with a _class_name)."""
    try:  # OSError: no such file (or not a readable one)
        return "_class_name" in json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def is_diffusers_folder(folder: Path) -> bool:
    """A pipeline folder (model_index.json) or a diffusers model folder (config.json with _class_name)."""
    return folder.is_dir() and ((folder / MODEL_INDEX).is_file() or _has_class_config(folder))


def is_diffusers_file(path: Path) -> bool:
    """A weight file saved by diffusers: config.json with a _class_name beside it, and none of our metadata."""
    if not path.is_file() or not _has_class_config(path.parent):
        return False
    if path.suffix.lower() != ".safetensors":
        return path.name.startswith("diffusion_pytorch_model")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return "dit_config" not in (f.metadata() or {})
    except Exception:  # noqa: BLE001 - unreadable: the export loader reports it in its own words
        return False


def locate(path: Path, hub_id: str | None = None) -> DiffusersSource:
    """The DiffusersSource of a pipeline folder, a transformer folder or weight file (of a Hub repo's snapshot)."""
    if path.is_file():
        transformer, weights = path.parent, path
    else:
        transformer = path
        if (path / MODEL_INDEX).is_file():  # a pipeline folder: its transformer/ model, and its vae/ if it has one
            index = read_json(path / MODEL_INDEX)
            if TRANSFORMER not in index or not (path / TRANSFORMER).is_dir():
                parts = ", ".join(k for k in index if not k.startswith("_")) or "none"
                raise UserError(f"{path} is a diffusers {index.get('_class_name', 'pipeline')} folder without a "
                                f"{TRANSFORMER}/ model (its parts: {parts}), so it holds no DiT. Pass a DiTPipeline "
                                f"folder (transformer/, vae/, scheduler/), its transformer/ folder, or a run folder or "
                                f"weight file of this project.")
            transformer = path / TRANSFORMER
        weights = next((transformer / name for name in WEIGHT_FILES if (transformer / name).is_file()), None)
        if weights is None:
            raise UserError(f"the diffusers model folder {transformer} has a {CONFIG} but no weights "
                            f"({', '.join(WEIGHT_FILES)}); the download or export is incomplete: fetch it again.")
    parent = transformer.parent  # a pipeline folder when it has a model index: its vae/ is used
    vae = parent / VAE if (parent / MODEL_INDEX).is_file() and (parent / VAE / CONFIG).is_file() else None
    # Output folders are named after the Hub repo, else the pipeline (or model) folder.
    pipeline = transformer.name == TRANSFORMER and (parent / MODEL_INDEX).is_file()
    label = hub_id.split("/")[-1] if hub_id else (parent if pipeline else transformer).name
    return DiffusersSource(transformer, weights, vae, label)


def _not_cached(repo_id: str, why: str) -> UserError:
    """The one paragraph for a Hub id that cannot be read from the cache nor downloaded."""
    from huggingface_hub import constants

    return UserError(
        f"--ckpt {repo_id} is not a local path, and as a Hugging Face Hub repo id it is not in the local Hub cache "
        f"({constants.HF_HUB_CACHE}) {why}. On a machine with internet run `hf download {repo_id}` (it fills that "
        f"cache; copy the cache over, or point HF_HUB_CACHE / HF_HOME at it), or `hf download {repo_id} --local-dir "
        f"PATH` and pass --ckpt PATH. A local path must exist: check its spelling.")


def locate_hub(repo_id: str) -> DiffusersSource:
    """A Hub id from the local cache, else downloaded into it; UserError when offline and not cached."""
    from huggingface_hub import snapshot_download
    from shared.tokenizers.locate import _hub_offline  # the project's one "can the Hub be reached" test

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - every cache miss (no repo, no ref, no snapshot) means "not cached"
        folder = None
    if folder is None or not is_diffusers_folder(folder):  # not cached, or holding no model
        if _hub_offline():
            raise _not_cached(repo_id, "and the Hub cannot be reached (HF_HUB_OFFLINE is set, or no network)")
        try:  # the configs and safetensors weights; pickled .bin weights only for a part that has none
            folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FIRST, ignore_patterns=_HUB_SKIP))
            parts = [TRANSFORMER, VAE] if (folder / MODEL_INDEX).is_file() else [""]  # "": one model folder
            missing = [part for part in parts if (folder / part / CONFIG).is_file()  # a config but no weights
                       and not any((folder / part / name).is_file() for name in WEIGHT_FILES)]
            if missing:  # read weights-only (shared.weights.export.load_torch_file), never as a general pickle
                patterns = [f"{part}/{p}" if part else p for part in missing for p in _HUB_PICKLES]
                folder = Path(snapshot_download(repo_id, allow_patterns=patterns, ignore_patterns=_HUB_SKIP))
        except Exception as err:  # noqa: BLE001 - missing repo, gated repo, network: one paragraph
            raise _not_cached(repo_id, f"and downloading it failed ({type(err).__name__}: "
                                       f"{' '.join(str(err).split())[:200]})") from None
    if not is_diffusers_folder(folder):
        raise UserError(f"the Hub repo {repo_id} (cached at {folder}) holds neither a {MODEL_INDEX} nor a diffusers "
                        f"model {CONFIG}; it is not a diffusers DiT. Pass a DiTPipeline repo such as "
                        f"facebook/DiT-XL-2-256.")
    return locate(folder, repo_id)


def _read_one(path: Path) -> dict:
    """Tensors of one safetensors or PyTorch weight file (weights-only), refusing truncated files."""
    fix = "Download or export the diffusers folder again."
    if path.suffix.lower() == ".safetensors":
        if problem := safetensors_problem(path):
            raise UserError(f"{path} is not a whole weight file ({problem}): it was cut short (an interrupted "
                            f"download or copy) or is damaged. {fix}")
        from safetensors.torch import load_file

        return load_file(str(path))
    state = load_torch_file(path, fix)
    if not isinstance(state, dict):
        raise UserError(f"{path} does not hold a state dict of tensors. {fix}")
    return state


def read_weights(path: Path) -> dict:
    """The state dict of a diffusers weight file, or of every shard its *.index.json names."""
    if not path.name.endswith(".index.json"):
        return _read_one(path)
    shards = sorted(set(read_json(path).get("weight_map", {}).values()))
    return {k: v for shard in shards for k, v in _read_one(path.parent / shard).items()}


def pipeline_latent_meta(source: DiffusersSource, config) -> dict | None:
    """What the pipeline says of its latents: its own vae/ (used when --vae is omitted) and class names."""
    meta = {"latent_shape": [config.in_channels, config.input_size, config.input_size]}
    if source.vae is not None:
        meta["vae"] = str(source.vae.resolve())
        vae_config = read_json(source.vae / CONFIG)
        if "scaling_factor" in vae_config:
            meta["scaling_factor"] = float(vae_config["scaling_factor"])
    index_path, n = source.transformer.parent / MODEL_INDEX, config.num_classes
    if source.transformer.name == TRANSFORMER and index_path.is_file():  # the pipeline's id2label, naming every class
        id2label = read_json(index_path).get("id2label") or {}
        if n and sorted(id2label, key=lambda k: int(k) if str(k).isdigit() else -1) == [str(i) for i in range(n)]:
            meta["class_names"] = [str(id2label[str(i)]).split(",")[0].strip() for i in range(n)]  # first synonyms
    return meta if len(meta) > 1 else None


def find_diffusers(path: Path, text: str) -> DiffusersSource | None:
    """The diffusers DiT --ckpt names (folder, weight file, or Hub id when no such path exists), else None."""
    if path.is_dir():
        return locate(path) if is_diffusers_folder(path) else None
    if path.is_file():
        return locate(path) if is_diffusers_file(path) else None
    # owner/name with no folder "owner" here: a Hub id (a mistyped local path gets the same paragraph's advice).
    from shared.tokenizers.locate import looks_like_hub_id

    return locate_hub(text) if looks_like_hub_id(text) and not path.parent.exists() else None
