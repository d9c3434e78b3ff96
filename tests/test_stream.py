"""Latents streamed from a URL through a bounded cache (issue 36.2): order, eviction, sha256, dropped connections.

Real servers: a 127.0.0.1 http.server in a thread serving the latent folder (fsspec's HTTP filesystem, aiohttp),
and fsspec's in-process memory:// filesystem standing for object storage.
"""
import argparse
import http.server
import os
import sys
import json
import threading
from collections import Counter
from itertools import islice
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from shared.datasets.shards import INDEX_NAME
from train.latents import StreamSampler, shard_windows, windowed_permutation
from shared.tokenizers.space import SPACE_JSON, SPACE_TENSORS
from train import latents as remote
from train.callbacks import Callback
from tests import small_disk
from tests.helpers import (CPU_DIST, LAUNCHER, ROOT, TORCHRUN, checkpoints, cli, expect_user_error, final_tensors,
                           finish, make_latents, trace, train_args, wait_for)
from train.__main__ import main as train_main

PER_SHARD = 4


def _folder(tmp_path: Path) -> Path:
    """12 shards of 4 samples each (tiny 4x4x4 latents)."""
    return make_latents(tmp_path / "lat", n=48, per_shard=PER_SHARD)


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_NAME).read_text())


def _limit_for(folder: Path, shards: int) -> int:
    """A --cache-limit holding index.json, the sidecar, the latent-space record and `shards` of the largest shard."""
    index = _index(folder)
    space = sum((folder / name).stat().st_size for name in (SPACE_JSON, SPACE_TENSORS))
    fixed = (folder / INDEX_NAME).stat().st_size + index["arrays"]["size"] + space
    return fixed + shards * max(e["size"] for e in index["shards"])


def _upload(folder: Path, url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    for path in folder.iterdir():
        if path.is_file():
            fs.pipe_file(f"{root}/{path.name}", path.read_bytes())


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the folder; `drop` {name: bytes}: the first GET of that file closes after that many bytes."""

    drop: dict = {}

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        name = Path(self.path).name
        cut = type(self).drop.pop(name, None)
        if cut is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(cut))
        outputfile.flush()
        self.close_connection = True
        self.connection.shutdown(2)  # the server hangs up mid-shard


@pytest.fixture
def server(http_folder):
    """(start(folder, drop) -> base URL); shut down after the test."""
    def start(folder: Path, drop=None):
        handler = type("Handler", (_Handler,), {"drop": {} if drop is None else drop})  # popped as it drops
        return http_folder(folder, handler)

    return start


class CacheWatch(Callback):
    """Records the cache folder's size after every step and after every shard that arrives."""

    def __init__(self, root: Path):
        self.root, self.sizes = root, []

    def measure(self):
        self.sizes.append(sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()))

    def on_step_end(self, run, result):
        self.measure()


def _watch_fetches(monkeypatch, watch: CacheWatch) -> list:
    """Also measure right after each fetch (the cache's peak); returns the fetched shard numbers."""
    fetched, real = [], remote.ShardStream._fetch

    def fetch(self, shard):
        real(self, shard)
        fetched.append(shard)
        watch.measure()

    monkeypatch.setattr(remote.ShardStream, "_fetch", fetch)
    return fetched


