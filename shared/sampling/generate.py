"""`python -m sample`'s code path (also `python -m evaluate run`'s): from the plan (shared/sampling/plan.py),
class-conditional DiT sampling (CFG; DDPM, DDIM or an ODE solver) decoded to PNGs, grid, npz in the --out folder;
its PNG and grid writers serve `python -m sample decode` and `watch`."""
from __future__ import annotations

import contextlib
import json
import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from shared.generative.guidance import GuidedModelFn
from shared.runtime.distributed import process_state
from shared.runtime.errors import UserError
from shared.runtime.fsio import TMP_PREFIX, atomic_write, atomic_write_text
from shared.runtime.lock import hold_lock
from shared.runtime.precision import PRECISIONS, set_tf32
from shared.runtime.seeding import generator_for
from shared.sampling.compiled import check_compile, compile_for_sampling
from shared.sampling.plan import (GRID_NAME, NPZ_NAME, SETTINGS_NAME, LabelPlan, SampleOptions, SamplePlan,
                                  check_out_dir, ckpt_label, make_plan)
from shared.tokenizers.locate import load_tokenizer
from shared.weights.checkpoint import build_sampling_model


# Image i's class label, noise and sampler noise come from one generator seeded by (seed, i): so results do not
# depend on the batch size, the process, or which images were on disk when a run resumed.
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
    labels, generators = zip(*(image_rng(plan, seed, i) for i in indices))  # each generator after its label draw
    noise = torch.stack([torch.randn(tuple(latent_shape), generator=g) for g in generators])  # (N, C, h, w)
    return noise, torch.tensor(labels, dtype=torch.long), list(generators)


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
                               p.sampler_options, {"y": labels.to(self.device)}, generators, self.progress)
        return labels.tolist(), self.vae.decode_uint8(x, self.norm)  # (N, H, W, 3)


def make_drawer(plan: SamplePlan, vae, norm, device) -> Drawer:
    """The drawer: the model on `device`, compiled as --compile asks, in the plan's guidance (objective's levels)."""
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
    # A PNG on disk is whole (renamed in once written): only the absent ones are drawn.
    names = dict(zip(mine, file_names(plan, mine)))
    todo = [i for i in mine if not (plan.out / names[i]).exists()]
    size = plan.options.batch_size
    with tqdm(total=len(todo), unit="img", desc=f"sampling (rank {rank}/{world})", disable=not show) as bar:
        for start in range(0, len(todo), size):
            batch = todo[start:start + size]
            for i, pixels in zip(batch, drawer.draw(batch)[1]):  # uint8 (H, W, 3) each
                save_png(plan.out / names[i], pixels)
            bar.update(len(batch))
    return len(todo)


def finish(plan: SamplePlan) -> None:
    """Grid and (with --npz) samples.npz, rebuilt from the PNGs on disk."""
    o, indices = plan.options, list(range(plan.num_samples))
    labels = image_labels(plan.labels, o.seed, indices)
    paths = [plan.out / name for name in file_names(plan, indices)]
    absent = [p.name for p in paths if not p.exists()]
    if absent:
        raise UserError(f"{len(absent)} images are missing from {plan.out} (e.g. {absent[0]}), probably because "
                        f"another process stopped early; rerun the same command to draw them.")
    captions = captions_for(labels, list(plan.space.class_names) or None)
    title = (f"{plan.loaded.label or ckpt_label(plan.loaded.path)} · {plan.sampler} {o.num_sampling_steps} steps · "
             f"cfg {o.cfg_scale:g} · seed {o.seed}")
    # Only the images the grid shows are read, one at a time.
    write_grid(plan.out / GRID_NAME, lambda i: read_png(paths[i]), labels, captions, title)
    if o.npz:
        write_npz(plan.out / NPZ_NAME, paths, labels)
    print(f"wrote {plan.num_samples} images, {GRID_NAME}" + (f", {NPZ_NAME}" if o.npz else "") + f" to {plan.out}")


