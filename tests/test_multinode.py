"""Many processes, many machines (issue 21): shards verified once per machine, resume in turns, latents from a URL.

Two CPU processes under torchrun (what `accelerate launch --multi_gpu` runs) stand for the processes of
one machine; fsspec's in-process `memory://` filesystem stands for object storage.
"""
import json
from pathlib import Path

import fsspec
import pytest
import torch

from shared.datasets.shards import INDEX_NAME
from train import latents as remote
from tests.helpers import (CPU_DIST, TORCHRUN, checkpoints, cli, expect_user_error, final_tensors, finish, make_latents,
                           run_inprocess, trace, train_args)


@pytest.mark.slow
def test_two_processes_hash_the_shards_once_and_resume_in_turns(tmp_path):
    data = make_latents(tmp_path / "lat")  # fresh: no verification record yet
    shards = sorted(e["name"] for e in json.loads((data / INDEX_NAME).read_text())["shards"])
    run, flags = tmp_path / "run", ["--micro-batch-size", "2", "--ckpt-every", "2"]
    finish(cli(TORCHRUN + train_args(data, run, "--max-steps", "2", *flags),
               {"TRACE_DIR": str(tmp_path / "first"), **CPU_DIST}))
    first = [trace(tmp_path / "first", r) for r in (0, 1)]
    assert sorted(first[0]["hashed"]) == shards and first[1]["hashed"] == []  # the local main process only
    assert (data / "verified-sha256.json").is_file()

    finish(cli(TORCHRUN + train_args(data, run, "--max-steps", "4", *flags),
               {"TRACE_DIR": str(tmp_path / "second"), **CPU_DIST}))
    second = [trace(tmp_path / "second", r) for r in (0, 1)]
    assert second[0]["hashed"] == second[1]["hashed"] == []  # the record vouches for every shard
    (a_start, a_end), = second[0]["checkpoint_loads"]
    (b_start, b_end), = second[1]["checkpoint_loads"]
    assert a_end <= b_start, "rank 1 must read the checkpoint after rank 0 has finished (one copy at a time)"
    assert "resumed from" in (run / "log.txt").read_text() and checkpoints(run)[-1] == "step-0000004"


def _upload(folder: Path, url: str) -> None:
    """Copy a latent folder to an fsspec URL, file by file."""
    fs, root = fsspec.core.url_to_fs(url)
    for path in folder.iterdir():
        if path.is_file():
            fs.pipe_file(f"{root}/{path.name}", path.read_bytes())


def test_latents_from_a_url_train_bitwise_as_the_local_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    data = make_latents(tmp_path / "lat")
    url = "memory://bucket/issue21/lat"
    _upload(data, url)
    flags = ["--max-steps", "3", "--lr", "1e-3", "--ckpt-every", "3"]
    local = run_inprocess(data, tmp_path / "local", *flags)
    remote_run = run_inprocess(url, tmp_path / "remote", *flags)
    a, b = final_tensors(local), final_tensors(remote_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cached, = (tmp_path / "cache").iterdir()
    for name in [INDEX_NAME, *(e["name"] for e in json.loads((data / INDEX_NAME).read_text())["shards"])]:
        assert (cached / name).read_bytes() == (data / name).read_bytes()
    assert json.loads((remote_run / "config.json").read_text())["latents"] == url  # resume names the URL

    # A second launch reads the cache: nothing is fetched again (a shard removed remotely is not needed).
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{root}/shard-000000.tar")
    assert remote.fetch_latents(url) == cached


def test_latents_url_mistakes_are_one_paragraph(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    for url, needle in [("memory://nowhere/lat", "has no index.json: pass the URL of a finished latent folder"),
                        ("nosuchproto://bucket/lat", "fsspec needs a package per protocol")]:
        args = ["--model", "DiT-T/2", "--latents", url, "--results-dir", str(tmp_path / "run"), "--max-steps", "1"]
        err = expect_user_error(capsys, args)  # exit status 2, one paragraph (train's main() in-process)
        assert "Traceback" not in err and f"--latents {url}" in err and needle in err, err
        assert not (tmp_path / "run").exists()
