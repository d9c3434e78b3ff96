"""The extraction job: plan and check before loading anything, encode shard by shard, resume, index last.

Shard j holds the files at sorted positions [j*S, (j+1)*S); process r of W encodes the shards j with
j % W == r. A shard is finished when its tar and then its sidecar (`shard-NNNNNN.done.json`, written by
ShardWriter.close: ShardInfo, bad files, VAE identity) exist and its bytes still match the sidecar's sha256;
rerunning the same command skips finished shards and redoes the rest, damaged ones included. When every shard is
finished, one process hashes them all (the index records only verified hashes), writes the bad-file report and
then index.json (last). The main process holds the folder's lock (shared/runtime/lock.py) for the whole run.
Every step reads one Plan (flags, images, tokenizer class, settings), resolved before any weights load.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Sampler
from tqdm import tqdm

from shared.datasets.duplicates import DEFAULT_DUPLICATES, DUPLICATE_POLICIES, apply_duplicates
from shared.datasets.imagefolder import ImageFolderScan
from shared.datasets.sources import (DEFAULT_IMAGE_COLUMN, DEFAULT_LABEL_COLUMN, DEFAULT_LABEL_KEY, LISTING_NAME,
                                     SourceOptions, is_url, listed_source, open_source, save_listing, source_kind)
from shared.datasets.images import (BOMB_REASON, MAX_IMAGE_PIXELS, ImageFileDataset, make_loader, pixel_limit,
                                    raise_fatal)
from shared.runtime.cli import counted, option
from shared.runtime.distributed import default_workers as shared_default_workers, process_state
from extract.sizes import check_image_size
from shared.runtime.errors import ChoiceError, UserError
from shared.runtime.fsio import atomic_write_text, stale_tmps
from shared.runtime.lock import hold_lock
from shared.runtime.rerun import differences, listed
from shared.datasets.columns import columns, plugin_of
from shared.datasets.shards import FLAG_DTYPES
from shared.runtime.plugins import PLUGIN
from shared.tokenizers.tokenizer import TokenizerClass, tokenizer_class
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace
from shared.datasets.integrity import damaged_error, damaged_files
from shared.datasets.shards import (FLIP_MODES, FOLDER_KIND, INDEX_NAME, STORAGE_DTYPES, ChannelStats, ElementStats,
                                    ShardWriter, element_stats_path, read_sidecar, shard_name, sidecar_path,
                                    write_index)

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
    columns: dict = field(default_factory=dict)  # {name: record} of the extra columns stored (shared/datasets/columns.py)
    warnings: list = field(default_factory=list)  # printed by the main process before it starts
    listing_key: dict | None = None  # a tar or parquet listing made by this run: kept in --out under this key

    out = property(lambda self: Path(self.cfg.out), doc="The --out folder.")
    num_shards = property(lambda self: -(-len(self.scan) // self.cfg.shard_size), doc="Shards of --shard-size images.")


@dataclass
class Progress:
    """Counters of this process's work, for the bar and the summary."""

    encoded: int = 0
    bad: list = field(default_factory=list)
    damaged: int = 0  # finished shards whose bytes failed their sha256, encoded again
    chunk: int = 0  # images per encoder call (halved on CUDA out-of-memory)


# ----------------------------------------------------------------------------------------------------------
# Planning and checks (no VAE weights)
# ----------------------------------------------------------------------------------------------------------

def check_choices(cfg: ExtractConfig) -> None:
    """Known choices, or a ChoiceError naming the flag (the numbers' bounds are on their options: from_args)."""
    if cfg.flip not in FLIP_MODES:
        raise ChoiceError("flip mode", cfg.flip, FLIP_MODES)
    if cfg.duplicates not in DUPLICATE_POLICIES:
        raise ChoiceError("duplicate policy", cfg.duplicates, DUPLICATE_POLICIES)
    if cfg.dtype not in STORAGE_DTYPES:
        raise ChoiceError("storage dtype", cfg.dtype, STORAGE_DTYPES)


