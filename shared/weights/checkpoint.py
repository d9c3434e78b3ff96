"""Find and read the DiT weights --ckpt names: a run folder, a slim export, an official .pt state dict (a released
one by name, downloaded once), or a diffusers DiT (pipeline folder, transformer folder or file, Hub repo id)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.generative.guidance import (AUTO_DIFFUSERS, AUTO_DIT, AUTO_LIGHTNINGDIT, AUTO_OWN, AUTO_REPA,
                                       AUTO_SIT, AutoGuide)
from shared.generative.objectives import DEFAULT_OBJECTIVE, check_objective, plugin_of
from shared.network.diffusers_dit import NUMERICS_NOTE, check_dit_config, diffusers_to_dit, model_config_of
from shared.runtime.errors import ChoiceError, UserError
from shared.runtime.export import first_nonfinite, load_torch_file, load_weights, safetensors_problem
from shared.network.models import PRESETS, ModelConfig, check_preset, infer_model_config
from shared.network.repa import repa_release_config, split_repa_release
from shared.tokenizers.rae_release import RAE_DIT_LATENTS
from shared.runtime.rundir import (CHECKPOINTS, EMA_FILE, EXPORTS, MODEL_FILE, checkpoint_path, is_complete_checkpoint,
                           list_checkpoints, list_exports, step_of)

from shared.weights.diffusers_folder import (CONFIG, DiffusersSource, class_names, is_diffusers_file,
                                             is_diffusers_folder, locate, locate_hub, looks_like_hub_id, read_json,
                                             read_weights)
from shared.weights.official import (OFFICIAL_NAMES, RAE_CFG_SCALE, RAE_SAMPLING, RELEASES, REPA_CFG_SCALE,
                                     REPA_SAMPLING, checkpoint_url, find_official, is_official_name, release_name)

TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")  # read with torch.load(weights_only=True); all else safetensors
WEIGHTS = ("ema", "raw")  # which weights of a run or checkpoint: the EMA copy or the raw training weights
AS_SAVED = "as saved"     # what settings.json records for a file holding one set of weights of unknown kind
# Wrappers some trainers leave in front of every key (DDP, torch.compile).
_KEY_PREFIXES = ("module.", "_orig_mod.")
_OFFICIAL_FIX = ("Pass an official DiT checkpoint (downloaded from dl.fbaipublicfiles.com/DiT/models/, e.g. "
                 "DiT-XL-2-256x256.pt) or a .safetensors export of this project.")
# A bare state dict records no objective: unless its name or layout says, it is taken as DiT's, and said once.
ASSUMED_DDPM = "assumed: a bare state dict of no known release is taken as DiT's DDPM"
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
    latent_meta: dict | None = None   # None for official checkpoints
    step: int | None = None
    notes: list[str] = field(default_factory=list)  # what was inferred; printed for the user
    weights: str = AS_SAVED           # what was loaded: "ema", "raw", or AS_SAVED (a file's only set)
    warnings: list[str] = field(default_factory=list)  # what the user must see (e.g. a broken newer export skipped)
    label: str | None = None          # short name for default output folders (None: from the file's path)
    auto_guide: AutoGuide = AUTO_OWN  # what --guide-channels auto means: what these weights' own sampler does


@dataclass
class WeightSource:
    """The file --ckpt resolves to, which weights it holds, and what the resolution had to say."""

    path: Path
    weights: str | None               # "ema" | "raw" | AS_SAVED; None: chosen inside an official .pt
    notes: list[str] = field(default_factory=list)


def held_weights(path: Path) -> str | None:
    """Which weights a file holds, from its place in the run folder layout (None: an official .pt decides)."""
    if path.suffix.lower() in TORCH_SUFFIXES:
        return None
    if path.name == MODEL_FILE:
        return "raw"
    if path.name == EMA_FILE or path.parent.name == EXPORTS or step_of(path) is not None:
        return "ema"
    return AS_SAVED


def resolve_ckpt(ckpt, weights: str | None = None) -> WeightSource:
    """--ckpt (run folder, checkpoint folder or file) and --weights (None: not given) -> the file to read."""
    path = Path(ckpt).expanduser()
    if not path.exists() and is_official_name(str(ckpt)):
        found, notes = find_official(str(ckpt))
        return WeightSource(found, None, notes)
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist; pass {_CKPT_KINDS}.")
    if path.is_file():
        held = held_weights(path)
        if weights is not None and held is not None and weights != held and not (held == AS_SAVED and weights == "ema"):
            raise _weights_do_not_apply(path, weights, held)
        return WeightSource(path, held)
    if (path / MODEL_FILE).is_file() or (path / EMA_FILE).is_file():  # a single RUN/checkpoints/step-* folder
        chosen = path / (MODEL_FILE if weights == "raw" else EMA_FILE)
        _check_whole(chosen, "")
        return WeightSource(chosen, weights or "ema")
    return _newest_whole(path, weights or "ema")


def resolve_ckpt_file(ckpt, weights: str | None = None) -> Path:
    """The weight file --ckpt and --weights resolve to."""
    return resolve_ckpt(ckpt, weights).path


def _weights_do_not_apply(path: Path, asked: str, held: str) -> UserError:
    """--weights asked for a set of weights the file does not hold."""
    if held == "raw":
        return UserError(f"--weights {asked} does not apply to {path}: a checkpoint's {MODEL_FILE} holds the raw "
                         f"training weights only. For the EMA weights pass its folder ({path.parent}) or its "
                         f"{EMA_FILE}; or drop --weights.")
    folder = f"RUN/{CHECKPOINTS}/step-N"
    return UserError(f"--weights {asked} does not apply to {path}: an export holds only the EMA weights, so there "
                     f"are no raw weights in it to choose. For the raw training weights pass a checkpoint folder "
                     f"({folder}) or the run folder with --weights raw, or {folder}/{MODEL_FILE}; to sample this "
                     f"file, drop --weights.")


def _check_whole(path: Path, advice: str) -> None:
    """UserError when a safetensors weight file is missing or not whole."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; the checkpoint folder is incomplete. {advice}".strip())
    problem = safetensors_problem(path)
    if problem:
        raise UserError(f"{path} is not a whole weight file ({problem}): it was cut short (an interrupted copy or a "
                        f"full disk) or is damaged. Delete it and use another weight file. {advice}".strip())


