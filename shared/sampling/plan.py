"""What `python -m sample` is asked to do and its plan: the flags (`SampleOptions`), the class labels, the sampler
and guidance resolved from the flags and the weights' record, and the --out folder's names and checks, all settled
once (`make_plan`) before any model or VAE is loaded; shared/sampling/generate.py draws from the plan."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.generative.guidance import check_guidance, check_interval, describe_guidance, guide_channel_count
from shared.generative.objectives import check_sampling_guidance, objective_of
from shared.generative.samplers import SAMPLER_OPTIONS, resolve_sampling, sampler_options
from shared.network.models import DiT_models
from shared.runtime.cli import check_flag_bounds, option
from shared.runtime.errors import UserError
from shared.runtime.rerun import differences, listed
from shared.runtime.rundir import CHECKPOINTS, EMA_FILE, EXPORTS, MODEL_FILE
from shared.sampling.flags import BATCH_SIZE, SEED, DecodeFlags, SamplingFlags, given_sampler_options
from shared.tokenizers.space import LatentSpace, choose_tokenizer
from shared.weights.checkpoint import WEIGHTS, LoadedWeights, image_size_of, load_sampling_weights

# Settings that change no pixel: a rerun may change them and still resume the same images.
RUN_ONLY = ("num_samples", "batch_size", "out", "npz", "vae_slicing", "cpu", "tf32", "allow_other_vae", "compile")


@dataclass(frozen=True)
class LabelPlan:
    """How image i gets its class: cycle through `class_labels`, or draw it from the image generator."""
    num_classes: int
    class_labels: tuple[int, ...] | None = None  # None with random=False: all classes round-robin
    random: bool = False
    class_names: tuple[str, ...] | None = None   # from the latent metadata, for file names (None: unknown)

    def name_of(self, label: int) -> str | None:
        """The class name of `label`, when the metadata records names."""
        return self.class_names[label] if self.class_names and 0 <= label < len(self.class_names) else None

    def describe(self) -> str:
        """A short human description for settings.json."""
        if self.random:
            return f"random over {self.num_classes} classes from (seed, i)"
        if self.class_labels is None:
            return f"round-robin over all {self.num_classes} classes (label = i % {self.num_classes})"
        return f"cycled over {list(self.class_labels)}"


def class_index(value, class_names) -> int:
    """One --class-labels entry -> class index: digits are an index; a name matches exactly, then ignoring case."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    names = list(class_names or [])
    if not names:
        raise UserError(f"--class-labels {text!r} is a class name, but these weights record no class names (an "
                        f"official .pt has none); pass class indices instead, e.g. --class-labels 207 360.")
    if text in names:
        return names.index(text)
    folded = [i for i, name in enumerate(names) if name.casefold() == text.casefold()]
    if len(folded) == 1:
        return folded[0]
    close = [n for n in names if text.casefold() in n.casefold()][:5] or names[:5]
    which = "matches several classes when case is ignored" if folded else "is not a class name of these weights"
    raise UserError(f"--class-labels {text!r} {which}; names are matched exactly, then ignoring case. "
                    f"{len(names)} classes, e.g. {', '.join(repr(n) for n in close)}; pass one of them or a class "
                    f"index from 0 to {len(names) - 1}.")


def make_label_plan(class_labels, num_classes: int, random: bool, class_names=None) -> LabelPlan:
    """Validate --class-labels (indices or names) against the model's classes; UserError names the valid range."""
    if random and class_labels:
        raise UserError("--random-labels and --class-labels exclude each other: pass one of them.")
    names = tuple(str(n) for n in class_names) if class_names and len(class_names) == num_classes else None
    if class_labels:
        class_labels = [class_index(c, names) for c in class_labels]
        bad = [c for c in class_labels if not 0 <= c < num_classes]
        if bad:
            raise UserError(f"class labels {bad} are outside this model's classes [0, {num_classes}); pass "
                            f"--class-labels with values from 0 to {num_classes - 1}.")
        return LabelPlan(num_classes, tuple(int(c) for c in class_labels), False, names)
    return LabelPlan(num_classes, None, random, names)


