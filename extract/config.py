"""What `python -m extract` is asked to do, and the plan it runs: the flags (`ExtractConfig`), every check that needs
no weights (choices, folders, the dataset, the tokenizer's config and latent shape, the shard columns), and the
settings that decide the shard bytes, resolved once into a `Plan` that every step of extract/run.py reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from extract.sizes import check_image_size
from shared.datasets.columns import columns
from shared.datasets.duplicates import DEFAULT_DUPLICATES, DUPLICATE_POLICIES, apply_duplicates
from shared.datasets.imagefolder import ImageFolderScan
from shared.datasets.images import MAX_IMAGE_PIXELS, pixel_limit
from shared.datasets.shards import FLAG_DTYPES, FLIP_MODES, INDEX_NAME, STORAGE_DTYPES
from shared.datasets.sources import (DEFAULT_IMAGE_COLUMN, DEFAULT_LABEL_COLUMN, DEFAULT_LABEL_KEY, SourceOptions,
                                     is_url, listed_source, open_source)
from shared.runtime.cli import option
from shared.runtime.errors import ChoiceError, UserError
from shared.runtime.plugins import PLUGIN
from shared.runtime.rerun import differences, listed
from shared.tokenizers.locate import read_vae_config, resolve_vae_spec
from shared.tokenizers.tokenizer import (TokenizerClass, config_sha256, downsample_factor, measure_latent,
                                         tokenizer_class)

SETTINGS_NAME = "extract-settings.json"
BAD_FILES_NAME = "bad-files.jsonl"
SETTINGS_VERSION = 1


@dataclass
class ExtractConfig:
    """Everything `python -m extract` can be asked to do (one field per flag: its default and help)."""

    data_path: str | None = option(
        None, "The images (required unless --verify): an ImageFolder root (one sub-folder per class); webdataset tar "
              "shards, a brace pattern or '::'-separated list, local or any fsspec URL (https://, s3://, hf://); or "
              "parquet files, a glob, or a Hugging Face dataset folder (its train-*.parquet)")
    label_key: str = option(DEFAULT_LABEL_KEY, "Tar shards: the member holding each sample's class index (cls), or "
                                               "json:FIELD for a field of its .json member")
    class_map: Path | None = option(None, "Tar shards or parquet: class names, a JSON list or {index: name} (default: "
                                          "parquet's ClassLabel names, else the indices)")
    image_column: str = option(DEFAULT_IMAGE_COLUMN, "Parquet: the column of encoded images (a struct with bytes, as "
                                                     "Hugging Face datasets write it, or binary)")
    label_column: str = option(DEFAULT_LABEL_COLUMN, "Parquet: the column of integer class indices")
    out: Path | None = option(None, "Output folder for shards and index.json (required unless --check).")
    vae: str = option("ema", "the tokenizer to encode with (any tokenizer, not only a VAE): ema | mse "
                             "(stabilityai/sd-vae-ft-*), a released name (rae-dinov2-b, vavae), a local diffusers "
                             "folder, a single weight file (.safetensors/.ckpt/.pt) or a hub id")
    vae_config: Path | None = option(None, "config.json for a single-file --vae when none sits beside the file.")
    image_size: int = option(256, "Side of the square centre crop (ADM preprocessing); a multiple of the VAE's "
                                  "downsample factor", min=1)
    flip: str = option("both", "both: also store the horizontally mirrored image's moments (train picks one per "
                               "step); none: originals only", choices=tuple(FLIP_MODES))
    batch_size: int = option(64, "Images per encoder batch (x2 with --flip both)", min=1)
    num_workers: int | None = option(None, "Image-decoding processes per extract process (default: up to 8, from the "
                                           "CPU count).", min=0)
    dtype: str = option("fp16", "Storage dtype of the moments (bf16: fp32's range, fewer digits than fp16; RAE's "
                                "768x16x16 tokens: 384 KiB per image and flip in fp16 or bf16, 768 KiB in fp32); "
                                "encoding always runs in fp32",
                        choices=tuple(STORAGE_DTYPES))
    shard_size: int = option(4096, "Images per shard, also the unit of resume", min=1)
    limit: int | None = option(None, "Use only N images, spread evenly over the sorted list (for a quick trial; "
                                     "default: all).", min=1)
    max_image_pixels: int | None = option(
        MAX_IMAGE_PIXELS, f"Images with more pixels are skipped as possible decompression bombs (listed as bad "
                          f"files); 'none' admits any size (default: {MAX_IMAGE_PIXELS:,}). Admitted images above "
                          f"{MAX_IMAGE_PIXELS:,} pixels are decoded at reduced size where the format allows (JPEG), "
                          f"else whole and reduced at once (memory: ~3-4 bytes per pixel per worker)",
        type=pixel_limit, metavar="N|none")
    duplicates: str = option(
        DEFAULT_DUPLICATES, "Files that are one picture (symlinks or hard links to one file, identical bytes): first "
                            "keeps each picture once, under its first path's label in sorted order; all keeps every "
                            "copy under its own label (one picture in two classes); none drops pictures whose copies "
                            "disagree on the label. --check and the summary list them",
        choices=tuple(DUPLICATE_POLICIES))
    strict: bool = option(False, "Stop at the first bad image instead of skipping and recording it.")
    plugin: list | None = PLUGIN.field()
    # The registered shard columns' flags (shared/datasets/columns.py), {field: value}; absent: their defaults.
    column_flags: dict = field(default_factory=dict)


@dataclass
class ExtractModes:
    """The flags that pick another job than extracting (none: extract)."""

    check: bool = option(False, "Validate the dataset without encoding: images per class, first image's size and "
                                "mode, bad files (opens every image; no VAE). Exit status 1 if bad files are found.")
    dry_run: bool = option(False, "Run every check and print the plan (images, shards, VAE, settings) without loading "
                                  "the VAE or writing anything.")
    stats: bool = option(False, "Recompute the latent statistics of the finished folder --out from its stored moments "
                                "(float64) and rewrite its latent_space.json, without encoding again: converts an older "
                                "folder, rebuilds a damaged record (with the recorded tokenizer, or --vae if given).")
    verify: bool = option(False, "Hash every shard of the finished folder --out against its index.json and report "
                                 "damage; changes nothing (a damaged folder: rerun the extraction command, it redoes "
                                 "those shards).")


@dataclass
class Plan:
    """The run, resolved once before any weights load: the flags, the images, the tokenizer, the settings."""

    cfg: ExtractConfig
    scan: ImageFolderScan
    vae_name: str
    vae_config: dict
    kind: TokenizerClass  # the tokenizer's class record
    latent_shape: tuple  # (C, h, w) measured by encoding one image of --image-size (meta device, no weights)
    settings: dict  # what decides the shard bytes (run_settings)
    columns: dict = field(default_factory=dict)  # {name: record}: the extra columns stored (shared/datasets/columns.py)
    warnings: list = field(default_factory=list)  # printed by the main process before it starts
    listing_key: dict | None = None  # a tar or parquet listing made by this run: kept in --out under this key

    out = property(lambda self: Path(self.cfg.out), doc="The --out folder.")
    num_shards = property(lambda self: -(-len(self.scan) // self.cfg.shard_size), doc="Shards of --shard-size images.")


def check_choices(cfg: ExtractConfig) -> None:
    """Known choices, or a ChoiceError naming the flag (the numbers' bounds are on their options: from_args)."""
    choices = (("flip mode", cfg.flip, FLIP_MODES), ("duplicate policy", cfg.duplicates, DUPLICATE_POLICIES),
               ("storage dtype", cfg.dtype, STORAGE_DTYPES))
    for setting, value, known in choices:
        if value not in known:
            raise ChoiceError(setting, value, known)


def column_records(planned: dict) -> dict:
    """{index.json key: record} of the stored columns (absent without any: the settings of older folders)."""
    return {columns()[name].meta_key: record for name, record in planned.items()}


def run_settings(cfg: ExtractConfig, scan: ImageFolderScan, vae_name: str, vae_config: dict, planned: dict) -> dict:
    """The settings that decide the shard bytes; a rerun must match them to resume into the same --out."""
    extra = column_records(planned)
    if cfg.max_image_pixels != MAX_IMAGE_PIXELS:  # decides which files are skipped; absent at the default
        extra["max_image_pixels"] = "none" if cfg.max_image_pixels is None else cfg.max_image_pixels
    return {**extra, "version": SETTINGS_VERSION,
            "dataset": {"num_files": len(scan), "num_classes": len(scan.classes), "files_sha256": scan.fingerprint()},
            "vae": {"source": vae_name, "config_sha256": config_sha256(vae_config)},
            "image_size": cfg.image_size, "flip": cfg.flip, "dtype": cfg.dtype, "shard_size": cfg.shard_size,
            "limit": cfg.limit}


def holds_shards(out: Path) -> bool:
    """True once a shard, a sidecar or the index exists: from then on the settings that made them are fixed."""
    return out.is_dir() and (any(out.glob("shard-*")) or (out / INDEX_NAME).exists())


def check_out_folder(out: Path, settings: dict) -> list[str]:
    """Refuse an --out holding another run's shards (other settings, unknown origin); replace the settings of a run
    that wrote no shard yet (e.g. its VAE failed to load), returning that note."""
    path = out / SETTINGS_NAME
    if path.is_file():
        try:
            diffs = differences(json.loads(path.read_text()), settings)
        except ValueError:
            diffs = ["unreadable"]
        if diffs and not holds_shards(out):
            return [f"--out {out} held the settings of an earlier run that wrote no shard ({listed(diffs)}); "
                    f"they are replaced by this run's."]
        if diffs == ["unreadable"]:
            raise UserError(f"{path} is unreadable; delete the --out folder or use a new --out.")
        if diffs:
            raise UserError(f"--out {out} holds shards of a different extraction ({listed(diffs)}). Use a new --out "
                            f"folder for these settings, or rerun the original command to resume that extraction.")
    elif holds_shards(out):
        raise UserError(f"--out {out} already holds shards or an index from another tool or an older run "
                        f"({SETTINGS_NAME} is missing), so they cannot be resumed safely. Use a new --out folder or "
                        f"empty this one.")
    return []


def check_flags(cfg: ExtractConfig) -> None:
    """The checks of the flags alone (no file read): choices, --out apart from --data-path."""
    check_choices(cfg)
    out, data_path = cfg.out, cfg.data_path
    if out is not None and not is_url(str(data_path)):  # --out equal to, inside or holding --data-path: refused
        images, latents = Path(data_path).expanduser().resolve(), Path(out).expanduser().resolve()
        if latents == images or images in latents.parents or latents in images.parents:
            where = "is" if latents == images else "is inside" if images in latents.parents else "holds"
            raise UserError(f"--out {out} {where} --data-path {data_path}: the shards, index and lock would be written "
                            f"among the images (and a later scan would take them for a class folder), or the images "
                            f"among the shards. Pass a separate output folder beside the images, e.g. --out "
                            f"{images.parent / (images.name + '-latents')}.")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {cfg.out} is a file; pass a folder (it is created if missing).")


def source_options(cfg) -> SourceOptions:
    """The flags that say how a tar or parquet source is read."""
    return SourceOptions(cfg.label_key, cfg.class_map, cfg.image_column, cfg.label_column)


def make_plan(cfg: ExtractConfig, check_out: bool = True) -> Plan:
    """Every check that needs no weights: flags, dataset, VAE config, image size (and the out folder)."""
    check_flags(cfg)
    options = source_options(cfg)
    scan, listing_key = listed_source(  # tar and parquet: the listing kept in --out by an earlier run, if it fits
        cfg.data_path, options, cfg.out, {"limit": cfg.limit, "duplicates": cfg.duplicates},
        lambda: apply_duplicates(open_source(cfg.data_path, options).limited(cfg.limit), cfg.duplicates))
    # the tokenizer and its class, its factor and latent measured, the size checked (no weights)
    vae_name, vae_config = resolve_vae_spec(cfg.vae, cfg.vae_config), read_vae_config(cfg.vae, cfg.vae_config)
    kind = tokenizer_class(vae_config, vae_name)
    warnings = check_image_size(cfg.image_size, downsample_factor(vae_config), kind.family)  # factor at a probe size
    shape = measure_latent(vae_config, cfg.image_size, vae_name)  # (C, h, w): one image of --image-size, meta device
    planned = {}  # {name: record} of the registered columns this run stores (their flags checked, no weights read)
    for name, column in columns().items():
        record = column.plan(column.extract_options(cfg.column_flags), cfg.image_size)
        if record is not None:
            if record.get("dtype") not in FLAG_DTYPES:
                raise UserError(f"the shard column {name!r} asks for the storage dtype {record.get('dtype')!r}; "
                                f"the column's record must name one of {', '.join(FLAG_DTYPES)}.")
            planned[name] = record
    settings = run_settings(cfg, scan, vae_name, vae_config, planned)
    if check_out:
        warnings += check_out_folder(Path(cfg.out), settings)
    return Plan(cfg, scan, vae_name, vae_config, kind, shape, settings, planned, warnings, listing_key)