def check_encoder_vae(cfg: ExtractConfig) -> tuple[str, dict, TokenizerClass, list[str], tuple]:
    """Resolve the tokenizer and its class, measure its factor and latent, check the size (no weights)."""
    from shared.tokenizers.tokenizer import downsample_factor, measure_latent
    from shared.tokenizers.locate import read_vae_config, resolve_vae_spec

    name = resolve_vae_spec(cfg.vae, cfg.vae_config)
    config = read_vae_config(cfg.vae, cfg.vae_config)
    kind = tokenizer_class(config, name)
    warnings = check_image_size(cfg.image_size, downsample_factor(config), kind.family)  # factor at a probe size
    shape = measure_latent(config, cfg.image_size, name)  # (C, h, w): one image of --image-size, meta device
    return name, config, kind, warnings, shape


def plan_columns(cfg: ExtractConfig) -> dict:
    """{name: record} of the registered columns this run stores (their flags checked, no weights read)."""
    planned = {}
    for name, column in columns().items():
        record = column.plan(column.extract_options(cfg.column_flags), cfg.image_size)
        if record is not None:
            if record.get("dtype") not in FLAG_DTYPES:
                raise UserError(f"the shard column {name!r} asks for the storage dtype {record.get('dtype')!r}; "
                                f"the column's record must name one of {', '.join(FLAG_DTYPES)}.")
            planned[name] = record
    return planned


def column_records(planned: dict) -> dict:
    """{index.json key: record} of the stored columns (absent without any: the settings of older folders)."""
    return {columns()[name].meta_key: record for name, record in planned.items()}


def run_settings(cfg: ExtractConfig, scan: ImageFolderScan, vae_name: str, vae_config: dict,
                 planned: dict | None = None) -> dict:
    """The settings that decide the shard bytes; a rerun must match them to resume into the same --out."""
    from shared.tokenizers.tokenizer import config_sha256

    extra = column_records(planned or {})
    if cfg.max_image_pixels != MAX_IMAGE_PIXELS:  # decides which files are skipped; absent at the default
        extra["max_image_pixels"] = "none" if cfg.max_image_pixels is None else cfg.max_image_pixels
    return {**extra,
        "version": SETTINGS_VERSION,
        "dataset": {"num_files": len(scan), "num_classes": len(scan.classes), "files_sha256": scan.fingerprint()},
        "vae": {"source": vae_name, "config_sha256": config_sha256(vae_config)},
        "image_size": cfg.image_size,
        "flip": cfg.flip,
        "dtype": cfg.dtype,
        "shard_size": cfg.shard_size,
        "limit": cfg.limit,
    }


def holds_shards(out: Path) -> bool:
    """True once a shard, a sidecar or the index exists: from then on the settings that made them are fixed."""
    return out.is_dir() and (any(out.glob("shard-*")) or (out / INDEX_NAME).exists())


def check_out_folder(out: Path, settings: dict) -> list[str]:
    """Refuse an --out folder that holds another run's shards (different settings or unknown origin).

    Settings of a run that wrote no shard yet (e.g. its VAE failed to load) are replaced; returns that note.
    """
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
            raise UserError(
                f"--out {out} holds shards of a different extraction ({listed(diffs)}). Use a new --out "
                f"folder for these settings, or rerun the original command to resume that extraction."
            )
    elif holds_shards(out):
        raise UserError(
            f"--out {out} already holds shards or an index from another tool or an older run ({SETTINGS_NAME} is "
            f"missing), so they cannot be resumed safely. Use a new --out folder or empty this one."
        )
    return []


def check_separate_folders(data_path, out: Path) -> None:
    """Refuse an --out equal to, inside, or holding --data-path: shards written among the images become data."""
    if is_url(str(data_path)):
        return
    images, latents = Path(data_path).expanduser().resolve(), Path(out).expanduser().resolve()
    if latents == images or images in latents.parents or latents in images.parents:
        where = ("is" if latents == images else "is inside" if images in latents.parents else "holds")
        raise UserError(
            f"--out {out} {where} --data-path {data_path}: the shards, index and lock would be written among the "
            f"images (and a later scan would take them for a class folder), or the images among the shards. Pass "
            f"a separate output folder beside the images, e.g. --out {images.parent / (images.name + '-latents')}."
        )


