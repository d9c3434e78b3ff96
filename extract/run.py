"""The extraction job: plan and check before loading anything, encode shard by shard, resume, index last.

Shard j holds the files at sorted positions [j*S, (j+1)*S); process r of W encodes the shards j with j % W == r. A
shard is finished when its tar and then its sidecar (`shard-NNNNNN.done.json`, ShardWriter.close) exist and its bytes
still match the sidecar's sha256; a rerun skips finished shards and redoes the rest, damaged ones included. Then one
process hashes them all (the index records only verified hashes), writes the bad-file report and index.json (last).
The main process holds the folder's lock (shared/runtime/lock.py) for the whole run.
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

from extract.config import (BAD_FILES_NAME, SETTINGS_NAME, ExtractConfig, Plan, check_flags, check_out_folder,
                            column_records, make_plan)
from shared.datasets.columns import columns, plugin_of
from shared.datasets.imagefolder import ImageFolderScan
from shared.datasets.images import BOMB_REASON, ImageFileDataset, make_loader, raise_fatal
from shared.datasets.integrity import damaged_error, damaged_files
from shared.datasets.shards import (FLAG_DTYPES, FLIP_MODES, FOLDER_KIND, INDEX_NAME, STORAGE_DTYPES, ChannelStats,
                                    ElementStats, ShardWriter, element_stats_path, read_sidecar, shard_name,
                                    sidecar_path, write_index)
from shared.datasets.sources import LISTING_NAME, save_listing, source_kind
from shared.runtime.cli import counted
from shared.runtime.distributed import default_workers, process_state
from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write_text, stale_tmps
from shared.runtime.lock import hold_lock
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace


@dataclass
class Progress:
    """Counters of this process's work, for the bar and the summary."""

    encoded: int = 0
    bad: list = field(default_factory=list)
    chunk: int = 0  # images per encoder call (halved on CUDA out-of-memory)


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


def encode_pixels(vae, pixels: torch.Tensor, flip: bool, progress: Progress) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (B,3,S,S) -> moments (B,F,C,h,w) fp32; the mirrored copy rides in the same encoder batch."""
    x = pixels.to(vae.device, non_blocking=True)  # (B, 3, S, S) uint8: the tokenizer scales it to [-1, 1]
    if flip:
        x = torch.cat([x, x.flip(3)])  # (2B, 3, S, S): originals, then their horizontal mirrors
    while True:
        step = progress.chunk or len(x)
        try:
            parts = [vae.encode_moments(x[i : i + step]) for i in range(0, len(x), step)]  # (mean, std) per slice
            break
        except torch.cuda.OutOfMemoryError:
            progress.chunk = max(1, step // 2)
            torch.cuda.empty_cache()
            tqdm.write(f"extract: out of GPU memory; encoding {progress.chunk} images per call from now on")
    frames = FLIP_MODES["both" if flip else "none"]
    # (F*B, C, h, w) slices -> (B, F, C, h, w) each; std None: a deterministic tokenizer
    return tuple(None if p[0] is None else torch.cat(p).unflatten(0, (frames, -1)).transpose(0, 1) for p in zip(*parts))


def produce_column(produce, pixels: torch.Tensor, flip: bool, chunk: int) -> torch.Tensor:
    """uint8 (B,3,S,S) -> a column's producer output (B,F,...) of the same flips as the moments."""
    x = torch.cat([pixels, pixels.flip(3)]) if flip else pixels  # (F*B, 3, S, S): originals, then mirrors
    step = chunk or len(x)
    out = torch.cat([produce(x[i : i + step]) for i in range(0, len(x), step)])  # (F*B, ...)
    return out.unflatten(0, (FLIP_MODES["both" if flip else "none"], -1)).transpose(0, 1)  # (B, F, ...)