@dataclass
class SampleOptions(DecodeFlags, SamplingFlags):
    """Everything `python -m sample` accepts (one field per flag: default and help; the sampling and VAE flags too)."""
    ckpt: str = option(help="training run folder (newest EMA export), a checkpoints/step-* folder, a .safetensors "
                            "export (config read from it), or an official DiT .pt/.pth state dict")
    weights: str | None = option(  # None: not given (EMA for folders; a file's own weights)
        None, "with a run or checkpoint folder (or an official training checkpoint holding both): the EMA weights or "
              "the raw training weights (default: ema; a file of one set is used as saved, and asking it for the "
              "other set is refused)", choices=WEIGHTS)
    model: str | None = option(None, "official .pt only: the preset (default: inferred from tensor shapes, and said)",
                               choices=tuple(DiT_models))
    objective: str | None = option(  # None: the release's objective, else ddpm
        None, "official .pt only: the objective the weights were trained with (default: the release's for a "
              "released name such as SiT-XL-2-256x256.pt, else ddpm); exports record their own")
    image_size: int | None = option(None, "official .pt only: image size in pixels, checked against latent size x "
                                          "VAE factor (default: not checked)")
    class_labels: list[str] | None = option(  # class indices or class names of the latent metadata
        None, "class indices, or class names recorded with the latents (matched exactly, then ignoring case), "
              "cycled over --num-samples (default: label i = i %% num_classes)", nargs="+", metavar="CLASS")
    random_labels: bool = option(False, "draw each image's class uniformly from its own (seed, i) generator instead")
    num_samples: int | None = option(None, "images to draw (default: one per --class-labels entry, else one per "
                                           "class)", aliases=("--num-fid-samples",), min=1)
    seed: int = SEED.field()
    batch_size: int = BATCH_SIZE.field(aliases=("--per-proc-batch-size",))
    tf32: bool = option(True, "disable TF32 matmuls on Ampere+ GPUs (on by default, as the DiT release)",
                        name="--no-tf32")
    out: str | None = option(None, "output folder (default: samples/<ckpt>-cfg<s>-<sampler><steps>-seed<seed>)",
                             aliases=("--sample-dir",))
    npz: bool = option(False, "also write samples.npz (arr_0 uint8 N x H x W x 3, labels) for FID tooling")


@dataclass
class SamplePlan:
    """Everything the command resolved once, before any model or VAE is loaded: from what, how, what and where."""
    options: SampleOptions  # the flags, with the sampler, steps and guidance interval used filled in
    loaded: LoadedWeights  # the checkpoint read: state dict, ModelConfig, step, notes
    space: LatentSpace  # the weights' latent space (official weights: one known only by its channels)
    objective: object  # shared/generative/objectives.py, as the weights record it
    sampler: str  # the sampler used (the objective's default when --sampler is not given)
    sampler_options: dict  # that sampler's options, defaulted
    guide_channels: int | None  # the latent channels guided (None: all); scale, precision, interval: options
    labels: LabelPlan
    vae_name: str
    image_size: int
    num_samples: int
    out: Path
    recorded_notes: tuple = ()  # the sampling settings taken from the model's record (printed in one line)
    settings: dict = dataclasses.field(default_factory=dict)  # settings.json: {"identity", "run"}

    @property
    def latent_shape(self) -> tuple:
        """(C, h, w) of one image's latent."""
        config = self.loaded.config
        return config.in_channels, config.input_size, config.input_size