def check_flags(cfg: ExtractConfig) -> None:
    """The checks of the flags alone (no file read): choices, --out apart from --data-path."""
    check_choices(cfg)
    if cfg.out is not None:
        check_separate_folders(cfg.data_path, cfg.out)
        if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
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
    vae_name, vae_config, kind, warnings, shape = check_encoder_vae(cfg)
    planned = plan_columns(cfg)  # config only, no weights
    settings = run_settings(cfg, scan, vae_name, vae_config, planned)
    if check_out:
        warnings += check_out_folder(Path(cfg.out), settings)
    return Plan(cfg, scan, vae_name, vae_config, kind, shape, settings, planned, warnings, listing_key)


# ----------------------------------------------------------------------------------------------------------
# Files in the out folder
# ----------------------------------------------------------------------------------------------------------

def settings_sha256(settings: dict) -> str:
    """A short identity of the settings, stored in every sidecar."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def read_finished(plan: Plan, shard: int) -> dict | None:
    """The sidecar of a shard this run's settings finished, or None when the shard must be (re)done."""
    sidecar = read_sidecar(plan.out, shard)  # None: no record, or its tar is missing or resized
    try:  # TypeError: no sidecar
        ok = sidecar["settings_sha256"] == settings_sha256(plan.settings) and "latent_stats" in sidecar
        element = sidecar.get("element_stats")  # RAE tokens: the per-element sums' file, with its sha256
        ok = ok and (element is None or hashlib.sha256((plan.out / element).read_bytes()).hexdigest()
                     == sidecar["element_stats_sha256"])
    except (OSError, KeyError, TypeError):
        return None
    return sidecar if ok else None


def clean_unfinished(out: Path, shards: list[int]) -> None:
    """Remove temp files and half-written leftovers of the shards this process is about to redo."""
    for j in shards:
        for path in (out / shard_name(j), element_stats_path(out, j), sidecar_path(out, j)):
            for leftover in (*stale_tmps(path), path):
                leftover.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------------

