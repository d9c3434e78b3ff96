"""`python -m sample`'s code path (also `python -m evaluate run`'s): class-conditional DiT sampling (CFG; DDPM, DDIM
or an ODE solver) decoded to PNGs, grid, npz in the --out folder; its PNG and grid writers serve `python -m sample
decode` and `watch`."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from shared.runtime.cli import check_flag_bounds, option
from shared.runtime.distributed import process_state
from shared.runtime.errors import UserError
from shared.sampling.flags import BATCH_SIZE, SEED, DecodeFlags, SamplingFlags, given_sampler_options
from shared.generative.guidance import (GuidedModelFn, check_guidance, check_interval, describe_guidance,
                                       guide_channel_count)
from shared.generative.objectives import check_sampling_guidance, objective_of
from shared.generative.samplers import SAMPLER_OPTIONS, resolve_sampling, sampler_options
from shared.runtime.fsio import TMP_PREFIX, atomic_write, atomic_write_text
from shared.runtime.lock import hold_lock
from shared.network.models import DiT_models
from shared.runtime.precision import PRECISIONS, set_tf32
from shared.runtime.rerun import differences, listed
from shared.runtime.rundir import CHECKPOINTS, EMA_FILE, EXPORTS, MODEL_FILE
from shared.runtime.seeding import generator_for
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace, choose_tokenizer

from shared.sampling.compiled import check_compile, compile_for_sampling
from shared.weights.checkpoint import (WEIGHTS, LoadedWeights, build_sampling_model, image_size_of,
                                       load_sampling_weights)

# Settings that change no pixel: a rerun may change them and still resume the same images.
RUN_ONLY = ("num_samples", "batch_size", "out", "npz", "vae_slicing", "cpu", "tf32", "allow_other_vae", "compile")


# ---- Per-image randomness ----
# Image i's class label, noise and sampler noise come from one generator seeded by (seed, i): so results do not
# depend on the batch size, the process, or which images were on disk when a run resumed.

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


def image_rng(plan: LabelPlan, seed: int, index: int) -> tuple[int, torch.Generator]:
    """Image `index`'s class label and its generator, positioned after the label draw."""
    generator = generator_for(seed, index)  # mix_seed(seed, index): the project's one seed mixer
    if plan.random:
        label = int(torch.randint(plan.num_classes, (1,), generator=generator))
    elif plan.class_labels is None:
        label = index % plan.num_classes
    else:
        label = plan.class_labels[index % len(plan.class_labels)]
    return label, generator


def image_labels(plan: LabelPlan, seed: int, indices) -> list[int]:
    """Class labels of `indices` without drawing any noise (names, grid and npz need them)."""
    return [image_rng(plan, seed, i)[0] for i in indices]