def _newest_whole(run: Path, weights: str) -> WeightSource:
    """The newest whole export (or checkpoint weights with --weights raw) of a run; incomplete newer ones are noted."""
    if weights == "raw":
        candidates, what = [c / MODEL_FILE for c in list_checkpoints(run)], f"{CHECKPOINTS}/step-*/{MODEL_FILE}"
    else:
        candidates, what = list_exports(run), f"{EXPORTS}/ema-step-*.safetensors"
    if not candidates:
        raise _nothing_to_sample(run, weights)
    skipped = []
    for path in reversed(candidates):
        problem = safetensors_problem(path)
        if problem is None:
            notes = [f"the newer {p} is not a whole weight file ({why}); sampling {path.name} instead. "
                     f"{_other_copy(run, p, weights, 'Delete the broken file to stop this note.')}" for p, why in skipped]
            return WeightSource(path, weights, notes)
        skipped.append((path, problem))
    newest, problem = skipped[0]
    fallback = (f"Delete {newest} and pass another --ckpt; training writes a new one at its next checkpoint "
                f"(--ckpt-every).")
    raise UserError(f"no whole {what} in {run}: the newest, {newest}, is not a whole weight file ({problem}), and no "
                    f"earlier one is whole either. {_other_copy(run, newest, weights, fallback)}")