def _encode_chunks(vae, x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """encode_moments over slices of at most `chunk` images, concatenated (std None: a deterministic tokenizer)."""
    parts = [vae.encode_moments(x[i : i + chunk]) for i in range(0, len(x), chunk)]
    std = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
    return torch.cat([p[0] for p in parts]), std


def encode_pixels(vae, pixels: torch.Tensor, flip: bool, progress: Progress) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (B,3,S,S) -> moments (B,F,C,h,w) fp32; the mirrored copy rides in the same encoder batch."""
    x = pixels.to(vae.device, non_blocking=True)  # (B, 3, S, S) uint8: the tokenizer scales it to [-1, 1]
    if flip:
        x = torch.cat([x, x.flip(3)])  # (2B, 3, S, S): originals, then their horizontal mirrors
    while True:
        try:
            mean, std = _encode_chunks(vae, x, progress.chunk or len(x))  # (F*B, C, h, w)
            break
        except torch.cuda.OutOfMemoryError:
            progress.chunk = max(1, (progress.chunk or len(x)) // 2)
            torch.cuda.empty_cache()
            tqdm.write(f"extract: out of GPU memory; encoding {progress.chunk} images per call from now on")
    frames = FLIP_MODES["both" if flip else "none"]
    return (mean.unflatten(0, (frames, -1)).transpose(0, 1),  # (B, F, C, h, w)
            None if std is None else std.unflatten(0, (frames, -1)).transpose(0, 1))  # None: deterministic


def produce_column(produce, pixels: torch.Tensor, flip: bool, chunk: int) -> torch.Tensor:
    """uint8 (B,3,S,S) -> a column's producer output (B,F,...) of the same flips as the moments."""
    x = torch.cat([pixels, pixels.flip(3)]) if flip else pixels  # (F*B, 3, S, S): originals, then mirrors
    step = chunk or len(x)
    out = torch.cat([produce(x[i : i + step]) for i in range(0, len(x), step)])  # (F*B, ...)
    return out.unflatten(0, (FLIP_MODES["both" if flip else "none"], -1)).transpose(0, 1)  # (B, F, ...)


def _bad_file(scan: ImageFolderScan, pos: int, reason: str, strict: bool) -> dict:
    """Record one unusable file; with --strict it ends the run instead."""
    path = scan.files[pos]
    if strict:
        raise UserError(f"bad image {scan.where(pos)}: {reason}. --strict stops at the first bad file: fix or "
                        f"remove it, or run without --strict to skip bad files and list them in {BAD_FILES_NAME}.")
    return {"path": path, "reason": reason}


def shard_columns(plan: Plan) -> dict:
    """The shards' columns {name: torch dtype}: the posterior moments (the latent alone from a deterministic
    tokenizer: no "std"), then the registered columns this run stores."""
    moments = STORAGE_DTYPES[plan.cfg.dtype]
    spread = {} if plan.kind.deterministic else {"std": moments}
    return {"mean": moments, **spread, **{name: FLAG_DTYPES[r["dtype"]] for name, r in plan.columns.items()}}


class ShardSink:
    """Receives encoded batches in shard order; each finished shard's writer publishes its tar, then its sidecar."""

    def __init__(self, plan: Plan, vae_identity: dict, batches: ShardBatches, process: dict):
        self.plan, self.identity, self.batches = plan, vae_identity, batches
        self.process = process  # {"rank", "world_size"}: which process wrote a shard (for debugging)
        self.shard, self.writer, self.bad, self.seen = None, None, [], 0

    def add(self, positions: list[int], columns: dict, bad: list[dict]) -> None:
        """Write one batch (all positions in one shard, sorted); finish the shard after its last file.

        columns: the shard's named tensors (B, F, ...) of the good images ("mean", "std", the extra columns).
        """
        shard = (positions[0] if positions else bad[0]["pos"]) // self.plan.cfg.shard_size
        if shard != self.shard:
            self._open(shard)
        labels = [self.plan.scan.labels[pos] for pos in positions]
        self.writer.add_batch([f"{pos:09d}" for pos in positions], columns, labels)
        self.bad += [{"path": b["path"], "reason": b["reason"]} for b in bad]
        self.seen += len(positions) + len(bad)
        if self.seen == len(self.batches.shard_positions(shard)):
            self._finish()

    def _open(self, shard: int) -> None:
        """Start writing a shard (its temp tar is renamed into place only when it is complete)."""
        assert self.writer is None, f"shard {self.shard} was left unfinished"
        self.shard, self.bad, self.seen = shard, [], 0
        self.writer = ShardWriter(self.plan.out / shard_name(shard), columns=shard_columns(self.plan), stats=True,
                                  element_stats=self.plan.kind.element_stats).__enter__()

    def _finish(self) -> None:
        """Close the shard: the writer publishes the tar, then its sidecar with this run's record and its statistics."""
        self.writer.close({"bad_files": self.bad, "vae": self.identity,
                           "settings_sha256": settings_sha256(self.plan.settings), "written_by": self.process})
        self.writer = None

    def abort(self) -> None:
        """Drop the temp file of a shard interrupted by an exception."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


class ShardBatches(Sampler):
    """Batches of positions, shard by shard; a batch never crosses a shard boundary.

    Batch composition then depends only on the shard, so a resumed run encodes exactly the batches an
    uninterrupted run would (bitwise-equal shards even where kernels differ by batch size).
    """

    def __init__(self, shards: list[int], shard_size: int, num_files: int, batch_size: int):
        self.shards, self.shard_size = list(shards), shard_size
        self.num_files, self.batch_size = num_files, batch_size

    def shard_positions(self, shard: int) -> range:
        """Sorted positions held by one shard."""
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, self.num_files))

    def __iter__(self):
        for shard in self.shards:
            positions = list(self.shard_positions(shard))
            for start in range(0, len(positions), self.batch_size):
                yield positions[start : start + self.batch_size]

    def __len__(self) -> int:
        return sum(-(-len(self.shard_positions(s)) // self.batch_size) for s in self.shards)


def _split_batch(batch: dict, scan: ImageFolderScan, strict: bool) -> tuple[list[int], torch.Tensor, list[dict]]:
    """Separate readable images from bad ones (recorded with their sorted position)."""
    raise_fatal(batch["fatal"])  # a source's shard that cannot be read ends the run; the finished shards are kept
    good, bad = [], []
    for k, (pos, error) in enumerate(zip(batch["pos"].tolist(), batch["error"])):
        if error:
            bad.append({"pos": pos, **_bad_file(scan, pos, error, strict)})
        else:
            good.append(k)
    positions = [int(batch["pos"][k]) for k in good]
    pixels = batch["pixels"] if not bad else batch["pixels"][good]  # keep the pinned buffer when all are good
    return positions, pixels, bad


def encode_shards(plan: Plan, shards: list[int], vae, state, producers=None) -> Progress:
    """Decode (workers) -> encode (device) -> write, for the given shards; returns this process's counts."""
    cfg, device, show = plan.cfg, state.device, state.is_local_main_process
    batches = ShardBatches(shards, cfg.shard_size, len(plan.scan), cfg.batch_size)
    dataset = ImageFileDataset(plan.scan, cfg.image_size, cfg.max_image_pixels)
    loader = make_loader(dataset, batches, default_workers(cfg, state.num_processes),
                         pin_memory=torch.device(device).type == "cuda")
    process = {"rank": state.process_index, "world_size": state.num_processes}
    sink, progress, dtypes = ShardSink(plan, vae.identity, batches, process), Progress(), shard_columns(plan)
    total = sum(len(batches.shard_positions(j)) for j in shards)
    bar = tqdm(total=total, unit="img", desc="extract", disable=not show, dynamic_ncols=True, smoothing=0.1)
    try:
        for batch in loader:
            positions, pixels, bad = _split_batch(batch, plan.scan, cfg.strict)
            columns = {}
            if positions:
                mean, std = encode_pixels(vae, pixels, cfg.flip == "both", progress)  # (B, F, C, h, w) each
                for name, produce in (producers or {}).items():
                    columns[name] = produce_column(produce, pixels.to(device, non_blocking=True), cfg.flip == "both",
                                                   progress.chunk)  # (B, F, ...)
                # one device->host copy per batch, already in the storage dtype (not one per sample)
                moments = {"mean": mean, **({"std": std} if std is not None else {})}
                columns = {name: t.to("cpu", dtypes[name]) for name, t in {**moments, **columns}.items()}
            for b in bad:
                tqdm.write(f"extract: skipped bad image {b['path']}: {b['reason']}")
            sink.add(positions, columns, bad)
            progress.encoded += len(positions)
            progress.bad += bad
            bar.update(len(positions) + len(bad))
            bar.set_postfix(bad=len(progress.bad), refresh=False)
    except BaseException:
        sink.abort()
        raise
    finally:
        bar.close()
    return progress


def default_workers(cfg: ExtractConfig, num_processes: int) -> int:
    """--num-workers, or up to 8 decoding processes per extract process, leaving one core for the main loop."""
    if cfg.num_workers is not None:
        return cfg.num_workers
    return shared_default_workers(8, num_processes)


# ----------------------------------------------------------------------------------------------------------
# Finishing: bad-file report, then index.json last
# ----------------------------------------------------------------------------------------------------------

def folder_space(space: LatentSpace, out: Path, sidecars: list[dict], images: int, flips: int) -> LatentSpace:
    """The tokenizer's space with the folder's statistics, merged from every shard's partial sums."""
    stats = ChannelStats()
    for sidecar in sidecars:
        stats.merge(ChannelStats.from_dict(sidecar["latent_stats"]))
    channel, statistics = stats.summary(images, flips, bool(space.tokenizer.get("deterministic")))
    norms = {"channel": channel}
    if "element_stats" in sidecars[0]:  # the per-element statistics RAE normalises with, merged the same way
        elements = ElementStats()
        for sidecar in sidecars:
            elements.merge(ElementStats.from_bytes((out / sidecar["element_stats"]).read_bytes()))
        norms["element"], statistics["element"] = elements.summary(images, flips)
    return space.with_norms(statistics, **norms)


def _tokenizer_space(plan: Plan) -> LatentSpace:
    """The tokenizer's space when this process encoded nothing in this run: the tokenizer loaded on the CPU."""
    return LatentSpace.of_tokenizer(_load_vae(plan, "cpu"), plan.cfg.image_size, plan.latent_shape, plan.scan.classes)


def write_outputs(plan: Plan, tokenizer_space: LatentSpace | None = None) -> dict:
    """Collect every sidecar, write the bad-file report, the latent space, then the index (last); a summary."""
    out = plan.out
    sidecars = [read_finished(plan, j) for j in range(plan.num_shards)]
    missing = [shard_name(j) for j, s in enumerate(sidecars) if s is None]
    assert not missing, f"shards not finished: {missing[:5]}"  # every process finished its shards before this
    shards = [s["shard"] for s in sidecars]  # each ShardWriter's own record of its tar
    damaged = damaged_files(out, shards)  # the index records verified hashes only
    if damaged:
        raise damaged_error(out, damaged)
    bad = [b for s in sidecars for b in s["bad_files"]]
    images = sum(s["num_samples"] for s in shards)
    if not images:
        raise UserError(f"none of the {len(plan.scan)} images in {plan.scan.root} could be read; see "
                        f"{out / BAD_FILES_NAME} for the reasons.")
    atomic_write_text(out / BAD_FILES_NAME, "".join(json.dumps(b) + "\n" for b in bad))
    space = folder_space(tokenizer_space or _tokenizer_space(plan), out, sidecars, images, FLIP_MODES[plan.cfg.flip])
    write_index(out, shards, index_meta(plan, space.write(out), len(bad)))
    return {"num_samples": images, "num_bad": len(bad), "num_shards": len(shards),
            "too_large": sum(b["reason"].startswith(BOMB_REASON) for b in bad)}


def index_meta(plan: Plan, space_sha256: str, num_bad: int) -> dict:
    """The metadata index.json carries besides the shard list."""
    return {
        "image_size": plan.cfg.image_size,
        "num_classes": len(plan.scan.classes),
        "class_names": plan.scan.classes,
        "latent_space": space_sha256,  # of latent_space.json + latent_space.safetensors (shared/tokenizers/space.py)
        "preprocessing": "adm_center_crop",
        "dataset": {"path": str(plan.scan.root), "num_files": len(plan.scan), "num_bad_files": num_bad,
                    "files_sha256": plan.scan.fingerprint()},
        "extract_settings": plan.settings,
        **column_records(plan.columns),
        **({"plugins": plugins} if (plugins := used_plugins(plan)) else {}),
    }


def used_plugins(plan: Plan) -> list[str]:
    """The --plugin modules that register this folder's tokenizer class or columns (train must import them too)."""
    records = [plan.kind, *(columns()[n] for n in plan.columns)]
    return sorted({plugin_of(r) for r in records} - {""})


# ----------------------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------------------

def _pending(plan: Plan, state) -> tuple[list[int], int]:
    """This process's shards (j % world == rank) not finished or failing their sha256; and how many failed."""
    mine = range(state.process_index, plan.num_shards, state.num_processes)
    sidecars = {j: read_finished(plan, j) for j in mine}
    damaged = damaged_files(plan.out, [s["shard"] for s in sidecars.values() if s],
                            progress=state.is_local_main_process)
    for name, problem in sorted(damaged.items()):
        tqdm.write(f"extract: {name} {problem}: encoding it again")
    return [j for j in mine if sidecars[j] is None or shard_name(j) in damaged], len(damaged)


def _load_vae(plan: Plan, device):
    """The VAE on the encoding device (fp32 encoder)."""

    return load_tokenizer(plan.cfg.vae, device=device, config=plan.cfg.vae_config)


def _load_producers(plan: Plan, device) -> dict:
    """{name: producer} of the stored columns, loaded onto the encoding device."""
    return {name: columns()[name].load(columns()[name].extract_options(plan.cfg.column_flags), record, device)
            for name, record in plan.columns.items()}


def _hold_out(out: Path, state):
    """The lock on --out, taken by the main process (the others write only the shards of its run)."""
    return hold_lock(out, FOLDER_KIND) if state.is_main_process else contextlib.nullcontext()


def run_extract(cfg: ExtractConfig) -> dict:
    """Lock --out, plan, encode this process's pending shards, then (one process) write the report and index."""
    state = process_state()
    out = Path(cfg.out)
    check_flags(cfg)  # before the lock: a bad flag or an --out among the images leaves no lock file behind
    # The lock first: a second run into the same --out is refused at once, not after scanning and hashing the
    # whole folder (minutes on ImageNet).
    with _hold_out(out, state):
        shared_listing = state.num_processes > 1 and lists_source(cfg.data_path)
        if shared_listing and not state.is_main_process:
            state.wait_for_everyone()  # the main process reads the source once; the others read its listing
        plan = make_plan(cfg, check_out=False)  # every process runs the same checks: all fail alike, before weights
        plan.warnings += check_out_folder(out, plan.settings)  # under the lock: no other run changes it now
        if shared_listing and state.is_main_process:
            keep_listing(plan)
            state.wait_for_everyone()
        return _extract(plan, state)


def lists_source(data_path) -> bool:
    """True for tar shards and parquet, whose listing reads every byte (a folder's scan only stats files)."""
    try:
        return source_kind(str(data_path)) != "folder"
    except UserError:
        return False  # each process refuses it in make_plan()


def keep_listing(plan: Plan) -> None:
    """Write a listing made by this run into --out (once), where a rerun and the other processes read it."""
    if plan.listing_key is not None:
        plan.out.mkdir(parents=True, exist_ok=True)
        save_listing(plan.scan, plan.out / LISTING_NAME, plan.listing_key)
        plan.listing_key = None


def _extract(plan: Plan, state) -> dict:
    """The run itself, once --out is locked and checked."""
    out = plan.out
    if state.is_main_process:
        for warning in plan.warnings:
            print(f"extract: warning: {warning}", file=sys.stderr)
    state.wait_for_everyone()
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / SETTINGS_NAME, json.dumps(plan.settings, indent=1) + "\n")  # readers see all or none
        keep_listing(plan)  # a rerun reads it instead of the whole source again
    state.wait_for_everyone()
    pending, damaged = _pending(plan, state)
    clean_unfinished(out, pending)
    progress, elapsed, space = Progress(damaged=damaged), 0.0, None
    if pending:
        vae = _load_vae(plan, state.device)
        space = LatentSpace.of_tokenizer(vae, plan.cfg.image_size, plan.latent_shape, plan.scan.classes)
        producers = _load_producers(plan, state.device)
        start = time.perf_counter()  # the rate below is decode + encode + write, without the VAE load
        progress = encode_shards(plan, pending, vae, state, producers)
        progress.damaged = damaged
        elapsed = time.perf_counter() - start
    state.wait_for_everyone()  # every shard finished before the index
    summary = {}
    if state.is_main_process:
        summary = write_outputs(plan, space)
        summary.update(encoded_here=progress.encoded, seconds=elapsed, shards_here=len(pending),
                       damaged_here=progress.damaged, skipped=plan.scan.skipped.describe(), out=str(out),
                       notes=list(plan.scan.notes), processes=state.num_processes)
    state.wait_for_everyone()
    return summary