def ckpt_label(path: Path) -> str:
    """A short name for a weight file: RUN-ema-step-X for exports, RUN-step-X-model for checkpoints."""
    path = path.resolve()
    if path.parent.name == EXPORTS:
        return f"{path.parent.parent.name}-{path.stem}"
    if path.name in (MODEL_FILE, EMA_FILE) and path.parent.parent.name == CHECKPOINTS:
        return f"{path.parent.parent.parent.name}-{path.parent.name}-{path.stem}"
    return path.stem


def default_out(o: SampleOptions, loaded: LoadedWeights, sampler: str, options: dict) -> Path:
    """samples/<ckpt>-cfg<s>[-int<lo>-<hi>]-<sampler><steps>[-eta<e>][-shift<s>][-last<h>]-seed<seed>: one folder per
    setting (an option at its default adds nothing, so folders named before it existed still match)."""
    extra = "".join(f"-{spec.tag}{options[name]:g}" for name, spec in SAMPLER_OPTIONS.items()
                    if name in options and options[name] != spec.default)
    interval = f"-int{o.cfg_interval[0]:g}-{o.cfg_interval[1]:g}" if o.cfg_interval else ""
    label = loaded.label or ckpt_label(loaded.path)
    return Path("samples") / f"{label}-cfg{o.cfg_scale:g}{interval}-{sampler}{o.num_sampling_steps}{extra}-seed{o.seed}"


def make_settings(plan: SamplePlan) -> dict:
    """{"identity": what fixes the pixels (compared on resume), "run": the rest}; JSON-normalised."""
    o, loaded = plan.options, plan.loaded
    skip = ("ckpt", "vae", "vae_config", "class_labels", "random_labels", "model", "objective", "image_size", "plugin")
    options = {k: v for k, v in asdict(o).items() if k not in skip}
    # What was used, not asked: every sampler option named, None where the sampler does not take it.
    options.update(weights=loaded.weights, sampler=plan.sampler,
                   **{k: plan.sampler_options.get(k) for k in SAMPLER_OPTIONS},
                   cfg_interval=list(o.cfg_interval) if o.cfg_interval else None,
                   guide_channels="all" if plan.guide_channels is None else str(plan.guide_channels))
    identity = {"ckpt": str(loaded.path.resolve()), "ckpt_bytes": loaded.path.stat().st_size, "step": loaded.step,
                "kind": loaded.kind, "model": loaded.config.to_dict(), "image_size": plan.image_size,
                "vae": plan.vae_name, "labels": plan.labels.describe(),
                **{k: v for k, v in options.items() if k not in RUN_ONLY}}
    run = {k: v for k, v in options.items() if k in RUN_ONLY}
    run.update(num_samples=plan.num_samples, out=str(plan.out), notes=loaded.notes,
               guidance=describe_guidance(o.guide_channels, loaded.config.in_channels, o.cfg_scale, o.cfg_interval,
                                          plan.objective.level_unit, loaded.auto_guide)
               if not loaded.config.guidance_inputs else  # improved MeanFlow: an input, not a [cond; null] batch
               f"guidance: cfg scale {o.cfg_scale:g} fed to the network with the interval "
               f"{list(o.cfg_interval or (0, 1))} (improved MeanFlow: one call per step at any scale)")
    return json.loads(json.dumps({"identity": identity, "run": run}))