def runtime_facts(device) -> dict:
    """The device really used and the TF32 state really in force, for settings.json."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": str(device), "tf32": "not used (TF32 is a CUDA matmul mode)"}
    return {"device": f"{device} ({torch.cuda.get_device_name(device)})",
            "tf32": "on" if torch.backends.cuda.matmul.allow_tf32 else "off"}


def prepare_out(plan: SamplePlan, device) -> None:
    """Main process, under the folder's lock: the folder checked again and cleaned, settings.json written."""
    check_out_dir(plan.out, plan.settings)  # again under the lock: a run that finished meanwhile
    for warning in plan.loaded.warnings:
        print(f"note: {warning}")
    print(plan.settings["run"]["guidance"])
    plan.out.mkdir(parents=True, exist_ok=True)
    for stale in plan.out.glob(f"{TMP_PREFIX}*"):  # temp files of a killed run (no other process writes yet)
        stale.unlink(missing_ok=True)
    plan.settings["run"].update(runtime_facts(device), notes=plan.loaded.notes)
    atomic_write_text(plan.out / SETTINGS_NAME, json.dumps(plan.settings, indent=2) + "\n")
    if plan.recorded_notes:  # the sampling settings taken from the weights' record, in one line
        used = ", ".join(note.removesuffix(" (recorded with the model)") for note in plan.recorded_notes)
        print(f"sampling as the weights record: {used} (a flag given wins)", flush=True)
    o = plan.options  # one line: what is drawn, how, and where every setting is written
    interval = f" in {o.cfg_interval[0]:g}..{o.cfg_interval[1]:g}" if o.cfg_interval else ""
    print(f"{plan.num_samples} images of {plan.loaded.label or ckpt_label(plan.loaded.path)} at {plan.image_size} px: "
          f"{plan.sampler} {o.num_sampling_steps} steps, cfg {o.cfg_scale:g}{interval}, seed {o.seed}, VAE "
          f"{plan.vae_name} -> {plan.out} (all settings and notes: {plan.out / SETTINGS_NAME})", flush=True)


def run_sample(o: SampleOptions) -> Path:
    """The whole command on this process: plan, VAE, folder, drawing (rank r: i % world == r), grid and npz."""
    state = process_state(o.cpu)
    check_compile(o.compile, state.device)  # before any weights are read
    plan = make_plan(o)  # every rank checks, before anyone writes
    set_tf32(state.device, o.tf32)
    o = plan.options
    vae = load_tokenizer(plan.vae_name, state.device, PRECISIONS[o.vae_precision], o.vae_config, o.vae_tiling,
                         o.vae_slicing)
    # Its full identity compared with the latents' record: a VAE that does not fit is refused before any write.
    norm, note = plan.space.check_loaded(vae, o.allow_other_vae)
    if note:
        plan.loaded.notes.append(note)
        print(f"note: {note}")
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


# The --out folder's PNGs, grid and streamed samples.npz (python -m sample decode and watch write theirs here too).
# A grid of 50,000 ImageNet samples would be a 57,000-pixel square: show at most this many cells.
GRID_MAX_ROWS = 16
GRID_MAX_CELLS = 256
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
NAME_CHARS = 40  # longest class name kept in a file name
MIN_CELL = 96  # grid pixels: smaller images (digits: 32) are enlarged by an integer factor so captions fit
PAD = 4


def image_name(index: int, label: int, class_name: str | None = None) -> str:
    """File name of image `index`: `{index:06d}-class{label}.png`, or `...-class{label}-{name}.png` with a name."""
    # A class name usable in a file name on any system: runs of other characters become '_'.
    name = _UNSAFE.sub("_", str(class_name)).strip("._-")[:NAME_CHARS].strip("._-") if class_name is not None else ""
    return f"{index:06d}-class{label}-{name}.png" if name and name != str(label) else f"{index:06d}-class{label}.png"


def save_png(path: Path, pixels: np.ndarray) -> None:
    """Write one uint8 (H,W,3) image atomically as PNG."""
    atomic_write(path, lambda tmp: Image.fromarray(pixels).save(tmp, format="PNG"))


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
    line = size + 6
    try:
        font = ImageFont.load_default(size=size)  # PIL's bundled font at `size` pixels (Pillow >= 10.1)
    except TypeError:
        font = ImageFont.load_default()  # the fixed-size bitmap font on older Pillow
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

    def images():
        """Each PNG in turn; one whose size differs from the first is refused (the npz holds one array)."""
        for p in image_paths:
            pixels = read_png(p)
            if pixels.shape != (h, w, 3):
                raise UserError(f"{p} is {pixels.shape}, unlike the other samples {(h, w, 3)}; delete it and rerun.")
            yield pixels

    def write(tmp):
        """arr_0.npy then labels.npy, stored uncompressed as np.savez does."""
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            _write_npy_member(archive, "arr_0.npy", (len(image_paths), h, w, 3), np.uint8, images())
            _write_npy_member(archive, "labels.npy", (len(labels),), np.int64, [np.asarray(labels)])

    atomic_write(Path(path), write)