def shard_columns(plan: Plan) -> dict:
    """The shards' columns {name: torch dtype}: "mean", "std" (not from a deterministic tokenizer), the registered."""
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
        """One batch of one shard (sorted; `columns` {name: (B, F, ...)} of its good images), closing it at its end."""
        shard = (positions[0] if positions else bad[0]["pos"]) // self.plan.cfg.shard_size
        if shard != self.shard:  # a new shard: its temp tar is renamed into place only when it is complete
            assert self.writer is None, f"shard {self.shard} was left unfinished"
            self.shard, self.bad, self.seen = shard, [], 0
            self.writer = ShardWriter(self.plan.out / shard_name(shard), columns=shard_columns(self.plan), stats=True,
                                      element_stats=self.plan.kind.element_stats).__enter__()
        labels = [self.plan.scan.labels[pos] for pos in positions]
        self.writer.add_batch([f"{pos:09d}" for pos in positions], columns, labels)
        self.bad += [{"path": b["path"], "reason": b["reason"]} for b in bad]
        self.seen += len(positions) + len(bad)
        if self.seen == len(self.batches.shard_positions(shard)):  # its last file: the tar, then its sidecar
            self.writer.close({"bad_files": self.bad, "vae": self.identity,
                               "settings_sha256": settings_sha256(self.plan.settings), "written_by": self.process})
            self.writer = None

    def abort(self) -> None:
        """Drop the temp file of a shard interrupted by an exception."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


class ShardBatches(Sampler):
    """Batches of positions, shard by shard, never across a shard boundary: a resumed run encodes exactly the batches
    an uninterrupted run would (bitwise-equal shards even where kernels differ by batch size)."""

    def __init__(self, shards: list[int], shard_size: int, num_files: int, batch_size: int):
        self.shards, self.shard_size, self.num_files, self.batch_size = list(shards), shard_size, num_files, batch_size

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
    every = batch["pos"].tolist()
    bad = [{"pos": pos, "path": scan.files[pos], "reason": error} for pos, error in zip(every, batch["error"]) if error]
    if bad and strict:
        raise UserError(f"bad image {scan.where(bad[0]['pos'])}: {bad[0]['reason']}. --strict stops at the first bad "
                        f"file: fix or remove it, or run without --strict to skip bad files and list them in "
                        f"{BAD_FILES_NAME}.")
    good = [k for k, error in enumerate(batch["error"]) if not error]
    pixels = batch["pixels"][good] if bad else batch["pixels"]  # the pinned buffer kept when all are good
    return [every[k] for k in good], pixels, bad


def encode_shards(plan: Plan, shards: list[int], vae, state, producers: dict) -> Progress:
    """Decode (workers) -> encode (device) -> write, for the given shards; returns this process's counts."""
    cfg, device, show = plan.cfg, state.device, state.is_local_main_process
    batches = ShardBatches(shards, cfg.shard_size, len(plan.scan), cfg.batch_size)
    dataset = ImageFileDataset(plan.scan, cfg.image_size, cfg.max_image_pixels)
    # --num-workers, or up to 8 decoding processes per extract process, leaving one core for the main loop
    workers = cfg.num_workers if cfg.num_workers is not None else default_workers(8, state.num_processes)
    loader = make_loader(dataset, batches, workers, pin_memory=torch.device(device).type == "cuda")
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
                columns = {"mean": mean, **({"std": std} if std is not None else {})}
                for name, produce in producers.items():
                    columns[name] = produce_column(produce, pixels.to(device, non_blocking=True), cfg.flip == "both",
                                                   progress.chunk)  # (B, F, ...)
                # one device->host copy per batch, already in the storage dtype (not one per sample)
                columns = {name: t.to("cpu", dtypes[name]) for name, t in columns.items()}
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


def _tokenizer_space(plan: Plan, vae=None) -> LatentSpace:
    """The tokenizer's latent space for this run (vae None: this process encoded nothing; loaded on the CPU)."""
    vae = _load_vae(plan, "cpu") if vae is None else vae
    return LatentSpace.of_tokenizer(vae, plan.cfg.image_size, plan.latent_shape, plan.scan.classes)


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
    # the --plugin modules that register this folder's tokenizer class or columns (train must import them too)
    plugins = sorted({plugin_of(r) for r in (plan.kind, *(columns()[n] for n in plan.columns))} - {""})
    scan = plan.scan
    return {"image_size": plan.cfg.image_size, "num_classes": len(scan.classes), "class_names": scan.classes,
            "latent_space": space_sha256,  # of latent_space.json + .safetensors (shared/tokenizers/space.py)
            "preprocessing": "adm_center_crop",
            "dataset": {"path": str(scan.root), "num_files": len(scan), "num_bad_files": num_bad,
                        "files_sha256": scan.fingerprint()},
            "extract_settings": plan.settings, **column_records(plan.columns),
            **({"plugins": plugins} if plugins else {})}