def _other_copy(run: Path, path: Path, weights: str, otherwise: str) -> str:
    """Where else the EMA weights of a broken export are (its step's checkpoint), else `otherwise`."""
    step = step_of(path) if weights == "ema" else None
    folder = checkpoint_path(run, step) if step is not None else None
    if folder is not None and is_complete_checkpoint(folder) and safetensors_problem(folder / EMA_FILE) is None:
        return f"Its checkpoint holds the same EMA weights: pass --ckpt {folder} to sample that step."
    return otherwise


def _nothing_to_sample(run: Path, weights: str) -> UserError:
    """A run folder without the weights asked for."""
    if weights == "raw":
        return UserError(f"the run folder {run} has no complete checkpoints ({CHECKPOINTS}/step-*/) yet; train "
                         "until the first checkpoint is saved, or pass --weights ema for an export.")
    return UserError(f"the run folder {run} has no EMA exports ({EXPORTS}/ema-step-*) yet; train until the first "
                     "export is written, or pass --weights raw to use the newest checkpoint's raw weights.")


def _check_model_flag(model: str | None, config: ModelConfig, refusal) -> None:
    """--model, when given, must name the preset the weights hold; refusal() is the paragraph (each loader's words)."""
    if model is not None and model != config.model:
        raise UserError(refusal())


def _shape_note(config: ModelConfig) -> str:
    """'DiT-XL/2, latent 4x32x32, 1000 classes': the note every loader starts with."""
    return (f"{config.model}, latent {config.in_channels}x{config.input_size}x{config.input_size}, "
            f"{config.num_classes} classes")


def _strip_prefixes(state_dict: dict) -> dict:
    """Drop a DDP/compile prefix shared by every key."""
    for prefix in _KEY_PREFIXES:
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def _pick_state_dict(obj, path: Path, weights: str | None) -> tuple[dict, str]:
    """(state dict, which) of a bare state dict, or of the 'ema'/'model' entry of a full official training checkpoint."""
    which = AS_SAVED
    if isinstance(obj, dict) and isinstance(obj.get("ema"), dict) and isinstance(obj.get("model"), dict):
        which = weights or "ema"
        obj = obj["ema" if which == "ema" else "model"]
    elif isinstance(obj, dict) and isinstance(obj.get("ema"), dict) and weights != "raw":
        obj = obj["ema"]  # RAE's training checkpoints as its instantiate_from_config reads them
    elif weights == "raw":
        raise UserError(f"--weights raw does not apply to {path}: it is a bare state dict holding one set of weights "
                        f"(the DiT release's files hold the EMA weights), not a training checkpoint with 'ema' and "
                        f"'model' entries. Drop --weights to sample it.")
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{path} does not hold a state dict of tensors. {_OFFICIAL_FIX}")
    return _strip_prefixes(obj), which


def _objective_of_release(path: Path, objective: str | None) -> tuple[str, str]:
    """(objective, how it was chosen) of a bare state dict: --objective, else its release's, else ddpm (DiT's)."""
    known = release_name(path.name)
    release = RELEASES[known] if known else None
    if objective is not None:
        check_objective(objective)
        if release is not None and objective != release.objective:
            raise UserError(f"--objective {objective} contradicts {path.name}, a {release.paper} release trained with "
                            f"the {release.objective} objective; drop --objective.")
        return objective, "as --objective says"
    if release is not None:
        named = "" if known == path.name else f", under the name its URL writes (ours: {known})"
        return release.objective, f"the {release.paper} release{named}"
    return DEFAULT_OBJECTIVE, ASSUMED_DDPM