def make_plan(o: SampleOptions) -> SamplePlan:
    """Check every input and read the weights, resolving each object once; loads no VAE and builds no model."""
    check_flag_bounds(o)  # flags no run can use, before any loading; again here for options built in Python (evaluate)
    if o.sampler is not None:
        sampler_options(o.sampler, given_sampler_options(o))  # an unknown sampler, or an option it does not take
    if o.cfg_interval is not None and o.cfg_scale == 1.0:
        raise UserError("--cfg-interval limits guidance to a range of noise levels, but --cfg-scale is 1 (no "
                        "guidance); pass a --cfg-scale above 1, or drop --cfg-interval.")
    if o.out:
        check_out_path(Path(o.out), "sampling")  # a file or an image name as --out: refused before any loading
    loaded = load_sampling_weights(o.ckpt, o.weights, o.model, o.objective)
    config = loaded.config
    objective = objective_of(config)
    used = resolve_sampling(objective, o.sampler, given_sampler_options(o), o.cfg_interval, config.sampling,
                            guided=o.cfg_scale != 1.0, steps=o.num_sampling_steps)
    objective.process(used.sampler, used.steps, used.options)  # SettingError, e.g. 1000 steps of the linspace spacing
    o = dataclasses.replace(o, sampler=used.sampler, num_sampling_steps=used.steps, cfg_interval=used.cfg_interval)
    loaded.notes.extend(used.notes)
    check_interval(o.cfg_interval, objective.level_range, objective.level_unit, objective.name)
    check_guidance(o.cfg_scale, config.has_null_class)
    check_sampling_guidance(objective, o.cfg_scale, o.cfg_interval)  # MeanFlow: folded in; iMF: the trained range
    guided = guide_channel_count(o.guide_channels, config.in_channels, loaded.auto_guide)
    space = LatentSpace.or_unknown(loaded.space, config.in_channels)  # official weights record none
    labels = make_label_plan(o.class_labels, config.num_classes, o.random_labels, list(space.class_names) or None)
    spec, how = choose_tokenizer(o.vae, loaded.space)
    vae_name, factor = space.check_tokenizer_config(spec, o.vae_config, o.allow_other_vae)
    loaded.notes.append(f"VAE {vae_name} ({how})")
    num_samples = o.num_samples or len(o.class_labels or []) or labels.num_classes  # else one per label, or class
    plan = SamplePlan(o, loaded, space, objective, o.sampler, used.options, guided, labels, vae_name,
                      image_size_of(loaded, factor, o.image_size), num_samples,
                      Path(o.out) if o.out else default_out(o, loaded, o.sampler, used.options), tuple(used.notes))
    plan.settings = make_settings(plan)
    check_out_dir(plan.out, plan.settings)
    return plan


SETTINGS_NAME = "settings.json"
GRID_NAME = "grid.png"
NPZ_NAME = "samples.npz"
_PNG_RE = re.compile(r"^(\d{6,})-class(\d+)(-[\w.-]+)?\.png$")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def check_out_path(out: Path, what: str) -> None:
    """UserError unless --out can be a folder: not an existing file, not a name ending like an image file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, but {what} writes a folder (one PNG per image plus {GRID_NAME}); "
                        f"pass a folder path to --out, e.g. {out.with_suffix('')}.")
    if not out.exists() and out.suffix.lower() in IMAGE_SUFFIXES:
        raise UserError(f"--out {out} names an image file, but {what} writes a folder (one PNG per image plus "
                        f"{GRID_NAME}, which is the picture of them all); pass a folder path to --out, e.g. "
                        f"{out.with_suffix('')}, and open {out.with_suffix('') / GRID_NAME}.")


def check_out_dir(out: Path, settings: dict) -> None:
    """UserError if `out` cannot be a folder or holds images of a run whose settings.json identity differs from ours."""
    out = Path(out)
    check_out_path(out, "sampling")
    if not out.exists():
        return
    path = out / SETTINGS_NAME
    if not path.exists():
        if any(_PNG_RE.match(p.name) for p in out.iterdir()):
            raise UserError(f"--out {out} already holds sample PNGs but no {SETTINGS_NAME}, so they cannot be "
                            f"resumed safely; pass a new --out folder or empty this one.")
        return
    try:
        previous = json.loads(path.read_text())["identity"]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a settings file written by `python -m sample` ({err}); "
                        f"pass a new --out folder or delete it.") from err
    differ = differences(previous, settings["identity"], nested=False)
    if differ:
        raise UserError(
            f"--out {out} holds images of another run ({listed(differ)}). Resuming would mix two runs' images: "
            f"pass a new --out folder, or rerun with the settings recorded in {path}.")