def batch_start(plan: LabelPlan, seed: int, indices, latent_shape) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Starting noise (N,C,h,w), labels (N,) and per-row generators for one batch, all on the CPU."""
    labels, generators, noise = [], [], []
    for i in indices:
        label, generator = image_rng(plan, seed, i)
        labels.append(label)
        generators.append(generator)
        noise.append(torch.randn(tuple(latent_shape), generator=generator))  # (C, h, w)
    return torch.stack(noise), torch.tensor(labels, dtype=torch.long), generators  # (N, C, h, w)


# ---- The command ----

@dataclass
class SampleOptions(DecodeFlags, SamplingFlags):
    """Everything `python -m sample` accepts (one field per flag: its default and help; the sampling and VAE flags
    too)."""

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


def check_numbers(o: SampleOptions) -> None:
    """UserError for flags no run can use (before anything is loaded)."""
    check_flag_bounds(o)  # the bounds declared on the options; again here for options built in Python (evaluate run)
    if o.sampler is not None:
        sampler_options(o.sampler, given_sampler_options(o))  # an unknown sampler, or an option it does not take
    if o.cfg_interval is not None and o.cfg_scale == 1.0:
        raise UserError("--cfg-interval limits guidance to a range of noise levels, but --cfg-scale is 1 (no "
                        "guidance); pass a --cfg-scale above 1, or drop --cfg-interval.")


def resolve_sampler(o: SampleOptions, objective, recorded: dict) -> tuple[SampleOptions, dict, tuple]:
    """(o with the sampler, steps and interval used, that sampler's options, notes): flags given, else the model's
    recorded sampling half, else the objective's; SettingError for a sampler or steps it cannot take."""
    plan = resolve_sampling(objective, o.sampler, given_sampler_options(o), o.cfg_interval, recorded,
                            guided=o.cfg_scale != 1.0, steps=o.num_sampling_steps)
    objective.process(plan.sampler, plan.steps, plan.options)  # e.g. 1000 steps of the linspace spacing
    o = dataclasses.replace(o, sampler=plan.sampler, num_sampling_steps=plan.steps, cfg_interval=plan.cfg_interval)
    return o, plan.options, plan.notes


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
    name = f"{label}-cfg{o.cfg_scale:g}{interval}-{sampler}{o.num_sampling_steps}{extra}-seed{o.seed}"
    return Path("samples") / name


def make_settings(plan: SamplePlan) -> dict:
    """{"identity": what fixes the pixels (compared on resume), "run": the rest}; JSON-normalised."""
    o, loaded = plan.options, plan.loaded
    options = {k: v for k, v in asdict(o).items() if k not in ("ckpt", "vae", "vae_config", "class_labels",
                                                                 "random_labels", "model", "objective", "image_size", "plugin")}
    # What was used, not what was asked: the weights, sampler and options actually used and the guidance rule.
    # An option the sampler does not take is None (as folders written before that option existed read).
    channels = plan.guide_channels
    options.update(weights=loaded.weights, sampler=plan.sampler,
                   **{k: plan.sampler_options.get(k) for k in SAMPLER_OPTIONS},
                   cfg_interval=list(o.cfg_interval) if o.cfg_interval else None,
                   guide_channels="all" if channels is None else str(channels))
    identity = {
        "ckpt": str(loaded.path.resolve()), "ckpt_bytes": loaded.path.stat().st_size, "step": loaded.step,
        "kind": loaded.kind, "model": loaded.config.to_dict(), "image_size": plan.image_size,
        "vae": plan.vae_name, "labels": plan.labels.describe(),
        **{k: v for k, v in options.items() if k not in RUN_ONLY},
    }
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
    check_numbers(o)
    if o.out:
        check_out_path(Path(o.out), "sampling")  # a file or an image name as --out: refused before any loading
    loaded = load_sampling_weights(o.ckpt, o.weights, o.model, o.objective)
    config = loaded.config
    objective = objective_of(config)
    o, options, notes = resolve_sampler(o, objective, config.sampling)
    loaded.notes.extend(notes)
    check_interval(o.cfg_interval, objective.level_range, objective.level_unit, objective.name)
    check_guidance(o.cfg_scale, config.has_null_class)
    check_sampling_guidance(objective, o.cfg_scale, o.cfg_interval)  # MeanFlow: folded in; iMF: the trained range
    guided = guide_channel_count(o.guide_channels, config.in_channels, loaded.auto_guide)
    space = LatentSpace.or_unknown(loaded.space, config.in_channels)  # official weights record none
    labels = make_label_plan(o.class_labels, config.num_classes, o.random_labels, list(space.class_names) or None)
    spec, how = choose_tokenizer(o.vae, loaded.space)
    vae_name, factor = space.check_tokenizer_config(spec, o.vae_config, o.allow_other_vae)
    loaded.notes.append(f"VAE {vae_name} ({how})")
    # Default count: one image per listed label, else one per class (label i = i % num_classes).
    num_samples = o.num_samples or len(o.class_labels or []) or labels.num_classes
    plan = SamplePlan(o, loaded, space, objective, o.sampler, options, guided, labels, vae_name,
                      image_size_of(loaded, factor, o.image_size), num_samples,
                      Path(o.out) if o.out else default_out(o, loaded, o.sampler, options), tuple(notes))
    plan.settings = make_settings(plan)
    check_out_dir(plan.out, plan.settings)
    return plan


@dataclass
class Drawer:
    """What turns a list of image indices into uint8 pixels: the plan's sampling with the model and the VAE."""

    plan: SamplePlan
    model_fn: object  # the DiT on the device (compiled with --compile) wrapped in the plan's guidance
    vae: object
    norm: object  # the LatentNorm training applied (shared/tokenizers/tokenizer.py), inverted before decoding
    device: torch.device
    progress: bool = False  # a bar per batch over its sampling steps (a 250-step batch takes a while)

    @torch.inference_mode()
    def draw(self, indices) -> tuple[list[int], np.ndarray]:
        """(labels, uint8 (N,H,W,3)) for `indices`; row i depends only on (seed, i)."""
        p = self.plan
        noise, labels, generators = batch_start(p.labels, p.options.seed, indices, p.latent_shape)  # (N, C, h, w)
        x = p.objective.sample(p.sampler, self.model_fn, noise.to(self.device), p.options.num_sampling_steps,
                               p.sampler_options, {"y": labels.to(self.device)}, generators,
                               self.progress)  # (N, C, h, w)
        return labels.tolist(), self.vae.decode_uint8(x, self.norm)  # (N, H, W, 3)


def load_checked_vae(plan: SamplePlan, device):
    """Load the tokenizer and compare its full identity with the latents' record -> (tokenizer, norm to invert)."""
    o = plan.options
    vae = load_tokenizer(plan.vae_name, device, PRECISIONS[o.vae_precision], o.vae_config, o.vae_tiling,
                         o.vae_slicing)
    norm, note = plan.space.check_loaded(vae, o.allow_other_vae)
    if note:
        plan.loaded.notes.append(note)
        print(f"note: {note}")
    return vae, norm


def make_drawer(plan: SamplePlan, vae, norm, device) -> Drawer:
    """Build the model on `device` (compiled as --compile asks), wrap it in the plan's guidance (with the
    objective's noise levels for its interval) and hand it to the drawer."""
    model = compile_for_sampling(build_sampling_model(plan.loaded, device), plan.options.compile)
    plan.loaded.state_dict = {}  # the model holds the weights now; free the CPU copy
    o = plan.options
    model_fn = GuidedModelFn(model, o.cfg_scale, plan.guide_channels, o.precision, o.cfg_interval,
                             plan.objective.noise_level)
    return Drawer(plan, model_fn, vae, norm, torch.device(device))


def file_names(plan: SamplePlan, indices) -> list[str]:
    """The PNG names of `indices`: index, label and (when recorded) class name."""
    labels = image_labels(plan.labels, plan.options.seed, indices)
    return [image_name(i, y, plan.labels.name_of(y)) for i, y in zip(indices, labels)]


def draw_missing(plan: SamplePlan, drawer: Drawer, rank: int, world: int, show: bool) -> int:
    """Draw and save this rank's images (i % world == rank) not yet on disk; returns how many were drawn."""
    drawer.progress = show
    mine = list(range(rank, plan.num_samples, world))
    todo = missing_indices(plan.out, mine, file_names(plan, mine))
    size = plan.options.batch_size
    with tqdm(total=len(todo), unit="img", desc=f"sampling (rank {rank}/{world})", disable=not show) as bar:
        for start in range(0, len(todo), size):
            batch = todo[start:start + size]
            labels, pixels = drawer.draw(batch)
            for i, y, p in zip(batch, labels, pixels):
                save_png(plan.out / image_name(i, y, plan.labels.name_of(y)), p)
            bar.update(len(batch))
    return len(todo)


def grid_title(plan: SamplePlan) -> str:
    """The line above the grid: which weights, sampler, steps, guidance and seed drew it."""
    o = plan.options
    label = plan.loaded.label or ckpt_label(plan.loaded.path)
    return f"{label} · {plan.sampler} {o.num_sampling_steps} steps · cfg {o.cfg_scale:g} · seed {o.seed}"


def finish(plan: SamplePlan) -> None:
    """Grid and (with --npz) samples.npz, rebuilt from the PNGs on disk."""
    indices = list(range(plan.num_samples))
    labels = image_labels(plan.labels, plan.options.seed, indices)
    paths = [plan.out / name for name in file_names(plan, indices)]
    absent = [p.name for p in paths if not p.exists()]
    if absent:
        raise UserError(f"{len(absent)} images are missing from {plan.out} (e.g. {absent[0]}), probably because "
                        f"another process stopped early; rerun the same command to draw them.")
    captions = captions_for(labels, list(plan.space.class_names) or None)
    write_png_grid(plan.out / GRID_NAME, paths, labels, captions, grid_title(plan))
    if plan.options.npz:
        write_npz(plan.out / NPZ_NAME, paths, labels)
    print(f"wrote {plan.num_samples} images, {GRID_NAME}" + (f", {NPZ_NAME}" if plan.options.npz else "")
          + f" to {plan.out}")


def runtime_facts(device) -> dict:
    """The device really used and the TF32 state really in force, for settings.json."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": str(device), "tf32": "not used (TF32 is a CUDA matmul mode)"}
    name = torch.cuda.get_device_name(device)
    return {"device": f"{device} ({name})", "tf32": "on" if torch.backends.cuda.matmul.allow_tf32 else "off"}


def recorded_line(plan: SamplePlan) -> str | None:
    """The one line naming the sampling settings taken from the weights' record (a flag given wins), or None."""
    if not plan.recorded_notes:
        return None
    used = ", ".join(note.removesuffix(" (recorded with the model)") for note in plan.recorded_notes)
    return f"sampling as the weights record: {used} (a flag given wins)"


def summary_line(plan: SamplePlan) -> str:
    """One line for the terminal: what is drawn, how, and where every setting is written."""
    o = plan.options
    interval = f" in {o.cfg_interval[0]:g}..{o.cfg_interval[1]:g}" if o.cfg_interval else ""
    return (f"{plan.num_samples} images of {plan.loaded.label or ckpt_label(plan.loaded.path)} at {plan.image_size} px: "
            f"{plan.sampler} {o.num_sampling_steps} steps, cfg {o.cfg_scale:g}{interval}, seed {o.seed}, VAE "
            f"{plan.vae_name} -> {plan.out} (all settings and notes: {plan.out / SETTINGS_NAME})")


def prepare_out(plan: SamplePlan, device) -> None:
    """Main process, under the folder's lock: the folder checked again, leftovers of a killed run removed,
    settings.json written, the notes, guidance and summary printed."""
    check_out_dir(plan.out, plan.settings)  # again under the lock: a run that finished meanwhile
    for warning in plan.loaded.warnings:
        print(f"note: {warning}")
    print(plan.settings["run"]["guidance"])
    plan.out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(plan.out)
    plan.settings["run"].update(runtime_facts(device), notes=plan.loaded.notes)
    write_json(plan.out / SETTINGS_NAME, plan.settings)
    for line in (recorded_line(plan), summary_line(plan)):
        if line:
            print(line, flush=True)


def run_sample(o: SampleOptions) -> Path:
    """The whole command on this process: one plan, then the VAE, the folder, the drawing, the grid and npz, in that
    order; rank r draws i % world == r, rank 0 writes the folder."""
    state = process_state(o.cpu)
    check_compile(o.compile, state.device)  # before any weights are read
    plan = make_plan(o)  # every rank checks, before anyone writes
    set_tf32(state.device, o.tf32)
    vae, norm = load_checked_vae(plan, state.device)  # a VAE that does not fit is refused before any write
    # One writer per --out: the main process holds the folder's lock until it exits (the OS drops it on a kill).
    with hold_lock(plan.out, "sample folder") if state.is_main_process else contextlib.nullcontext():
        state.wait_for_everyone()
        if state.is_main_process:
            prepare_out(plan, state.device)
        state.wait_for_everyone()
        drawer = make_drawer(plan, vae, norm, state.device)
        draw_missing(plan, drawer, state.process_index, state.num_processes, state.is_main_process)
        state.wait_for_everyone()
        if state.is_main_process:
            finish(plan)
    return plan.out


# ---- The --out folder: atomic PNGs, settings.json guarding resume, the grid and the streamed samples.npz ----
# (python -m sample decode and watch write their PNGs and grids with the same functions.)

SETTINGS_NAME = "settings.json"
GRID_NAME = "grid.png"
NPZ_NAME = "samples.npz"
# A grid of 50,000 ImageNet samples would be a 57,000-pixel square: show at most this many cells.
GRID_MAX_ROWS = 16
GRID_MAX_CELLS = 256
_PNG_RE = re.compile(r"^(\d{6,})-class(\d+)(-[\w.-]+)?\.png$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
NAME_CHARS = 40  # longest class name kept in a file name
MIN_CELL = 96  # grid pixels: smaller images (digits: 32) are enlarged by an integer factor so captions fit
PAD = 4


def image_name(index: int, label: int, class_name: str | None = None) -> str:
    """File name of image `index`: `{index:06d}-class{label}.png`, or `...-class{label}-{name}.png` with a name."""
    name = safe_name(class_name) if class_name is not None else ""
    return f"{index:06d}-class{label}-{name}.png" if name and name != str(label) else f"{index:06d}-class{label}.png"


def safe_name(text: str) -> str:
    """A class name usable in a file name on any system: runs of other characters become '_'."""
    return _UNSAFE.sub("_", str(text)).strip("._-")[:NAME_CHARS].strip("._-")


def remove_stale_temps(out: Path) -> int:
    """Delete temp files a killed run left behind (call before any process starts writing)."""
    stale = list(Path(out).glob(f"{TMP_PREFIX}*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def save_png(path: Path, pixels: np.ndarray) -> None:
    """Write one uint8 (H,W,3) image atomically as PNG."""
    atomic_write(path, lambda tmp: Image.fromarray(pixels).save(tmp, format="PNG"))


def write_json(path: Path, data: dict) -> None:
    """Write indented JSON atomically."""
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


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
    mine = settings["identity"]
    differ = differences(previous, mine, nested=False)
    if differ:
        raise UserError(
            f"--out {out} holds images of another run ({listed(differ)}). Resuming would mix two runs' images: "
            f"pass a new --out folder, or rerun with the settings recorded in {path}.")


def missing_indices(out: Path, indices, names) -> list[int]:
    """The indices whose PNG (file `names[k]` for `indices[k]`) is not on disk yet (written PNGs are whole: renamed in)."""
    out = Path(out)
    return [i for i, name in zip(indices, names) if not (out / name).exists()]


def grid_layout(labels) -> list[list[int | None]]:
    """Rows of image indices: one row per class when classes repeat, else a near-square in index order."""
    labels = list(labels)
    if len(set(labels)) < len(labels):
        rows: dict[int, list[int]] = {}
        for i, y in enumerate(labels):
            rows.setdefault(y, []).append(i)
        kept = list(rows.values())[:GRID_MAX_ROWS]
        width = min(max(len(r) for r in kept), GRID_MAX_CELLS // len(kept))
        return [r[:width] + [None] * (width - len(r[:width])) for r in kept]
    count = min(len(labels), GRID_MAX_CELLS)
    width = math.ceil(math.sqrt(count))
    cells = list(range(count)) + [None] * (width * math.ceil(count / width) - count)
    return [cells[r:r + width] for r in range(0, len(cells), width)]


def _font(size: int):
    """PIL's bundled font at `size` pixels (Pillow >= 10.1); the fixed-size bitmap font on older Pillow."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def _fit(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> str:
    """`text`, shortened with an ellipsis until it fits `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def labelled_grid(load_image, labels, captions: list[str], title: str) -> np.ndarray:
    """The images of grid_layout (load_image(i) -> uint8 HxWx3), each captioned, under a title -> uint8 (H',W',3)."""
    layout = grid_layout(labels)
    h, w = load_image(next(i for row in layout for i in row if i is not None)).shape[:2]
    scale = max(1, math.ceil(MIN_CELL / min(h, w)))
    cell_w, cell_h = w * scale, h * scale
    size = min(16, max(10, cell_w // 8))  # caption pixels: readable under a 96 px cell, modest under 256 px
    font, line = _font(size), size + 6
    canvas = Image.new("RGB", (PAD + len(layout[0]) * (cell_w + PAD), line + PAD + len(layout) * (cell_h + line + PAD)),
                       "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((PAD, 3), _fit(draw, title, font, canvas.width - 2 * PAD), fill="black", font=font)
    for r, row in enumerate(layout):
        for c, i in enumerate(row):
            if i is None:
                continue
            x, y = PAD + c * (cell_w + PAD), line + PAD + r * (cell_h + line + PAD)
            canvas.paste(Image.fromarray(load_image(i)).resize((cell_w, cell_h), Image.NEAREST), (x, y))
            text = _fit(draw, captions[i], font, cell_w)
            draw.text((x + (cell_w - draw.textlength(text, font=font)) / 2, y + cell_h + 2), text, fill="black",
                      font=font)
    return np.asarray(canvas)


def captions_for(labels, class_names) -> list[str]:
    """The caption of each image: its class name when the latents record names, else 'class N'."""
    names = list(class_names or [])
    return [names[y] if 0 <= y < len(names) and str(names[y]) else f"class {y}" for y in map(int, labels)]


def write_grid(path: Path, load_image, labels, captions: list[str], title: str) -> None:
    """The labelled grid of the images (load_image(i) -> uint8 HxWx3) as one PNG: the same picture as the previews'."""
    save_png(Path(path), labelled_grid(load_image, labels, captions, title))


def write_png_grid(path: Path, image_paths, labels, captions: list[str], title: str) -> None:
    """write_grid of PNGs on disk: only the images the grid shows are read, one at a time."""
    write_grid(path, lambda i: read_png(image_paths[i]), labels, captions, title)


def read_png(path: Path) -> np.ndarray:
    """One PNG as uint8 (H,W,3)."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _write_npy_member(archive: zipfile.ZipFile, name: str, shape, dtype, chunks) -> None:
    """Stream one .npy member into the zip: header, then the raw C-order bytes chunk by chunk."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    with archive.open(name, "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, header)
        for chunk in chunks:
            member.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())


def write_npz(path: Path, image_paths, labels) -> None:
    """samples.npz (arr_0 uint8 N x H x W x 3, labels int64 N), streamed so 50k images fit in memory."""
    image_paths = list(image_paths)
    h, w = read_png(image_paths[0]).shape[:2]

    def write(tmp):
        """arr_0.npy then labels.npy, stored uncompressed as np.savez does."""
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            images = (_checked(read_png(p), (h, w, 3), p) for p in image_paths)
            _write_npy_member(archive, "arr_0.npy", (len(image_paths), h, w, 3), np.uint8, images)
            _write_npy_member(archive, "labels.npy", (len(labels),), np.int64, [np.asarray(labels)])

    atomic_write(Path(path), write)


def _checked(pixels: np.ndarray, shape, path) -> np.ndarray:
    """Refuse an image whose size differs from the first one (the npz holds one array)."""
    if pixels.shape != shape:
        raise UserError(f"{path} is {pixels.shape}, unlike the other samples {shape}; delete it and rerun.")
    return pixels