def _load_vae(plan: Plan, device):
    """The VAE on the encoding device (fp32 encoder)."""
    return load_tokenizer(plan.cfg.vae, device=device, config=plan.cfg.vae_config)


def run_extract(cfg: ExtractConfig) -> dict:
    """Lock --out, plan, encode this process's pending shards, then (one process) write the report and index."""
    state = process_state()
    out = Path(cfg.out)
    check_flags(cfg)  # before the lock: a bad flag or an --out among the images leaves no lock file behind
    # The lock first: a second run into the same --out is refused at once, not after scanning and hashing the
    # whole folder (minutes on ImageNet). The main process takes it; the others write only the shards of its run.
    with hold_lock(out, FOLDER_KIND) if state.is_main_process else contextlib.nullcontext():
        try:  # tar shards and parquet, whose listing reads every byte (a folder's scan only stats files)
            shared_listing = state.num_processes > 1 and source_kind(str(cfg.data_path)) != "folder"
        except UserError:
            shared_listing = False  # each process refuses it in make_plan()
        if shared_listing and not state.is_main_process:
            state.wait_for_everyone()  # the main process reads the source once; the others read its listing
        plan = make_plan(cfg, check_out=False)  # every process runs the same checks: all fail alike, before weights
        plan.warnings += check_out_folder(out, plan.settings)  # under the lock: no other run changes it now
        if shared_listing and state.is_main_process:
            keep_listing(plan)
            state.wait_for_everyone()
        return _extract(plan, state)


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
    # this process's shards (j % world == rank) not finished or failing their sha256
    mine = range(state.process_index, plan.num_shards, state.num_processes)
    sidecars = {j: read_finished(plan, j) for j in mine}
    damaged = damaged_files(out, [s["shard"] for s in sidecars.values() if s], progress=state.is_local_main_process)
    for name, problem in sorted(damaged.items()):
        tqdm.write(f"extract: {name} {problem}: encoding it again")
    pending = [j for j in mine if sidecars[j] is None or shard_name(j) in damaged]
    for j in pending:  # the temp files and half-written leftovers of the shards this process is about to redo
        for path in (out / shard_name(j), element_stats_path(out, j), sidecar_path(out, j)):
            for leftover in (*stale_tmps(path), path):
                leftover.unlink(missing_ok=True)
    progress, elapsed, space = Progress(), 0.0, None
    if pending:
        vae = _load_vae(plan, state.device)
        space = _tokenizer_space(plan, vae)
        producers = {name: columns()[name].load(columns()[name].extract_options(plan.cfg.column_flags), record,
                                                state.device) for name, record in plan.columns.items()}
        start = time.perf_counter()  # the rate below is decode + encode + write, without the VAE load
        progress = encode_shards(plan, pending, vae, state, producers)
        elapsed = time.perf_counter() - start
    state.wait_for_everyone()  # every shard finished before the index
    summary = {}
    if state.is_main_process:
        summary = write_outputs(plan, space)
        summary.update(encoded_here=progress.encoded, seconds=elapsed, shards_here=len(pending),
                       damaged_here=len(damaged), skipped=plan.scan.skipped.describe(), out=str(out),
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
        *([f"extract: {summary['too_large']} of them {'has' if summary['too_large'] == 1 else 'have'} more pixels "
           f"than --max-image-pixels allows; if you trust the folder, rerun with a larger --max-image-pixels (or "
           f"none) into a new --out to include them"]
          if summary.get("too_large") else []),
        f"extract: while scanning {summary['skipped']}",
        *(f"extract: {note}" for note in summary.get("notes", ())),
        f"extract: this run encoded {counted(summary['encoded_here'], 'image')} in {summary['seconds']:.1f}s "
        f"({rate:.1f} images/s on process 0 of {summary['processes']}; {counted(summary['shards_here'], 'shard')}"
        f"{damaged})",
        f"extract: every shard verified against its sha256; index written: {Path(summary['out']) / INDEX_NAME}",
    ])
