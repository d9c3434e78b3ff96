"""Every weight file --ckpt may name, as one table: FORMATS holds one WeightFormat per source (how it is recognised
and read, what its weights mean), walked by load_sampling_weights; a --plugin adds one with `register_format`."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import torch

from shared.generative.flow import auto_shift
from shared.generative.guidance import AUTO_OWN, AutoGuide
from shared.generative.objectives import DEFAULT_OBJECTIVE, check_objective
from shared.network.diffusers_dit import NUMERICS_NOTE, check_dit_config, diffusers_to_dit, model_config_of
from shared.network.models import PRESETS, ModelConfig, check_preset, infer_model_config
from shared.network.repa import REPA_PROJECTOR_PREFIX
from shared.runtime.errors import ChoiceError, UserError
from shared.runtime.registry import Registry
from shared.tokenizers.space import LatentSpace
from shared.weights.export import load_torch_file, load_weights, safetensors_problem
from shared.runtime.rundir import (CHECKPOINTS, EMA_FILE, EXPORTS, MODEL_FILE, checkpoint_path, is_complete_checkpoint,
                                   list_checkpoints, list_exports, step_of)
from shared.tokenizers.rae import RAE_DIT_LATENTS
from shared.weights.diffusers_folder import CONFIG, find_diffusers, pipeline_latent_meta, read_json, read_weights
from shared.weights.official import (OFFICIAL_NAMES, RAE_CFG_SCALE, RAE_SAMPLING, RELEASES, REPA_CFG_SCALE,
                                     REPA_SAMPLING, checkpoint_url, find_official, is_official_name, release_name)

TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")  # read with torch.load(weights_only=True); all else safetensors
WEIGHTS = ("ema", "raw")  # which weights of a run or checkpoint: the EMA copy or the raw training weights
AS_SAVED = "as saved"     # what settings.json records for a file holding one set of weights of unknown kind
ENTRIES = {"ema": "ema", "raw": "model"}  # the entries of a training checkpoint (DiT's, RAE's, LightningDiT's train.py)
_KEY_PREFIXES = ("module.", "_orig_mod.")  # wrappers some trainers leave in front of every key (DDP, torch.compile)
_OFFICIAL_FIX = ("Pass an official DiT checkpoint (downloaded from dl.fbaipublicfiles.com/DiT/models/, e.g. "
                 "DiT-XL-2-256x256.pt) or a .safetensors export of this project.")
_CKPT_KINDS = ("a training run folder, a .safetensors export, an official DiT .pt checkpoint (or a released one by "
               f"name: {', '.join(OFFICIAL_NAMES)}), or a diffusers DiT (pipeline folder, transformer folder, or Hub "
               "repo id such as facebook/DiT-XL-2-256)")


@dataclass
class LoadedWeights:
    """A DiT state dict with what is known about it."""

    state_dict: dict
    config: ModelConfig
    path: Path                        # the file actually read
    kind: str                         # "export" (config in metadata), "official" (bare state dict) or "diffusers"
    space: LatentSpace | None = None  # None for SD-VAE releases
    step: int | None = None
    notes: list[str] = field(default_factory=list)  # what was inferred; printed for the user
    weights: str = AS_SAVED           # what was loaded: "ema", "raw", or AS_SAVED (a file's only set)
    warnings: list[str] = field(default_factory=list)  # what the user must see (e.g. a broken newer export skipped)
    label: str | None = None          # short name for default output folders (None: from the file's path)
    auto_guide: AutoGuide = AUTO_OWN  # what --guide-channels auto means: what these weights' own sampler does


class Found:
    """What --ckpt names: its text and path, the --weights asked, and (each read once) what recognising it needs."""

    def __init__(self, ckpt, weights: str | None, path: Path | None = None, notes=()):
        self.ckpt, self.weights = str(ckpt), weights
        self.path = Path(ckpt).expanduser() if path is None else path
        self.notes = list(notes)  # what finding it had to say (a download, a broken newer export skipped)

    @property
    def is_torch(self) -> bool:
        """A file torch.load reads (weights only); every other file is read as safetensors."""
        return self.path.is_file() and self.path.suffix.lower() in TORCH_SUFFIXES

    @cached_property
    def release(self):
        """The release this file's name (or its URL's) identifies, else None."""
        name = release_name(self.path.name)
        return RELEASES[name] if name else None

    @cached_property
    def diffusers(self):
        """The diffusers DiT --ckpt names (shared/weights/diffusers_folder.py), else None."""
        return find_diffusers(self.path, self.ckpt)

    @cached_property
    def contents(self):
        """A torch file unpickled weights-only (the DiT release's training checkpoints also pickle a Namespace)."""
        return load_torch_file(self.path, _OFFICIAL_FIX, allowed=[argparse.Namespace])

    @cached_property
    def names(self) -> set:
        """The tensor names of a torch file's state dict (its first entry's in a training checkpoint)."""
        obj = self.contents
        if isinstance(obj, dict):
            obj = next((obj[e] for e in ENTRIES.values() if isinstance(obj.get(e), dict)), obj)
        return set(_strip_prefixes(obj)) if isinstance(obj, dict) else set()


@dataclass
class Read:
    """What a format reads from a file: tensors, ModelConfig (its .sampling: the recorded sampling settings), notes."""

    state_dict: dict
    config: ModelConfig
    objective_why: str                # where the objective comes from, e.g. "the SiT (Ma et al. 2024) release"
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    meta: LatentSpace | None = None   # the latent space the file itself carries (our exports)
    path: Path | None = None          # the file read, where the format chose it (a run folder's newest export)
    step: int | None = None
    label: str | None = None


@dataclass(frozen=True)
class WeightFormat:
    """One source of weights: how --ckpt is recognised as it and read, and what its weights mean."""

    name: str
    recognises: Callable[[Found], bool]
    reads: Callable[[Found, str, str | None], Read]       # (found, weights chosen, --objective) -> Read
    holds: Callable[[Found], tuple[tuple, str]]           # (the WEIGHTS it holds, () for one set; that in words)
    latents: Callable[[Found, Read], LatentSpace | None] = lambda found, read: None  # None: SD-VAE latents (DiT's)
    auto_guide: AutoGuide = AUTO_OWN  # what --guide-channels auto means: what its own sampler guides
    kind: str = "official"            # settings.json's identity.kind: export | official | diffusers
    config_from: str = "inferred from tensor shapes"  # where its architecture comes from
    damaged: str = ("The file is damaged (e.g. an interrupted download): delete it and download it again (the DiT "
                    "release's checkpoints come from {source}).")  # the end of the non-finite paragraph


# Run folders and exports: the config is in the file's metadata, the folder layout says which weights

def _held_by_place(found: Found) -> tuple[tuple, str]:
    """A run or checkpoint folder holds both sets; a file the one its place in the run folder layout says."""
    path = found.path
    if path.is_dir():
        return WEIGHTS, "both"
    if path.name == MODEL_FILE:
        return ("raw",), f"only the raw training weights (a checkpoint's {MODEL_FILE})"
    if path.name == EMA_FILE or path.parent.name == EXPORTS or step_of(path) is not None:
        return ("ema",), "only the EMA weights (an export)"
    return (), "one set of weights"


def run_weight_file(folder: Path, weights: str) -> tuple[Path, list[str]]:
    """(file, notes): a checkpoint folder's model/EMA file, or a run folder's newest whole export (raw: checkpoint)."""
    if (folder / MODEL_FILE).is_file() or (folder / EMA_FILE).is_file():  # a single RUN/checkpoints/step-* folder
        chosen = folder / (MODEL_FILE if weights == "raw" else EMA_FILE)
        if not chosen.is_file():
            raise UserError(f"{chosen} does not exist; the checkpoint folder is incomplete.")
        if problem := safetensors_problem(chosen):
            raise UserError(f"{chosen} is not a whole weight file ({problem}): it was cut short (an interrupted copy "
                            f"or a full disk) or is damaged. Delete it and use another weight file.")
        return chosen, []
    if weights == "raw":
        candidates, what = [c / MODEL_FILE for c in list_checkpoints(folder)], f"{CHECKPOINTS}/step-*/{MODEL_FILE}"
        none = (f"the run folder {folder} has no complete checkpoints ({CHECKPOINTS}/step-*/) yet; train until the "
                "first checkpoint is saved, or pass --weights ema for an export.")
    else:
        candidates, what = list_exports(folder), f"{EXPORTS}/ema-step-*.safetensors"
        none = (f"the run folder {folder} has no EMA exports ({EXPORTS}/ema-step-*) yet; train until the first export "
                "is written, or pass --weights raw to use the newest checkpoint's raw weights.")
    if not candidates:
        raise UserError(none)
    skipped = []
    for path in reversed(candidates):
        if (problem := safetensors_problem(path)) is None:
            return path, [f"the newer {p} is not a whole weight file ({why}); sampling {path.name} instead. "
                          f"{_other_copy(folder, p, weights, 'Delete the broken file to stop this note.')}"
                          for p, why in skipped]
        skipped.append((path, problem))
    newest, problem = skipped[0]
    fallback = (f"Delete {newest} and pass another --ckpt; training writes a new one at its next checkpoint "
                f"(--ckpt-every).")
    raise UserError(f"no whole {what} in {folder}: the newest, {newest}, is not a whole weight file ({problem}), and "
                    f"no earlier one is whole either. {_other_copy(folder, newest, weights, fallback)}")


def _other_copy(run: Path, path: Path, weights: str, otherwise: str) -> str:
    """Where else the EMA weights of a broken export are (its step's checkpoint), else `otherwise`."""
    step = step_of(path) if weights == "ema" else None
    folder = checkpoint_path(run, step) if step is not None else None
    if folder is not None and is_complete_checkpoint(folder) and safetensors_problem(folder / EMA_FILE) is None:
        return f"Its checkpoint holds the same EMA weights: pass --ckpt {folder} to sample that step."
    return otherwise


def _read_export(found: Found, weights: str, objective: str | None) -> Read:
    """Our safetensors file (a run folder's chosen one): config, latent metadata and step from its metadata."""
    path, notes = run_weight_file(found.path, weights) if found.path.is_dir() else (found.path, [])
    state_dict, config, _, step = load_weights(path)
    why = "the run that wrote this file, per its metadata"
    return Read(_strip_prefixes(state_dict), config, why, notes, notes, LatentSpace.read_file(path), path, step)


# Bare .pt state dicts of the releases: the config inferred from tensor shapes, the objective by name or layout

def _strip_prefixes(state_dict: dict) -> dict:
    """Drop a DDP/compile prefix shared by every key."""
    for prefix in _KEY_PREFIXES:
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def _held_entries(found: Found) -> tuple[tuple, str]:
    """A training checkpoint's 'ema' and 'model' entries (RAE's hold 'ema' only), or a bare state dict's one set."""
    obj = found.contents
    held = tuple(w for w, entry in ENTRIES.items() if isinstance(obj, dict) and isinstance(obj.get(entry), dict))
    return held, (f"only its '{ENTRIES[held[0]]}' entry" if held else "one set of weights: a bare state dict (the DiT "
                  "release's files hold the EMA weights), not a training checkpoint with 'ema' and 'model' entries")


def _tensors(found: Found, weights: str) -> dict:
    """The state dict of a torch file: the chosen entry of a training checkpoint, else the file's bare dict."""
    obj = found.contents
    if weights in ENTRIES and isinstance(obj, dict) and isinstance(obj.get(ENTRIES[weights]), dict):
        obj = obj[ENTRIES[weights]]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{found.path} does not hold a state dict of tensors. {_OFFICIAL_FIX}")
    return _strip_prefixes(obj)


def _read_dit(found: Found, weights: str, objective: str | None) -> Read:
    """DiT's and SiT's layout: the objective is the release's (by file name), else --objective, else DiT's DDPM."""
    state_dict, release, known, warnings = _tensors(found, weights), found.release, release_name(found.path.name), []
    if release is not None:
        named = "" if known == found.path.name else f", under the name its URL writes (ours: {known})"
        name, why = release.objective, f"the {release.paper} release{named}"
    elif objective is not None:
        name, why = objective, "as --objective says"
    else:  # a bare state dict records no objective: taken as DiT's, and said once
        name, why = DEFAULT_OBJECTIVE, "assumed: a bare state dict of no known release is taken as DiT's DDPM"
        warnings.append(f"{found.path.name} records no objective and is no known release: sampled as DiT's {name} "
                        f"objective (noise prediction); if it was trained with flow matching (SiT), pass --objective "
                        f"flow.")
    config = dataclasses.replace(infer_model_config(state_dict), objective=name)  # its plugins follow
    return Read(state_dict, config, why, warnings=warnings)


def _read_repa(found: Found, weights: str, objective: str | None) -> Read:
    """REPA's SiT-XL/2 (sihyun-yu/REPA models/sit.py): DiT's names plus its projector (dropped); flow, t = 0 at data."""
    full = _tensors(found, weights)
    projector = [k for k in full if k.startswith(REPA_PROJECTOR_PREFIX)]
    state_dict = {k: v for k, v in full.items() if k not in projector}
    config = dataclasses.replace(infer_model_config(state_dict), objective="flow",
                                 objective_args={"convention": "repa"}, sampling=dict(REPA_SAMPLING))
    low, high = REPA_SAMPLING["cfg_interval"]
    notes = [f"REPA layout: its projector ({len(projector)} tensors, {sum(full[k].numel() for k in projector):,} "
             f"parameters) is dropped; sampled as flow matching in REPA's time convention (t = 0 at data)",
             f"sampled as REPA's FID 1.42 command does unless a flag says otherwise: SiT's SDE, "
             f"{REPA_SAMPLING['num_sampling_steps']} steps, guidance only at noise levels {low:g}..{high:g}; its "
             f"guidance scale is --cfg-scale {REPA_CFG_SCALE:g} on all channels"]
    return Read(state_dict, config, "REPA's layout (its projector)", notes)


def _rae_tokens(config: ModelConfig) -> bool:
    """Whether a DiT^DH takes RAE's DINOv2-B tokens (decoded by RAE's released tokenizer)."""
    return [config.in_channels, config.input_size, config.input_size] == RAE_DIT_LATENTS["latent_shape"]


def _read_rae(found: Found, weights: str, objective: str | None) -> Read:
    """RAE's DiTwDDTHead layout: flow in RAE's time (1 = noise), the release's or the auto shift, RAE's ODE Euler."""
    state_dict = _tensors(found, weights)
    config = infer_model_config(state_dict)
    shift = (RELEASES[found.path.name].time_dist_shift if found.path.name in RELEASES
             else auto_shift((config.in_channels, config.input_size, config.input_size)))
    config = dataclasses.replace(config, objective="flow", sampling=dict(RAE_SAMPLING),
                                 objective_args={"convention": "repa", "time_dist_shift": shift})
    notes = [f"DiT^DH head {config.head_depth} x {config.head_width} wide; flow time convention repa, time shift "
             f"{shift:g} (shared/generative/flow.py)",
             f"sampled as RAE's sampling config does unless a flag says otherwise: ODE Euler over 50 grid points "
             f"({RAE_SAMPLING['num_sampling_steps']} steps) on the grid shifted by {shift:g}; its guidance scale is "
             f"--cfg-scale {RAE_CFG_SCALE:g} (none)"]
    if _rae_tokens(config):
        notes.append(f"tokens of RAE's {RAE_DIT_LATENTS['vae']} tokenizer (DINOv2-B with registers): decoded by its "
                     f"ViT-XL decoder after its ImageNet statistics unless --vae says otherwise")
    return Read(state_dict, config, "RAE's DiT^DH layout", notes)


def _read_lightningdit(found: Found, weights: str, objective: str | None) -> Read:
    """LightningDiT-XL/1 (hustvl/LightningDiT): our lightning block's names, as they are; SiT's flow (0 = noise)."""
    state_dict = _tensors(found, weights)
    config = infer_model_config(state_dict)
    if config.block != "lightning" or config.learn_sigma:
        raise UserError(f"{found.path} is not a LightningDiT release: its tensors describe the {config.block} block"
                        f"{' with learned sigma' if config.learn_sigma else ''}, LightningDiT's released models use "
                        f"the lightning block (RMSNorm, SwiGLU, RoPE) without learned sigma.")
    release = found.release
    config = dataclasses.replace(config, objective="flow", objective_args={"convention": "sit"},
                                 sampling=dict(release.sampling))
    notes = [f"a {release.paper} release in our {config.block} block (flow, time 0 = noise), decoded by VA-VAE with "
             f"its per-channel statistics",
             f"sampled as LightningDiT's config does unless a flag says otherwise (euler, time shift 0.3, guidance "
             f"interval 0 {config.sampling['cfg_interval'][1]:g}, the first 3 channels guided); its guidance scale "
             f"is --cfg-scale {release.cfg_scale:g}"]
    return Read(state_dict, config, f"the {release.paper} release", notes)


# diffusers DiTs: config.json says the architecture; the per-block embedder copies are checked equal

def _read_diffusers(found: Found, weights: str, objective: str | None) -> Read:
    """A diffusers DiT mapped exactly to our names (shared/network/diffusers_dit.py)."""
    source = found.diffusers
    full = check_dit_config(read_json(source.transformer / CONFIG), source.transformer)
    config = model_config_of(full, source.transformer)
    vae = (f"its pipeline's VAE {source.vae} unless --vae is given" if source.vae else
           "no pipeline VAE beside it (pass --vae)")
    numerics = (f"{NUMERICS_NOTE} Loaded here as the official DiT function, which is what the Hub's DiT weights were "
                f"trained as.")
    notes = [f"a diffusers {full['_class_name']} in {source.transformer}; {vae}", numerics]
    state_dict = diffusers_to_dit(read_weights(source.weights), full, source.transformer)
    return Read(state_dict, config, "a diffusers DiT, trained as DiT's", notes, [numerics], path=source.weights,
                label=source.label)


# The table, and the one loader that walks it

_OURS = dict(reads=_read_export, holds=_held_by_place, latents=lambda f, r: r.meta, kind="export",  # run folders, exports
             config_from="read from the file's metadata",
             damaged="Training diverged before these weights were saved, or the file is damaged: pass an earlier "
                     "export or checkpoint with --ckpt (RUN/exports/ema-step-*.safetensors, RUN/checkpoints/step-*).")
_REPA_ALL = AutoGuide("all", "REPA's sampler guides all channels")  # RAE's flow in REPA's time: the same rule


def _foreign_space(meta: dict | None) -> LatentSpace | None:
    """The space another project's release states in a few facts (LatentSpace.of_release), None when it states none."""
    return LatentSpace.of_release(meta) if meta else None


FORMATS: Registry[WeightFormat] = Registry("weight format", lambda f: f.reads.__module__)
for _fmt in (  # tried in this order: the first that recognises --ckpt reads it
    WeightFormat("diffusers", lambda f: f.diffusers is not None, _read_diffusers,
                 holds=lambda f: ((), "one set of weights (the Hub's DiT pipelines hold the EMA weights)"),
                 latents=lambda f, r: _foreign_space(pipeline_latent_meta(f.diffusers, r.config)),
                 auto_guide=AutoGuide("all", "diffusers' DiTPipeline guides all channels"), kind="diffusers",
                 config_from="read from its diffusers config",
                 damaged="The folder is damaged or its model diverged: download or export it again."),
    WeightFormat("run", lambda f: f.path.is_dir(), **_OURS),
    WeightFormat("export", lambda f: f.path.is_file() and not f.is_torch, **_OURS),
    WeightFormat("lightningdit", lambda f: f.is_torch and f.release is not None and f.release.layout == "lightningdit",
                 _read_lightningdit, _held_entries, lambda f, r: _foreign_space(f.release.latent_meta),
                 AutoGuide("3", "LightningDiT's sampler keeps the DiT release's rule: the first 3 channels",
                           every_width=True)),  # its forward_with_cfg guides 3 of its 32 channels
    WeightFormat("repa", lambda f: f.is_torch and any(k.startswith(REPA_PROJECTOR_PREFIX) for k in f.names),
                 _read_repa, _held_entries, auto_guide=_REPA_ALL),
    WeightFormat("rae", lambda f: f.is_torch and "s_embedder.proj.weight" in f.names, _read_rae, _held_entries,
                 lambda f, r: _foreign_space(RAE_DIT_LATENTS if _rae_tokens(r.config) else None), _REPA_ALL),
    WeightFormat("dit", lambda f: f.is_torch, _read_dit, _held_entries,  # DiT's and SiT's releases, any bare .pt
                 auto_guide=AutoGuide("3", "the DiT release's sampler guides the first 3 of 4 channels (SiT's keeps "
                                           "its rule)")),
):
    FORMATS.register(_fmt.name, _fmt)


def register_format(fmt: WeightFormat) -> None:
    """Add a weight source (e.g. from a --plugin module); it is tried before the built-in ones."""
    FORMATS.register(fmt.name, fmt, first=True)


def _choose_weights(found: Found, fmt: WeightFormat) -> str:
    """--weights when the file holds that set (default: EMA, else its one set); else one paragraph naming the fix."""
    held, words = fmt.holds(found)
    asked = found.weights
    if asked is None or asked in held:
        return asked or (held[0] if held else AS_SAVED)
    if asked == "ema" and not held:
        return AS_SAVED  # a file's one set is taken as its EMA weights (the releases' files hold theirs)
    if asked == "raw":
        fix = (f"For the raw training weights pass a checkpoint folder (RUN/{CHECKPOINTS}/step-N) or the run folder "
               f"with --weights raw, or RUN/{CHECKPOINTS}/step-N/{MODEL_FILE}; to sample this file, drop --weights.")
    else:
        fix = f"For the EMA weights pass its checkpoint folder ({found.path.parent}) or {EMA_FILE}; or drop --weights."
    raise UserError(f"--weights {asked} does not apply to {found.ckpt}: it holds {words}, so there are no {asked} "
                    f"weights in it to choose. {fix}")


def nonfinite_tensors(state_dict) -> Iterator[tuple[str, int, int]]:
    """(name, NaN/inf count, size) of each floating tensor, in key order, that is not all finite (lazily)."""
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            if bad := int((~torch.isfinite(tensor)).sum()):
                yield name, bad, tensor.numel()


def check_finite(loaded: LoadedWeights, fix: str) -> None:
    """UserError naming the file and its first tensor with NaN/inf values (they sample black or noise images)."""
    for name, count, size in nonfinite_tensors(loaded.state_dict):  # the first such tensor refused
        file = loaded.path.name
        source = checkpoint_url(file) if is_official_name(file) else "dl.fbaipublicfiles.com/DiT/models/"
        raise UserError(f"{loaded.path} holds non-finite weights: tensor {name} has {count} NaN/inf values of {size} "
                        f"(the first such tensor); sampling from it would give black or noise images. "
                        f"{fix.format(source=source)}")


def load_sampling_weights(ckpt, weights: str | None = None, model: str | None = None,
                          objective: str | None = None) -> LoadedWeights:
    """The weights --ckpt names, read by the first FORMATS record that recognises them; refuses contradicting flags."""
    if weights is not None and weights not in WEIGHTS:
        raise ChoiceError("weights", weights, WEIGHTS)
    if model is not None:
        check_preset(model)
    if objective is not None:
        check_objective(objective)
    official = not Path(ckpt).expanduser().exists() and is_official_name(str(ckpt))  # a name that is no path: fetched
    found = Found(ckpt, weights, *find_official(str(ckpt))) if official else Found(ckpt, weights)
    fmt = next((f for f in FORMATS.values() if f.recognises(found)), None)
    if fmt is None:
        raise UserError(f"--ckpt {found.path} does not exist; pass {_CKPT_KINDS}.")
    chosen = _choose_weights(found, fmt)
    read = fmt.reads(found, chosen, objective)
    config, path = read.config, read.path or found.path
    if objective is not None and objective != config.objective:
        raise UserError(f"--objective {objective} contradicts {path.name}: weights of {read.objective_why} are "
                        f"{config.objective} models; drop --objective.")
    if model is not None and model != config.model:
        raise UserError(f"--model {model} does not fit {path}: its architecture, {fmt.config_from}, is {config.model} "
                        f"(latent input {config.input_size}). Pass --model {config.model} or drop --model (the weights "
                        f"say their architecture themselves).")
    step = f", step {read.step}" if read.step is not None else ""
    shape = f"latent {config.in_channels}x{config.input_size}x{config.input_size}, {config.num_classes} classes"
    notes = [f"{config.model}, {shape}{step} ({'checked against --model' if model else fmt.config_from})",
             f"objective {config.objective} ({read.objective_why})", *read.notes, *found.notes]
    loaded = LoadedWeights(read.state_dict, config, path, fmt.kind, fmt.latents(found, read), read.step, notes,
                           chosen, [*read.warnings, *found.notes], read.label, fmt.auto_guide)
    check_finite(loaded, fmt.damaged)
    return loaded


def image_size_of(loaded: LoadedWeights, vae_factor: int, image_size: int | None) -> int:
    """Pixels per side the samples will have; UserError when --image-size disagrees with the weights."""
    size = loaded.config.input_size * vae_factor
    if image_size is not None and image_size != size:
        grid = loaded.config.input_size // PRESETS[loaded.config.model]["patch_size"]
        rope = (f" Its rotary position tables (block option rope) are built for that {grid}x{grid} token grid, so "
                "it cannot sample at another size.") if loaded.config.rope else ""
        raise UserError(f"--image-size {image_size} does not fit {loaded.path}: a latent input of "
                        f"{loaded.config.input_size} decoded by this VAE (x{vae_factor}) gives {size} pixels.{rope} "
                        f"Pass --image-size {size} or drop it.")
    return size


def build_sampling_model(loaded: LoadedWeights, device) -> torch.nn.Module:
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