def _rae_config(config, path: Path, objective: str | None):
    """A DiT^DH state dict's objective: flow, RAE's time (REPA's convention), the release's or RAE's auto shift."""
    from shared.generative.flow import auto_shift

    if objective not in (None, "flow"):
        raise UserError(f"--objective {objective} contradicts {path.name}: weights in RAE's DiT^DH layout are flow "
                        "models (RAE's transport); drop --objective.")
    release = RELEASES.get(path.name)
    shape = (config.in_channels, config.input_size, config.input_size)
    shift = release.time_dist_shift if release is not None else auto_shift(shape)
    # RAE's sampling configs all sample its DiT^DH with its ODE Euler over 50 points: any file of its layout does too.
    return dataclasses.replace(config, objective="flow", objective_args={"convention": "repa", "time_dist_shift": shift},
                               sampling=dict(RAE_SAMPLING))


def _load_official(path: Path, weights: str | None, model: str | None, objective: str | None = None) -> LoadedWeights:
    """A bare state dict: config inferred from tensor shapes (checked against --model), objective by release."""
    # Official training checkpoints (the DiT release's train.py) also pickle their argparse Namespace.
    obj = load_torch_file(path, _OFFICIAL_FIX, allowed=[argparse.Namespace])
    release = RELEASES.get(path.name)
    if release is not None and release.layout == "lightningdit":
        return _load_lightningdit(obj, path, release, model)
    state_dict, which = _pick_state_dict(obj, path, weights)
    state_dict, repa_notes = split_repa_release(state_dict)  # REPA's layout: projector dropped
    config = infer_model_config(state_dict)
    if repa_notes:  # REPA's layout says what it is: flow in REPA's time convention, sampled as REPA's FID command
        config = dataclasses.replace(repa_release_config(config), sampling=dict(REPA_SAMPLING))
        name, why = "flow", "REPA's layout (its projector)"
    elif config.head_depth:  # RAE's DiTwDDTHead layout: its transport, flow in RAE's time (1 = noise) and its shift
        config, name, why = _rae_config(config, path, objective), "flow", "RAE's DiT^DH layout"
    else:
        name, why = _objective_of_release(path, objective)
        config = dataclasses.replace(config, objective=name, objective_plugin=plugin_of(name))
    _check_model_flag(model, config, lambda: f"--model {model} does not fit {path}: its tensor shapes are those of "
                      f"{config.model} (latent input {config.input_size}). Pass --model {config.model} or drop --model.")
    how = "checked against --model" if model else "inferred from tensor shapes"
    notes = [f"{_shape_note(config)} ({how})", f"objective {name} ({why})", *repa_notes]
    if config.head_depth:
        notes.append(f"DiT^DH head {config.head_depth} x {config.head_width} wide; flow time convention "
                     f"{config.objective_args['convention']}, time shift {config.objective_args['time_dist_shift']:g} "
                     "(shared/generative/flow.py)")
        notes.append(f"sampled as RAE's sampling config does unless a flag says otherwise: ODE Euler over 50 grid "
                     f"points ({config.sampling['num_sampling_steps']} steps) on the grid shifted by "
                     f"{config.objective_args['time_dist_shift']:g}; its guidance scale is --cfg-scale {RAE_CFG_SCALE:g} (none)")
    elif repa_notes:
        notes.append(f"sampled as REPA's FID 1.42 command does unless a flag says otherwise: SiT's SDE, "
                     f"{config.sampling['num_sampling_steps']} steps, guidance only at noise levels "
                     f"{config.sampling['cfg_interval'][0]:g}..{config.sampling['cfg_interval'][1]:g}; its guidance "
                     f"scale is --cfg-scale {REPA_CFG_SCALE:g} on all channels")
    latent_meta = None  # DiT's, SiT's and REPA's: SD-VAE latents
    if config.head_depth and [config.in_channels, config.input_size, config.input_size] == \
            RAE_DIT_LATENTS["latent_shape"]:  # RAE's DINOv2-B tokens: decoded by RAE's released tokenizer
        latent_meta = dict(RAE_DIT_LATENTS)
        notes.append(f"tokens of RAE's {latent_meta['vae']} tokenizer (DINOv2-B with registers): decoded by its ViT-XL "
                     f"decoder after its ImageNet statistics unless --vae says otherwise")
    warnings = [] if why != ASSUMED_DDPM else [
        f"{path.name} records no objective and is no known release: sampled as DiT's ddpm objective (noise "
        f"prediction); if it was trained with flow matching (SiT), pass --objective flow."]
    return LoadedWeights(state_dict, config, path, "official", latent_meta, notes=notes, weights=which,
                         warnings=warnings, auto_guide=_auto_guide_of_release(config))


