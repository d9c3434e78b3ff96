"""`python -m sample decode`: turn training's --sample-every latents (RUN/samples/step-*.safetensors) into PNGs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from shared.runtime.cli import option
from shared.runtime.distributed import process_state
from shared.runtime.errors import UserError
from shared.runtime.precision import PRECISIONS
from shared.sampling.flags import DecodeFlags
from shared.sampling.previews import read_preview
from shared.runtime.rundir import SAMPLES, step_of
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace, choose_tokenizer

from shared.sampling.plan import GRID_NAME, check_out_path
from shared.sampling.generate import captions_for, image_name, save_png, write_grid


@dataclass
class DecodeOptions(DecodeFlags):
    """Everything `python -m sample decode` accepts (one field per flag: its default and help; the VAE flags too)."""
    latents: str = option(help="a latents file written by training's --sample-every, or a folder of them "
                               "(RUN/samples, or RUN itself): its newest file, or every file with --all",
                          positional=True, metavar="LATENTS|DIR")
    all: bool = option(False, "with a folder: decode every preview file, not just the newest")
    out: str | None = option(None, "output folder (default: the file's path without .safetensors; with --all, one "
                                   "subfolder per file)")
    batch_size: int = option(16, "latents decoded per VAE call", min=1)


def decode_jobs(o: DecodeOptions) -> list[tuple[Path, Path]]:
    """(latents file, output folder) pairs: the file, or the newest (all with --all) previews of a folder."""
    path = Path(o.latents).expanduser()
    if o.out:
        check_out_path(Path(o.out), "decode")
    if not path.is_dir():
        return [(path, Path(o.out) if o.out else path.with_suffix(""))]
    folder = path / SAMPLES if (path / SAMPLES).is_dir() else path  # RUN/samples, or RUN via its samples/
    files = sorted((p for p in folder.glob("step-*.safetensors") if step_of(p) is not None), key=step_of)
    if not files:
        raise UserError(f"{path} holds no preview files (step-*.safetensors, directly or in {SAMPLES}/); training "
                        f"writes them to RUN/{SAMPLES}/ when run with --sample-every. Pass such a file or folder.")
    chosen = files if o.all else files[-1:]
    if o.out and len(chosen) > 1:  # one subfolder per file, so the images of two steps never mix
        return [(f, Path(o.out) / f.stem) for f in chosen]
    return [(f, Path(o.out) if o.out else f.with_suffix("")) for f in chosen]


def run_decode(o: DecodeOptions) -> list[Path]:
    """Decode each chosen file to `{index:06d}-class{label}[-name].png` plus grid.png in its output folder."""
    jobs = decode_jobs(o)
    loaded = [(read_preview(path), path, out) for path, out in jobs]  # every file is checked before any decoding
    spec, how = choose_tokenizer(o.vae, loaded[-1][0][2])  # the tokenizer recorded with the newest file
    for (latents, _, space), _, _ in loaded:
        name, _ = LatentSpace.or_unknown(space, latents.shape[1]).check_tokenizer_config(spec, o.vae_config,
                                                                                          o.allow_other_vae)
    device = process_state(o.cpu).device
    vae = load_tokenizer(name, device, PRECISIONS[o.vae_precision], o.vae_config, o.vae_tiling, o.vae_slicing)
    return [decode_file(vae, name, how, data, path, out, o)[0] for data, path, out in loaded]


def decode_file(vae, name: str, how: str, data, path: Path, out: Path, o) -> tuple[Path, list]:
    """Decode one preview file's latents into `out` -> (out, uint8 (H, W, 3) images); `o`: decode's or watch's."""
    latents, labels, space = data
    space = LatentSpace.or_unknown(space, latents.shape[1])
    norm, note = space.check_loaded(vae, o.allow_other_vae)
    names = list(space.class_names)
    print(f"decoding {len(latents)} latents from {path} with VAE {name} ({how})" + (f"; note: {note}" if note else ""))
    out.mkdir(parents=True, exist_ok=True)
    images = []
    with torch.inference_mode():
        for start in tqdm(range(0, len(latents), o.batch_size), unit="batch", desc="decoding"):
            pixels = vae.decode_uint8(latents[start:start + o.batch_size], norm)  # (B, H, W, 3)
            for i, p in enumerate(pixels, start):
                y = int(labels[i])
                save_png(out / image_name(i, y, names[y] if 0 <= y < len(names) else None), p)
                images.append(p)
    write_grid(out / GRID_NAME, lambda i: images[i], labels.tolist(), captions_for(labels.tolist(), names), path.name)
    print(f"wrote {len(latents)} images and {GRID_NAME} to {out}")
    return out, images
