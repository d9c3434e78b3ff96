"""Where training's latents come from: a local folder, or a URL copied once to local disk; opened once per node.

A URL (anything fsspec knows) is copied into ~/.cache/dit-latent-pipeline/latents/<sha256 of index.json, 16 hex>/
(or $DIT_LATENT_CACHE/<...>) and read exactly as a local folder, bit for bit; index.json is written last. With
--cache-limit SIZE the folder is streamed (StreamedLatents, ShardStream): one thread per node keeps only the shards
of the current and next window of windowed_permutation's order, publishes each once its sha256 matches, deletes those
every process of the node has consumed (fsspec's caches have no size bound nor sha256 check; webdataset's FileCache
overshoots and may drop a shard still needed; mosaicml-streaming reads only its own MDS shards). A fetch failure is
written to the folder (STREAM_ERROR_NAME), so every waiting reader stops with the same paragraph.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from shared.datasets.integrity import sha256_file
from shared.runtime.errors import UserError, disk_full
from shared.runtime.fsio import TMP_PREFIX, atomic_write_bytes, atomic_write_text, user_cache
from shared.datasets.shards import ARRAYS_NAME, INDEX_NAME, LatentDataset
from train.units import parse_size
from shared.tokenizers.space import SPACE_JSON, SPACE_TENSORS

CACHE_ENV = "DIT_LATENT_CACHE"  # overrides the cache root (a fast local disk, per node)
_CHUNK = 16 << 20
STREAM_ERROR_NAME = ".stream-error.txt"  # why the node's fetcher stopped; every waiting reader raises it
FETCH_ATTEMPTS = 4  # tries per shard before a dropped connection is reported (waits 1, 2, 4 s between)
_POLL_S = 0.02  # how often a reader looks for a shard it waits for


def byte_size(text: str) -> int:
    """argparse type: '20GiB', '500MB', '1.5TB', '4096' -> bytes (train/units.py's vocabulary), more than 0."""
    try:
        size = parse_size(text)
    except UserError:
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 20GiB or 500MB, got {text!r}")
    return size


def show_size(n: int) -> str:
    """Bytes in the unit byte_size reads back (binary units, one decimal, rounded up so it is enough)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{np.ceil(n / scale * 10) / 10:g}{unit}"
    return f"{n}B"


def is_url(source: str) -> bool:
    """Whether --latents names a remote location (protocol://...) rather than a local folder."""
    return "://" in str(source) and not str(source).startswith("file://")


def _open_remote(fs, path: str):
    """A remote file for reading start to end; over http(s) one streaming GET (static servers often lack ranges)."""
    http = any(str(p).startswith("http") for p in np.atleast_1d(fs.protocol))
    return fs.open(path, "rb", **({"block_size": 0} if http else {}))


def _copy_file(fs, remote: str, local: Path) -> None:
    """Stream one remote file to local (temp name, then rename: a kill never leaves a short file in place)."""
    tmp = local.with_name(f".tmp-{local.name}")
    with _open_remote(fs, remote) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, _CHUNK)
    os.replace(tmp, local)


def remote_index(url: str):
    """(fs, root inside it, index.json bytes, parsed index, local cache folder) of a remote latent folder."""
    try:
        import fsspec
    except ImportError:
        raise UserError(f"--latents {url} is a URL; reading it needs fsspec (pip install fsspec).") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise UserError(f"--latents {url}: {str(err).splitlines()[0]} (fsspec needs a package per protocol: "
                        "s3fs for s3://, gcsfs for gs://, huggingface_hub for hf://). Install it, or copy the "
                        "folder to a local disk and pass its path.") from None
    root = root.rstrip("/")
    try:
        index_bytes = fs.cat_file(f"{root}/{INDEX_NAME}")
    except FileNotFoundError:
        raise UserError(f"--latents {url} has no {INDEX_NAME}: pass the URL of a finished latent folder (the one "
                        "`python -m extract --out` wrote, copied whole).") from None
    except OSError as err:
        raise UserError(f"--latents {url}: cannot read {root}/{INDEX_NAME} ({err}).") from None
    try:
        index = json.loads(index_bytes)
        [*index["shards"], index["arrays"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--latents {url}: its {INDEX_NAME} is not a latent index; pass a folder extract "
                        "wrote.") from None
    cache = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else user_cache("latents")  # this machine's
    return fs, root, index_bytes, index, cache / hashlib.sha256(index_bytes).hexdigest()[:16]


def _fetch_missing(fs, root: str, local: Path, entry: dict) -> None:
    """Copy one listed file unless the cache already holds it at its listed size (an interrupted copy resumes)."""
    if not ((local / entry["name"]).is_file() and (local / entry["name"]).stat().st_size == entry["size"]):
        _copy_file(fs, f"{root}/{entry['name']}", local / entry["name"])


def fetch_space(fs, root: str, local: Path, index: dict) -> None:
    """Copy the folder's LatentSpace files (shared/tokenizers/space.py; checked against index.json when opened)."""
    for name in (SPACE_TENSORS, SPACE_JSON) if "latent_space" in index else ():
        if fs.exists(f"{root}/{name}"):  # else opening says which file is missing
            _copy_file(fs, f"{root}/{name}", local / name)


def fetch_latents(url: str) -> Path:
    """Copy a remote latent folder into the local cache (only what is missing); returns the local folder."""
    fs, root, index_bytes, index, local = remote_index(url)
    local.mkdir(parents=True, exist_ok=True)
    fetch_space(fs, root, local, index)
    for entry in [*index["shards"], index["arrays"]]:
        _fetch_missing(fs, root, local, entry)
    if not (local / INDEX_NAME).is_file():
        atomic_write_bytes(local / INDEX_NAME, index_bytes)  # last: a complete copy
    return local


def open_latents(source: str, accelerator=None, cache_limit: int | None = None) -> LatentDataset:
    """Open --latents (fetched first when a URL, streamed with a cache_limit); one process per machine goes first."""
    if cache_limit is not None and not is_url(source):
        raise UserError(f"--cache-limit bounds the local copy of a --latents URL, but {source} is a local folder, "
                        "read in place. Drop --cache-limit (pass --shard-window K to train in the order a streamed "
                        "run with that window uses).")
    first = accelerator is None or accelerator.is_local_main_process
    several = accelerator is not None and accelerator.num_processes > 1
    if several and not first:
        accelerator.wait_for_everyone()  # the node's first process is fetching and hashing
    try:
        if cache_limit is not None:
            return open_streamed(source, cache_limit, fetcher=first)
        # the node's other processes find every shard in verified-sha256.json
        return LatentDataset(fetch_latents(source) if is_url(source) else Path(str(source).removeprefix("file://")))
    finally:
        if several and first:
            accelerator.wait_for_everyone()  # even when it failed: the others then report it themselves


# ---- Streaming through a bounded cache (--cache-limit) ----

def open_streamed(url: str, limit: int, fetcher: bool) -> "StreamedLatents":
    """The cache folder of `url` with index.json and the sidecar only; the fetcher process also owns the stream."""
    fs, root, index_bytes, index, local = remote_index(url)
    space = sum(fs.size(f"{root}/{name}") for name in (SPACE_TENSORS, SPACE_JSON) if fs.exists(f"{root}/{name}"))
    fixed = len(index_bytes) + int(index["arrays"]["size"]) + space  # kept beside the shards
    largest, budget = max(index["shards"], key=lambda e: e["size"]), limit - fixed  # what the shards may use
    if budget < 2 * largest["size"]:  # two of the largest shards must fit
        total = fixed + sum(e["size"] for e in index["shards"])
        raise UserError(f"--cache-limit {show_size(limit)} is too small for --latents {url}: its largest shard, "
                        f"{largest['name']}, is {show_size(largest['size'])}, and the streamed cache holds at least "
                        f"two shards (the one training and the next, fetched ahead) beside {INDEX_NAME}, {ARRAYS_NAME} "
                        f"and the latent-space record ({show_size(fixed)}). Pass --cache-limit "
                        f"{show_size(fixed + 2 * largest['size'])} or more, or drop --cache-limit to copy the whole "
                        f"folder ({show_size(total)}) once.")
    if fetcher:
        local.mkdir(parents=True, exist_ok=True)
        for stale in [*local.glob(f"{TMP_PREFIX}*"), local / STREAM_ERROR_NAME]:
            stale.unlink(missing_ok=True)  # an interrupted fetch, a failure of an earlier run
        arrays = index["arrays"]
        try:
            _fetch_missing(fs, root, local, arrays)
        except OSError as err:  # FileNotFoundError included; the sidecar's sha256 is checked when it is opened
            raise disk_full(err, local / arrays["name"]) or UserError(
                f"--latents {url}: cannot fetch {arrays['name']} ({err}). Check that the whole folder extract "
                "wrote is there and the connection holds, then rerun the same command.") from None
        fetch_space(fs, root, local, index)
        if not (local / INDEX_NAME).is_file():
            atomic_write_bytes(local / INDEX_NAME, index_bytes)
    dataset = StreamedLatents(local, budget)
    if fetcher:
        dataset.stream = ShardStream(fs, root, url, local, index["shards"], budget)
    return dataset


class StreamedLatents(LatentDataset):
    """A LatentDataset whose shards arrive while it trains: readers wait for a shard, drop those evicted. Each shard
    was sha256-checked by ShardStream before it got its name, so opening hashes nothing."""

    def __init__(self, root, budget: int):
        self.budget, self.stream, self._inodes = budget, None, {}  # stream: the node's fetcher (local main process)
        super().__init__(root, verify=False, progress=False)

    def _check_files(self, verify: bool, progress: bool) -> None:
        """Nothing to check up front: ShardStream verifies each shard as it arrives."""

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["stream"], state["_inodes"] = None, {}  # the fetcher thread stays in the process that runs it
        return state

    def stream_error(self) -> UserError | None:
        """The paragraph the node's fetcher stopped with, if it did."""
        if self.stream is not None and self.stream.error is not None:
            return self.stream.error
        try:
            return UserError((self.root / STREAM_ERROR_NAME).read_text())
        except OSError:
            return None

    def _map(self, shard: int):
        if shard not in self._maps:
            path = self.root / self.meta["shards"][shard]["name"]
            while not path.is_file():  # the fetcher publishes it once its sha256 matched
                error = self.stream_error()
                if error is not None:
                    raise error
                time.sleep(_POLL_S)
            self._inodes[shard] = path.stat().st_ino
        return super()._map(shard)

    def _drop_evicted(self, keep) -> None:
        """Unmap shards whose file was deleted (or replaced), so their disk space really comes back."""
        for shard in [s for s in self._maps if s not in keep]:
            try:
                current = (self.root / self.meta["shards"][shard]["name"]).stat().st_ino
            except OSError:
                current = None
            if current != self._inodes.get(shard):
                view, mapping = self._bytes.pop(shard, None), self._maps.pop(shard)
                try:
                    if view is not None:
                        view.release()
                    mapping.close()
                except BufferError:  # a tensor from __getitem__ still views it: freed when that tensor is
                    pass

    def gather(self, indices, columns=None, frames=None) -> dict:
        idx = np.asarray(indices, dtype=np.int64)
        self._drop_evicted(set((np.searchsorted(self._starts, idx, side="right") - 1).tolist()))
        return super().gather(idx, columns, frames)


class ShardStream:
    """The node's fetcher thread: keeps only the shards of the window holding `consumed` (the stream position every
    process of the node has trained past, advanced by `follow`) and of the next one in the cache, fetched in order."""

    def __init__(self, fs, remote_root: str, url: str, local: Path, shards: list[dict], budget: int):
        self.fs, self.remote_root, self.url, self.local = fs, remote_root, url, local
        self.shards, self.budget = shards, budget
        self.counts = np.array([e["num_samples"] for e in shards], dtype=np.int64)
        self.present = set()  # the shards an earlier run left in the cache that still hold their listed bytes
        for i, path in enumerate(local / entry["name"] for entry in shards):
            if path.is_file() and path.stat().st_size == shards[i]["size"] and sha256_file(path) == shards[i]["sha256"]:
                self.present.add(i)
            elif path.is_file():
                path.unlink()  # a leftover that no longer holds them
        self.cond = threading.Condition()
        self.consumed, self.seed, self.window, self.thread, self._epochs = 0, 0, 0, None, {}
        self.error, self.stopped = None, False  # error: the UserError the fetcher stopped with

    def start(self, seed: int, window: int, start: int) -> None:
        """Begin fetching for the stream position `start` (a resumed run's data position)."""
        self.seed, self.window, self.consumed = seed, window, start
        self.thread = threading.Thread(target=self._run, name="latent-stream", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread after its current fetch (training is over: the loader was dropped)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def advance(self, position: int) -> None:
        """Every process of the node has consumed the stream before `position`."""
        with self.cond:
            if position > self.consumed:
                self.consumed = position
                self.cond.notify_all()

    def _windows(self, epoch: int) -> tuple[list, np.ndarray]:
        """(windows of shard numbers, cumulative samples at each window's end) of one epoch."""
        if epoch not in self._epochs:
            wins = ([np.arange(len(self.shards))] if not self.window
                    else shard_windows(len(self.shards), self.seed, epoch, self.window))
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = wins, np.cumsum([self.counts[w].sum() for w in wins])
        return self._epochs[epoch]

    def needed(self, position: int) -> list[int]:
        """Shard numbers of the window holding `position` and of the one after it, in fetch order."""
        epoch, offset = divmod(position, int(self.counts.sum()))
        wins, ends = self._windows(epoch)
        j = int(np.searchsorted(ends, offset, side="right"))
        after = wins[j + 1] if j + 1 < len(wins) else self._windows(epoch + 1)[0][0]
        return list(dict.fromkeys([*wins[j].tolist(), *after.tolist()]))

    def _run(self) -> None:
        try:
            while not self.stopped:
                with self.cond:
                    position = self.consumed
                need = self.needed(position)
                for shard in sorted(self.present - set(need)):
                    (self.local / self.shards[shard]["name"]).unlink(missing_ok=True)  # consumed by every process
                    self.present.discard(shard)
                missing = [s for s in need if s not in self.present]
                if missing:
                    self._fetch(missing[0])
                    continue
                with self.cond:
                    self.cond.wait_for(lambda: self.consumed != position or self.stopped)
        except UserError as err:
            self._fail(str(err))
        except Exception as err:  # noqa: BLE001 - every reader must stop with it, not wait forever
            self._fail(f"fetching the shards of --latents {self.url} failed: {type(err).__name__}: {err}.")

    def _fail(self, text: str) -> None:
        """Tell every reader of this node why no more shards come (this process's readers also from memory)."""
        self.error = UserError(text)
        try:
            atomic_write_text(self.local / STREAM_ERROR_NAME, text)  # room: the failed fetch's temp file is gone
        except (OSError, UserError):
            (self.local / STREAM_ERROR_NAME).write_text(text)

    def _fetch(self, shard: int) -> None:
        """Download one shard to a temp name, hashing it; publish it only when size and sha256 match."""
        entry = self.shards[shard]
        target, tmp = self.local / entry["name"], self.local / f"{TMP_PREFIX}{entry['name']}"
        problem = None
        for attempt in range(FETCH_ATTEMPTS):
            if attempt:
                time.sleep(2 ** (attempt - 1))
            try:
                digest, size = hashlib.sha256(), 0
                with _open_remote(self.fs, f"{self.remote_root}/{entry['name']}") as src, open(tmp, "wb") as dst:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            except FileNotFoundError:
                tmp.unlink(missing_ok=True)
                raise UserError(f"--latents {self.url} has no {entry['name']}, though its {INDEX_NAME} lists it: the "
                                "remote folder is incomplete. Copy the whole folder `python -m extract --out` wrote "
                                "to that location again, then rerun the same command (it resumes).") from None
            except Exception as err:  # noqa: BLE001 - a dropped connection has many exception types
                tmp.unlink(missing_ok=True)
                full = disk_full(err, tmp) if isinstance(err, OSError) else None
                if full is not None:
                    raise UserError(f"no space left for the latent cache {self.local} while fetching {entry['name']} "
                                    f"({show_size(entry['size'])}); the run's checkpoints are untouched. Free space "
                                    f"on that disk, lower --cache-limit (now {show_size(self.budget)} for shards), "
                                    f"or point ${CACHE_ENV} at a bigger local disk, then rerun the same command: it "
                                    "resumes from the last checkpoint.") from None
                problem = f"{type(err).__name__}: {err}"
                continue
            if size != entry["size"]:
                tmp.unlink(missing_ok=True)
                problem = f"the transfer ended after {size} of {entry['size']} bytes"
                continue
            if digest.hexdigest() != entry["sha256"]:
                tmp.unlink(missing_ok=True)
                raise UserError(f"shard {entry['name']} of --latents {self.url} fails its sha256 check: its bytes "
                                f"differ from those {INDEX_NAME} lists (the remote copy was changed or damaged after "
                                "extract wrote it). Do not train on it: copy that shard (or the whole folder) from "
                                "the extract --out folder again, or re-extract, then rerun the same command.")
            os.replace(tmp, target)
            self.present.add(shard)
            return
        raise UserError(f"cannot fetch {entry['name']} of --latents {self.url}: {FETCH_ATTEMPTS} tries failed, the "
                        f"last with {problem}. Check the connection to that server, then rerun the same command: "
                        "it resumes from the last checkpoint.")


def resolve_shard_window(cfg, dataset) -> None:
    """--shard-window auto -> 0, or with --cache-limit the largest K whose two windows fit; a given K is checked."""
    budget = getattr(dataset, "budget", None)
    sizes = [e["size"] for e in dataset.meta["shards"]]
    if cfg.shard_window == "auto":
        cfg.shard_window = 0 if budget is None or budget >= sum(sizes) else budget // (2 * max(sizes))
        return
    if cfg.shard_window < 0:
        raise UserError(f"--shard-window {cfg.shard_window}: pass 0 (one shuffle of all samples), a number of "
                        "shards K >= 1, or auto.")
    need = sum(sizes) if not cfg.shard_window else min(sum(sizes), 2 * cfg.shard_window * max(sizes))
    if budget is not None and need > budget:
        raise UserError(f"--shard-window {cfg.shard_window} needs {show_size(need)} of cached shards (two windows "
                        f"of {cfg.shard_window} shards of up to {show_size(max(sizes))}), more than --cache-limit "
                        f"leaves for shards ({show_size(budget)}). Pass --shard-window {budget // (2 * max(sizes))} "
                        "or less, or a larger --cache-limit.")


def follow(batches, dataset, *, seed: int, window: int, start: int, global_batch: int, accum: int, readahead: int):
    """The loader's micro-batches, telling the node's fetcher what was consumed; its failure as one paragraph.
    When this process starts step s (its micro-batch k = s * accum arrives), every process has finished step s - 1,
    so every sample before start + s * global_batch was read by all of them (DDP's all-reduce joins each step)."""
    if not isinstance(dataset, StreamedLatents):
        return batches
    counts = np.sort(dataset.shard_counts)  # the loader reads `readahead` positions ahead: within two windows
    smallest = int(counts[: len(counts) // -(-len(counts) // window)].sum()) if window else readahead  # per window
    if readahead > smallest:
        raise UserError(f"the data loader reads up to {readahead} samples ahead of the step (global batch plus "
                        f"the workers' prefetch), more than the smallest window of {window} shards holds ({smallest}), "
                        "so the streamed cache would need a third window. Lower --num-workers or --micro-batch-size, "
                        "or give a larger --cache-limit (larger windows).")
    if dataset.stream is not None:
        dataset.stream.start(seed, window, start)
    return _reporting(batches, dataset, start, global_batch, accum)


def _reporting(batches, dataset: StreamedLatents, start: int, global_batch: int, accum: int):
    """`follow`'s generator: advance the fetcher as steps begin; a fetch failure surfaces as its paragraph."""
    try:
        for k in itertools.count():
            try:
                batch = next(batches)
            except Exception:
                error = dataset.stream_error()  # a worker's re-raised copy carries a traceback: raise the paragraph
                if error is not None:
                    raise error from None
                raise
            if dataset.stream is not None:
                dataset.stream.advance(start + (k // accum) * global_batch)
            yield batch
    finally:  # the run is over (or failed): the fetcher thread ends too
        if dataset.stream is not None:
            dataset.stream.stop()


# ---- The stream order: every rank's indices, a pure function of (seed, position) ----

def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of one epoch, a pure function of (seed, epoch) on every rank and machine."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_samples)


def shard_windows(num_shards: int, seed: int, epoch: int, window: int) -> list[np.ndarray]:
    """Epoch `epoch`'s shards, shuffled, split into consecutive windows of at most `window` shards."""
    order = np.random.default_rng([int(seed), int(epoch), 1]).permutation(num_shards)
    return np.array_split(order, -(-num_shards // window))  # sizes differ by one shard at most: no small remainder


def windowed_permutation(counts: Sequence[int], seed: int, epoch: int, window: int) -> np.ndarray:
    """Shards shuffled, then samples shuffled within each window of `window` shards (counts: samples per shard);
    as webdataset and mosaicml-streaming do, so a bounded cache needs only the current and the next window."""
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    parts = [rng.permutation(np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards]))
             for shards in shard_windows(len(counts), seed, epoch, window)]
    return np.concatenate(parts)


class StreamSampler(torch.utils.data.Sampler):
    """Infinite, resumable, distributed index stream (edm2-style: position depends only on samples seen).

    Global stream = perm(seed, 0) ++ perm(seed, 1) ++ ...; rank r yields the positions p >= start with
    p % world_size == r, `start` counting samples consumed by all ranks (resume: step * global_batch). With
    `window` K > 0 (and `counts`, samples per shard) each epoch is `windowed_permutation`'s order instead."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, start: int = 0, counts: Sequence[int] | None = None, window: int = 0):
        assert num_samples > 0 and 0 <= rank < world_size and seed >= 0 and start >= 0, \
            f"StreamSampler({num_samples=}, {rank=}, {world_size=}, {seed=}, {start=})"
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        assert not window or (counts is not None and sum(counts) == num_samples), "window needs counts summing to n"
        self.seed, self.shuffle, self.start, self.counts, self.window = seed, shuffle, start, counts, window

    def order(self, epoch: int) -> np.ndarray:
        """The dataset indices of epoch `epoch` in stream order."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if self.window:
            return windowed_permutation(self.counts, self.seed, epoch, self.window)
        return epoch_permutation(self.num_samples, self.seed, epoch)

    def __iter__(self) -> Iterator[int]:
        n, ws = self.num_samples, self.world_size
        epoch = self.start // n
        while True:
            base = epoch * n  # global position of this epoch's first element
            first = max(self.start, base)
            first += (self.rank - first) % ws  # first position >= start owned by this rank
            if first < base + n:
                yield from self.order(epoch)[first - base :: ws].tolist()
            epoch += 1