def _auto_guide_of_release(config: ModelConfig) -> AutoGuide:
    """What the sampler of a bare state dict's origin guides: REPA's all channels, DiT's and SiT's the first 3."""
    if config.objective == "flow":
        return AUTO_REPA if config.objective_args.get("convention") == "repa" else AUTO_SIT
    return AUTO_DIT


def _load_lightningdit(obj, path: Path, release, model: str | None) -> LoadedWeights:
    """A LightningDiT release: its EMA weights in our lightning block, decoded by VA-VAE (lightningdit.py beside)."""
    from shared.weights.lightningdit import CFG_SCALES, lightningdit_state_dict, release_model_config

    state_dict = lightningdit_state_dict(obj, path)
    config = release_model_config(state_dict, path)
    _check_model_flag(model, config, lambda: f"--model {model} does not fit {path}: its tensor shapes are those of "
                      f"{config.model}. Pass --model {config.model} or drop --model.")
    notes = [f"{config.model} ({config.block} block), latent {config.in_channels}x{config.input_size}x"
             f"{config.input_size}, {config.num_classes} classes: a {release.paper} release (flow, time 0 = noise), "
             f"decoded by VA-VAE with its per-channel statistics",
             f"sampled as LightningDiT's config does unless a flag says otherwise (euler, time shift 0.3, guidance "
             f"interval 0 {config.sampling['cfg_interval'][1]:g}, the first 3 channels guided); its guidance scale "
             f"is --cfg-scale {CFG_SCALES.get(path.name, 6.7):g}"]
    # LightningDiT's forward_with_cfg keeps DiT's quirk: only the first 3 channels (of 32) are guided.
    return LoadedWeights(state_dict, config, path, "official", dict(release.latent_meta), notes=notes,
                         weights="ema", auto_guide=AUTO_LIGHTNINGDIT)


def _load_export(path: Path, model: str | None, held: str) -> LoadedWeights:
    """Our safetensors export: config and latent metadata from the file, nothing inferred."""
    state_dict, config, latent_meta, step = load_weights(path)
    _check_model_flag(model, config, lambda: f"--model {model} contradicts {path}, which holds {config.model} weights "
                      "(read from its metadata); drop --model, it is only needed for official .pt checkpoints.")
    return LoadedWeights(_strip_prefixes(state_dict), config, path, "export", latent_meta, step,
                         [f"{config.model} step {step} (config read from the file's metadata)"], held)


def find_diffusers(ckpt) -> DiffusersSource | None:
    """The diffusers DiT --ckpt names (folder, weight file, or Hub id when no such path exists), else None."""
    path = Path(ckpt).expanduser()
    if path.is_dir():
        return locate(path) if is_diffusers_folder(path) else None
    if path.is_file():
        return locate(path) if is_diffusers_file(path) else None
    text = str(ckpt)
    # owner/name with no folder "owner" here: a Hub id (a mistyped local path gets the same paragraph's advice).
    if looks_like_hub_id(text) and not is_official_name(text) and not path.parent.exists():
        return locate_hub(text)
    return None


def _pipeline_latent_meta(source: DiffusersSource, config: ModelConfig) -> dict | None:
    """What the pipeline says of its latents: its own vae/ (used when --vae is omitted) and class names."""
    meta = {"latent_shape": [config.in_channels, config.input_size, config.input_size]}
    if source.vae is not None:
        meta["vae"] = str(source.vae.resolve())
        vae_config = read_json(source.vae / CONFIG)
        if "scaling_factor" in vae_config:
            meta["scaling_factor"] = float(vae_config["scaling_factor"])
    names = class_names(source, config.num_classes)
    if names:
        meta["class_names"] = names
    return meta if len(meta) > 1 else None