def test_byte_size_reads_decimal_and_binary_units():
    assert remote.byte_size("20GiB") == 20 << 30 and remote.byte_size("500MB") == 500_000_000
    assert remote.byte_size("1.5kib") == 1536 and remote.byte_size("4096") == 4096
    for bad in ("", "12XB", "-3GB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            remote.byte_size(bad)
    for n in (1, 1536, 5 << 30, 123_456_789):
        assert n <= remote.byte_size(remote.show_size(n)) < n * 1.06  # printed sizes read back, never smaller


def test_windowed_order_is_a_permutation_local_to_windows_and_resumes_exactly():
    counts = [4] * 11 + [3]
    n = sum(counts)
    for epoch in range(3):
        order = windowed_permutation(counts, 7, epoch, 3)
        assert sorted(order.tolist()) == list(range(n))
        shard_of = np.searchsorted(np.cumsum(counts), order, side="right")
        start = 0
        for window in shard_windows(len(counts), 7, epoch, 3):  # each window's samples come together
            size = sum(counts[s] for s in window)
            assert set(shard_of[start:start + size].tolist()) == set(window.tolist())
            start += size
    assert not np.array_equal(windowed_permutation(counts, 7, 0, 3), windowed_permutation(counts, 7, 1, 3))
    full = list(islice(StreamSampler(n, 1, 2, seed=7, counts=counts, window=3), 60))
    resumed = list(islice(StreamSampler(n, 1, 2, seed=7, start=26, counts=counts, window=3), 47))
    assert resumed == full[13:]


def _stream_run(tmp_path, monkeypatch, latents: str, name: str, limit: int, *flags, cache=None):
    """Train from a URL with --cache-limit; returns (run folder, the cache folder's sizes, fetched shard numbers)."""
    cache = cache or tmp_path / f"cache-{name}"
    monkeypatch.setenv(remote.CACHE_ENV, str(cache))
    watch = CacheWatch(cache)
    fetched = _watch_fetches(monkeypatch, watch)
    run = tmp_path / name
    assert train_main(train_args(latents, run, "--cache-limit", str(limit), *flags), [watch]) == 0
    return run, watch.sizes, fetched


@pytest.mark.slow
def test_a_bounded_cache_over_http_trains_bitwise_as_the_local_folder(tmp_path, monkeypatch, server):
    data = _folder(tmp_path)
    folder_bytes = sum(p.stat().st_size for p in data.iterdir())
    limit = _limit_for(data, 4)  # two windows of 2 shards: a third of the folder
    flags = ["--max-steps", "8", "--lr", "1e-3", "--ckpt-every", "4"]  # 64 samples: past one epoch of 48
    url = server(data)
    streamed, sizes, fetched = _stream_run(tmp_path, monkeypatch, url, "http", limit, *flags)
    config = json.loads((streamed / "config.json").read_text())
    assert config["shard_window"] == 2 and config["cache_limit"] == limit
    assert max(sizes) <= limit < folder_bytes / 2, (max(sizes), limit, folder_bytes)
    assert len(fetched) > len(_index(data)["shards"])  # the second epoch fetched evicted shards again

    local = tmp_path / "local"
    assert train_main(train_args(data, local, "--shard-window", "2", *flags)) == 0
    a, b = final_tensors(local), final_tensors(streamed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Resume from step 4 through the stream (a fresh cache): bitwise the same end.
    resumed = tmp_path / "resumed"
    _stream_run(tmp_path, monkeypatch, url, "part", limit, "--lr", "1e-3", "--max-steps", "4", "--ckpt-every", "4")
    (tmp_path / "part").rename(resumed)
    _stream_run(tmp_path, monkeypatch, url, "resumed", limit, *flags)
    c = final_tensors(resumed)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_bounded_cache_over_memory_fs_never_holds_the_folder(tmp_path, monkeypatch):
    data = _folder(tmp_path)
    url = "memory://bucket/issue36/lat"
    _upload(data, url)
    limit = _limit_for(data, 2)  # one window of one shard, and the next
    run, sizes, fetched = _stream_run(tmp_path, monkeypatch, url, "mem", limit, "--max-steps", "6",
                                      "--ckpt-every", "6", "--global-batch-size", "4")  # reads one shard ahead
    assert max(sizes) <= limit and json.loads((run / "config.json").read_text())["shard_window"] == 1
    assert Counter(fetched).most_common(1)[0][1] == 1 and len(fetched) >= 3  # 24 samples: 6 shards, each once
    for thread in [t for t in threading.enumerate() if t.name == "latent-stream"]:
        thread.join(timeout=10)  # the fetcher ends with the run
        assert not thread.is_alive()

    # A shard left in the cache and damaged since is hashed on the next start, deleted and fetched again.
    left = sorted((tmp_path / "cache-mem").glob("*/shard-*.tar"))  # the last window and the next one
    for path in left:
        raw = bytearray(path.read_bytes())
        raw[600] ^= 0xFF
        path.write_bytes(bytes(raw))
    _, _, again = _stream_run(tmp_path, monkeypatch, url, "mem2", limit, "--max-steps", "6", "--ckpt-every", "6",
                              "--global-batch-size", "4", cache=tmp_path / "cache-mem")
    assert {int(p.name[6:12]) for p in left} & set(again)  # the last window's shard, trained on again
    a, b = final_tensors(run), final_tensors(tmp_path / "mem2")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_connection_dropped_mid_shard_is_retried(tmp_path, monkeypatch, server):
    data = _folder(tmp_path)
    monkeypatch.setattr(remote, "FETCH_ATTEMPTS", 2)
    drop = {e["name"]: 3000 for e in _index(data)["shards"]}  # each shard's first GET ends after 3000 bytes
    url = server(data, drop=drop)
    run, sizes, fetched = _stream_run(tmp_path, monkeypatch, url, "drop", _limit_for(data, 4), "--max-steps", "2",
                                      "--ckpt-every", "2")
    assert (run / "checkpoints").is_dir() and max(sizes) <= _limit_for(data, 4)
    names = [e["name"] for e in _index(data)["shards"]]
    assert fetched and not {names[s] for s in fetched} & set(drop)  # every shard trained on was cut once, then fetched


def test_stream_mistakes_are_one_paragraph(tmp_path, capsys, monkeypatch, server):
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(remote, "FETCH_ATTEMPTS", 2)
    data = _folder(tmp_path)
    shards = _index(data)["shards"]

    def refused(latents, limit, *flags, run="run"):
        err = expect_user_error(capsys, train_args(latents, tmp_path / run, "--cache-limit", str(limit),
                                                   "--max-steps", "2", *flags))
        assert "Traceback" not in err, err
        return err

    url = server(data)
    err = refused(url, _limit_for(data, 2) - 1)  # under two shards
    assert f"--cache-limit" in err and "largest shard" in err and "too small" in err and shards[0]["name"] in err
    assert not (tmp_path / "run").exists()
    err = refused(f"{url}/nowhere", _limit_for(data, 4))
    assert "has no index.json" in err
    err = refused(data, _limit_for(data, 4))
    assert "local folder" in err and "--shard-window" in err
    err = refused(url, _limit_for(data, 2), run="ahead")  # windows of 4 samples, a global batch of 8
    assert "samples ahead of the step" in err and "--cache-limit" in err
    err = refused(url, _limit_for(data, 4), "--shard-window", "3", run="window")
    assert "--shard-window 3 needs" in err and "--shard-window 2 or less" in err

    # A shard whose bytes changed after extract wrote it (same size, other bytes): named, nothing trained.
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in data.iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    victim = changed / shards[0]["name"]
    raw = bytearray(victim.read_bytes())
    raw[600] ^= 0xFF
    victim.write_bytes(bytes(raw))
    err = refused(server(changed), _limit_for(data, 24), run="changed")
    assert f"shard {shards[0]['name']}" in err and "sha256" in err

    # A server that keeps dropping the connection: a few tries, then one paragraph.
    dropping = server(data, drop={shards[0]["name"]: 100})
    monkeypatch.setattr(remote, "FETCH_ATTEMPTS", 1)
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache2"))
    err = refused(dropping, _limit_for(data, 24), run="dropped")
    assert f"cannot fetch {shards[0]['name']}" in err and "1 tries failed" in err

    # A shard listed but missing remotely.
    (changed / shards[0]["name"]).unlink()
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache3"))
    err = refused(server(changed), _limit_for(data, 24), run="missing")
    assert f"has no {shards[0]['name']}" in err


@pytest.mark.slow
def test_two_processes_share_one_bounded_cache_and_train_as_the_local_folder(tmp_path, server):
    data = make_latents(tmp_path / "lat", n=96, per_shard=8)  # windows of 3 shards: 24 samples, what 2 ranks read ahead
    limit = _limit_for(data, 6)
    flags = ["--max-steps", "5", "--num-workers", "1", "--ckpt-every", "5", "--lr", "1e-3"]
    url = server(data)
    finish(cli(TORCHRUN + train_args(url, tmp_path / "streamed", "--cache-limit", str(limit), *flags),
               {"TRACE_DIR": str(tmp_path / "t1"), "DIT_LATENT_CACHE": str(tmp_path / "cache"), **CPU_DIST}))
    finish(cli(TORCHRUN + train_args(data, tmp_path / "local", "--shard-window", "3", *flags),
               {"TRACE_DIR": str(tmp_path / "t2"), **CPU_DIST}))
    streamed, local = [trace(tmp_path / "t1", r) for r in (0, 1)], [trace(tmp_path / "t2", r) for r in (0, 1)]
    assert 0 < streamed[0]["cache_bytes"] <= limit and streamed[1]["cache_bytes"] <= limit
    assert [t["positions"] for t in streamed] == [t["positions"] for t in local]
    assert {t["weights_sha256"] for t in streamed} == {local[0]["weights_sha256"]}
    assert json.loads((tmp_path / "streamed" / "config.json").read_text())["shard_window"] == 3


@pytest.mark.slow
@pytest.mark.skipif(not small_disk.available(), reason="needs unshare + an unprivileged tmpfs mount (Linux)")
def test_a_full_cache_disk_is_one_paragraph_and_the_checkpoint_stays(tmp_path, server):
    data = _folder(tmp_path)
    url, run = server(data), tmp_path / "run"
    argv = [sys.executable, "-m", "train", *train_args(url, run, "--cache-limit", "1MiB", "--max-steps", "2",
                                                       "--ckpt-every", "2")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), remote.CACHE_ENV: str(tmp_path / "cache")}
    finish(cli(argv[3:], env))  # two steps and a checkpoint, cache on the ordinary disk
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    longer = [*argv[:-4], "--max-steps", "6", "--ckpt-every", "2"]
    full, = small_disk.run(tmp_path / "mnt", [(24, longer)], tmp_path / "logs", tmp_path / "snap",
                           {**env, remote.CACHE_ENV: str(tmp_path / "mnt")}, ROOT)  # room for about one shard
    err = " ".join(full.stderr.split())
    assert full.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "no space left for the latent cache" in err and "rerun the same command" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_the_shard_window_is_part_of_the_experiment(tmp_path, capsys):
    data, run = _folder(tmp_path), tmp_path / "run"
    assert train_main(train_args(data, run, "--shard-window", "2", "--max-steps", "1", "--ckpt-every", "1")) == 0
    err = expect_user_error(capsys, train_args(data, run, "--max-steps", "2"))  # auto: 0 for a local folder
    assert "shard_window" in err and "Rerun with the original settings" in err


@pytest.mark.slow
def test_a_streamed_run_killed_mid_run_resumes_bitwise(tmp_path, server):
    data = _folder(tmp_path)
    flags = ["--max-steps", "4", "--ckpt-every", "2", "--num-workers", "1", "--global-batch-size", "4",
             "--cache-limit", str(_limit_for(data, 6))]  # windows of 3 shards: 12 samples, the loader reads 12 ahead
    url, run, pauses = server(data), tmp_path / "run", tmp_path / "pause"
    env = {"TRACE_DIR": str(pauses), "PAUSE_AT": "checkpoint:2", remote.CACHE_ENV: str(tmp_path / "cache")}
    victim = cli(LAUNCHER + train_args(url, run, *flags), env)
    wait_for(pauses / "paused", victim)
    victim.kill()  # SIGKILL: the fetcher dies wherever it was (a temp file may be left)
    victim.communicate(timeout=60)
    assert checkpoints(run) == ["step-0000002"]
    finish(cli(train_args(url, run, *flags), {remote.CACHE_ENV: str(tmp_path / "cache")}))
    assert "resumed from" in (run / "log.txt").read_text()
    local = tmp_path / "local"
    finish(cli(train_args(data, local, *flags[:-2], "--shard-window", "3")))
    a, b = final_tensors(local), final_tensors(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