def format_summary(summary: dict) -> str:
    """The lines printed at the end of a run."""
    rate = summary["encoded_here"] / summary["seconds"] if summary["seconds"] > 0 else 0.0
    damaged = f", {summary['damaged_here']} of them damaged" if summary.get("damaged_here") else ""
    return "\n".join([
        f"extract: {counted(summary['num_samples'], 'image')} in {counted(summary['num_shards'], 'shard')}, "
        f"{counted(summary['num_bad'], 'bad file')} skipped (listed in {BAD_FILES_NAME})",
        *([f"extract: {summary['too_large']} of them {'has' if summary['too_large'] == 1 else 'have'} more pixels than --max-image-pixels allows; if you trust "
           f"the folder, rerun with a larger --max-image-pixels (or none) into a new --out to include them"]
          if summary.get("too_large") else []),
        f"extract: while scanning {summary['skipped']}",
        *(f"extract: {note}" for note in summary.get("notes", ())),
        f"extract: this run encoded {counted(summary['encoded_here'], 'image')} in {summary['seconds']:.1f}s "
        f"({rate:.1f} images/s on process 0 of {summary['processes']}; {counted(summary['shards_here'], 'shard')}"
        f"{damaged})",
        f"extract: every shard verified against its sha256; index written: {Path(summary['out']) / INDEX_NAME}",
    ])