def _load_diffusers(source: DiffusersSource, weights: str | None, model: str | None) -> LoadedWeights:
    """A diffusers DiT: config checked, per-block embedder copies verified equal, mapped exactly to our names."""
    if weights == "raw":
        raise UserError(f"--weights raw does not apply to the diffusers DiT {source.origin}: it holds one set of "
                        f"weights (the Hub's DiT pipelines hold the EMA weights). Drop --weights to sample it.")
    where = source.transformer
    full = check_dit_config(read_json(source.transformer / CONFIG), where)
    config = model_config_of(full, where)
    _check_model_flag(model, config, lambda: f"--model {model} contradicts {where}, whose config.json describes "
                      f"{config.model}; drop --model, a diffusers folder says its architecture itself.")
    state_dict = diffusers_to_dit(read_weights(source.weights), full, where)
    meta = _pipeline_latent_meta(source, config)
    vae = f"its pipeline's VAE {source.vae} unless --vae is given" if source.vae else \
        "no pipeline VAE beside it (pass --vae)"
    notes = [f"{_shape_note(config)} (read from the diffusers {full['_class_name']} config in {where}; "
             f"{vae})", f"{NUMERICS_NOTE} Loaded here as the official DiT function, which is what the Hub's DiT "
                        f"weights were trained as."]
    return LoadedWeights(state_dict, config, source.weights, "diffusers", meta, None, notes, AS_SAVED,
                         warnings=[notes[-1]], label=source.label, auto_guide=AUTO_DIFFUSERS)


def check_finite(loaded: LoadedWeights) -> None:
    """UserError naming the file and its first tensor with NaN/inf values (they sample black or noise images)."""
    bad = first_nonfinite(loaded.state_dict)
    if bad is None:
        return
    name, count, size = bad
    if loaded.kind == "official":
        file = loaded.path.name
        where = checkpoint_url(file) if is_official_name(file) else "dl.fbaipublicfiles.com/DiT/models/"
        fix = (f"The file is damaged (e.g. an interrupted download): delete it and download it again (the DiT "
               f"release's checkpoints come from {where}).")
    elif loaded.kind == "diffusers":
        fix = "The folder is damaged or its model diverged: download or export it again."
    else:
        fix = ("Training diverged before these weights were saved, or the file is damaged: pass an earlier export "
               "or checkpoint with --ckpt (RUN/exports/ema-step-*.safetensors, RUN/checkpoints/step-*).")
    raise UserError(f"{loaded.path} holds non-finite weights: tensor {name} has {count} NaN/inf values of {size} "
                    f"(the first such tensor); sampling from it would give black or noise images. {fix}")


def load_sampling_weights(ckpt, weights: str | None = None, model: str | None = None,
                          objective: str | None = None) -> LoadedWeights:
    """Resolve --ckpt, read its state dict and ModelConfig, refuse non-finite weights (no model is built yet)."""
    if weights is not None and weights not in WEIGHTS:
        raise ChoiceError("weights", weights, WEIGHTS)
    if model is not None:
        check_preset(model)
    diffusers = find_diffusers(ckpt)
    if diffusers is not None:
        loaded = _load_diffusers(diffusers, weights, model)
    else:
        source = resolve_ckpt(ckpt, weights)
        if source.path.suffix.lower() in TORCH_SUFFIXES:
            loaded = _load_official(source.path, weights, model, objective)
        else:
            loaded = _load_export(source.path, model, source.weights)
        loaded.notes.extend(source.notes)
        loaded.warnings.extend(source.notes)
    check_finite(loaded)
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
