"""extract --data-path from webdataset tar shards (local, http, memory://) and parquet: as from the same folder."""
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from extract.__main__ import main
from extract.config import BAD_FILES_NAME, ExtractConfig
from extract.run import run_extract, sidecar_path
from shared.datasets.imagefolder import scan_image_folder
from shared.datasets.shards import INDEX_NAME, shard_name
from shared.runtime.fsio import stale_tmps
from tests.conftest import ROOT, make_image_folder
from tests.helpers import run_main

TINY = dict(image_size=16, shard_size=4, batch_size=2, num_workers=0, flip="none")


def _extract(data, out, vae, **kw) -> Path:
    """One in-process extraction at tiny size; returns --out."""
    run_extract(ExtractConfig(data_path=str(data), out=Path(out), vae=str(vae), **{**TINY, **kw}))
    return Path(out)


def _shards(out: Path) -> dict:
    """The latent shards' bytes by name (keys are positions: equal bytes = same latents, labels, order)."""
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tar"))}


def _write_tars(folder: Path, pattern: str, per_shard: int = 4, drop_label_at=None, bad_at=None) -> list[Path]:
    """The folder's images in its sorted order as webdataset shards (KEY.png + KEY.cls), by webdataset's writer."""
    scan = scan_image_folder(folder)
    pattern_path = Path(pattern)
    pattern_path.parent.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(pattern_path), maxcount=per_shard, verbose=0) as sink:
        for i, (rel, label) in enumerate(zip(scan.files, scan.labels)):
            sample = {"__key__": f"img{i:04d}", "png": (folder / rel).read_bytes(), "cls": label}
            if i == drop_label_at:
                del sample["cls"]
            if i == bad_at:
                sample["png"] = b"not a png"
            sink.write(sample)
    return sorted(pattern_path.parent.glob("*.tar"))


def _write_parquet(folder: Path, path: Path, names=True, label_column="label") -> Path:
    """The folder's images as a Hugging Face style parquet file: image struct {bytes, path}, ClassLabel names."""
    scan = scan_image_folder(folder)
    table = pa.table({"image": [{"bytes": (folder / f).read_bytes(), "path": f} for f in scan.files],
                      label_column: scan.labels})
    if names:
        features = {"image": {"_type": "Image"}, label_column: {"_type": "ClassLabel", "names": scan.classes}}
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=5)  # row groups that straddle the latent shards
    return path


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """A static server answering Range requests (as S3, the Hub and nginx do; http.server alone does not)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        path = Path(self.translate_path(self.path))
        wanted = self.headers.get("Range")
        if not wanted or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()
        start, _, end = wanted.split("=", 1)[1].partition("-")
        start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.wfile.write(data[start : end + 1])

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(http_folder):
    """serve(folder) -> http://127.0.0.1:PORT serving that folder with Range answers; stopped after the test."""
    return lambda folder: http_folder(folder, _RangeHandler)


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, tiny_vae_dir):
    """(images, latents): 12 images in 3 classes and their extraction as a folder."""
    root = tmp_path_factory.mktemp("folder")
    images = make_image_folder(root / "images", per_class=4)
    return images, _extract(images, root / "latents", tiny_vae_dir)


def _class_map(tmp_path: Path, names) -> Path:
    path = tmp_path / "classes.json"
    path.write_text(json.dumps(names))
    return path


# ----------------------------------------------------------------------------------------------------------
# The same latents as from the folder
# ----------------------------------------------------------------------------------------------------------

def test_tar_shards_extract_as_the_folder(tmp_path, tiny_vae_dir, folder_run):
    images, ref = folder_run
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar", per_shard=5)  # 5, 5, 2: not the latent shards' 4
    names = {"0": "cat", "1": "dog", "2": "eel"}
    out = _extract(f"{tmp_path}/wds/train-{{000000..000002}}.tar", tmp_path / "lat", tiny_vae_dir,
                   class_map=_class_map(tmp_path, names))
    assert _shards(out) == _shards(ref)
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["class_names"] == ["cat", "dog", "eel"] and index["dataset"]["num_files"] == 12


def test_parquet_folder_extracts_as_the_images_with_classlabel_names(tmp_path, tiny_vae_dir, folder_run):
    images, ref = folder_run
    _write_parquet(images, tmp_path / "hf" / "data" / "train-00000-of-00001.parquet")
    _write_parquet(make_image_folder(tmp_path / "other", per_class=1, seed=9),
                   tmp_path / "hf" / "data" / "test-00000-of-00001.parquet")  # another split: not read
    out = _extract(tmp_path / "hf", tmp_path / "lat", tiny_vae_dir)
    assert _shards(out) == _shards(ref)
    assert json.loads((out / INDEX_NAME).read_text())["class_names"] == ["cat", "dog", "eel"]


def test_parquet_without_names_uses_the_indices_and_a_binary_column(tmp_path, tiny_vae_dir, folder_run):
    images, ref = folder_run
    scan = scan_image_folder(images)
    table = pa.table({"png": [(images / f).read_bytes() for f in scan.files], "y": scan.labels})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=3)
    out = _extract(tmp_path / "a.parquet", tmp_path / "lat", tiny_vae_dir, image_column="png", label_column="y")
    assert _shards(out) == _shards(ref)
    assert json.loads((out / INDEX_NAME).read_text())["class_names"] == ["0", "1", "2"]


def test_tar_shards_over_http_and_memory_filesystem(tmp_path, tiny_vae_dir, folder_run, serve):
    import fsspec

    images, ref = folder_run
    tars = _write_tars(images, tmp_path / "wds" / "train-%06d.tar")
    url = serve(tmp_path / "wds")
    out = _extract(f"{url}/train-{{000000..000002}}.tar", tmp_path / "http", tiny_vae_dir,
                   class_map=_class_map(tmp_path, ["cat", "dog", "eel"]))
    assert _shards(out) == _shards(ref)
    memory = fsspec.filesystem("memory")
    for tar in tars:
        memory.pipe(f"/sources-test/{tar.name}", tar.read_bytes())
    out = _extract("memory://sources-test/train-{000000..000002}.tar", tmp_path / "mem", tiny_vae_dir)
    assert _shards(out) == _shards(ref)
    assert json.loads((out / INDEX_NAME).read_text())["class_names"] == ["0", "1", "2"]


def test_json_label_field_and_duplicates_by_content(tmp_path, tiny_vae_dir, folder_run):
    images, _ = folder_run
    scan = scan_image_folder(images)
    with wds.TarWriter(str(tmp_path / "a.tar")) as sink:
        for i, (rel, label) in enumerate(zip(scan.files, scan.labels)):
            sink.write({"__key__": f"k{i:02d}", "png": (images / rel).read_bytes(),
                        "json": {"label": label}})
        sink.write({"__key__": "k99", "png": (images / scan.files[0]).read_bytes(), "json": {"label": 2}})
    assert main(["--data-path", str(tmp_path / "a.tar"), "--label-key", "json:label", "--check",
                 "--num-workers", "0", "--image-size", "16"]) == 0
    out = _extract(tmp_path / "a.tar", tmp_path / "lat", tiny_vae_dir, label_key="json:label")
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["dataset"]["num_files"] == 12  # the copy (k99, labelled 2) of k00 is kept once: --duplicates first


# ----------------------------------------------------------------------------------------------------------
# --check
# ----------------------------------------------------------------------------------------------------------

def test_check_counts_classes_and_lists_bad_samples_by_shard_and_key(tmp_path, folder_run, capsys):
    images, _ = folder_run
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar", bad_at=6)
    data = f"{tmp_path}/wds/train-{{000000..000002}}.tar"
    code = main(["--data-path", data, "--check", "--num-workers", "0", "--image-size", "32"])
    out = capsys.readouterr().out
    assert code == 1  # a bad sample, as for a bad file in a folder
    assert "(webdataset tar shards): 3 classes, 12 images" in out
    assert f"{tmp_path}/wds/train-000001.tar#img0006: " in out  # listed by shard and key
    assert "have a short side below --image-size 32 (they are upscaled)" in out  # the folder's rule
    _write_parquet(images, tmp_path / "p" / "train-0.parquet")
    code = main(["--data-path", str(tmp_path / "p"), "--check", "--num-workers", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "(parquet files): 3 classes, 12 images" in out and "bad files: 0" in out
    assert "      1  dog  4 images" in out


def test_bad_samples_are_skipped_and_listed_by_shard_and_key(tmp_path, tiny_vae_dir, folder_run):
    images, _ = folder_run
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar", bad_at=2)
    out = _extract(f"{tmp_path}/wds/train-{{000000..000002}}.tar", tmp_path / "lat", tiny_vae_dir)
    bad = [json.loads(line) for line in (out / BAD_FILES_NAME).read_text().splitlines()]
    assert [b["path"] for b in bad] == [f"{tmp_path}/wds/train-000000.tar#img0002"]
    assert json.loads((out / INDEX_NAME).read_text())["shards"][0]["num_samples"] == 3


# ----------------------------------------------------------------------------------------------------------
# Bad input: one paragraph, exit 2, nothing extracted lost
# ----------------------------------------------------------------------------------------------------------

def _refused(capsys, argv) -> str:
    code, _, err = run_main(main, [str(a) for a in argv], capsys)
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    return err


def test_bad_sources_are_one_paragraph_and_keep_what_was_extracted(tmp_path, tiny_vae_dir, folder_run, capsys,
                                                                   serve):
    images, ref = folder_run
    before = _shards(ref) | {INDEX_NAME: (ref / INDEX_NAME).read_bytes()}
    common = ["--out", ref, "--vae", tiny_vae_dir, "--image-size", "16", "--num-workers", "0"]
    _write_tars(images, tmp_path / "nolabel" / "t-%06d.tar", drop_label_at=5)
    err = _refused(capsys, ["--data-path", tmp_path / "nolabel" / "t-000001.tar", *common])
    assert "t-000001.tar#img0005 has no 'cls' member (its members: png)" in err and "--label-key" in err
    _write_tars(images, tmp_path / "ok" / "t-%06d.tar")
    err = _refused(capsys, ["--data-path", f"{tmp_path}/ok/t-{{000000..000002}}.tar", *common,
                            "--class-map", _class_map(tmp_path, ["cat", "dog"])])
    assert "label 2 (4 samples in all) is outside the 2 classes of --class-map" in err
    _write_parquet(images, tmp_path / "p.parquet", label_column="cls")
    err = _refused(capsys, ["--data-path", tmp_path / "p.parquet", *common])
    assert "has no column 'label' (its columns: image, cls). Pass the --label-column" in err
    url = serve(tmp_path / "ok")
    err = _refused(capsys, ["--data-path", f"{url}/missing-{{000000..000001}}.tar", *common])
    assert f"{url}/missing-000000.tar does not exist" in err
    after = _shards(ref) | {INDEX_NAME: (ref / INDEX_NAME).read_bytes()}
    assert after == before


def test_a_shard_unreadable_mid_run_is_one_paragraph_and_the_rerun_finishes(tmp_path, tiny_vae_dir, folder_run,
                                                                           capsys, monkeypatch):
    """A read failing in a decoding worker (a dropped connection, a vanished file): its paragraph, not the worker's
    traceback; exit 2; the shards already finished kept and not encoded again."""
    from shared.datasets import sources

    images, _ = folder_run
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar")
    data, out = f"{tmp_path}/wds/train-{{000000..000002}}.tar", tmp_path / "lat"
    read = sources.TarReader.read

    def failing(self, sample_id):
        if self.members[sample_id][0] == 2:  # tar 2 = latent shard 2 (positions 8-11)
            raise sources._reading_error(self.shards[2], ConnectionResetError("connection reset by peer"))
        return read(self, sample_id)

    monkeypatch.setattr(sources.TarReader, "read", failing)  # the forked decoding worker inherits it
    argv = ["--data-path", data, "--out", out, "--vae", tiny_vae_dir, "--image-size", "16", "--shard-size", "4",
            "--num-workers", "1", "--flip", "none"]
    err = _refused(capsys, argv)
    assert f"reading {tmp_path}/wds/train-000002.tar failed (ConnectionResetError: connection reset by peer)" in err
    assert "Traceback" not in err and sidecar_path(out, 1).exists() and not (out / INDEX_NAME).exists()
    monkeypatch.setattr(sources.TarReader, "read", read)
    code, printed, _ = run_main(main, argv, capsys)
    assert code == 0 and "this run encoded 4 images" in printed


# ----------------------------------------------------------------------------------------------------------
# Resume after kill -9
# ----------------------------------------------------------------------------------------------------------

_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}


def _cli(data, out, vae) -> list:
    return [sys.executable, "-m", "extract", "--data-path", str(data), "--out", str(out), "--vae", str(vae),
            "--image-size", "16", "--shard-size", "4", "--batch-size", "2", "--num-workers", "0", "--flip", "none"]


def _feed_once(fifo: Path, data: bytes) -> threading.Thread:
    """Write `data` to the FIFO for its first reader (the listing); later readers block (no writer left)."""
    def feed():
        with open(fifo, "wb") as sink:
            sink.write(data)
    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_sigkill_mid_shard_then_rerun_equals_an_uninterrupted_tar_run(tmp_path, tiny_vae_dir, folder_run):
    images, _ = folder_run
    tars = _write_tars(images, tmp_path / "wds" / "train-%06d.tar", per_shard=2)  # 6 tars; latent shard 1 = tars 2, 3
    data = f"{tmp_path}/wds/train-{{000000..000005}}.tar"
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run(_cli(data, ref, tiny_vae_dir), cwd=ROOT, env=_ENV, check=True, capture_output=True, timeout=300)
    # Tar 3 becomes a FIFO fed once: the listing reads it, then extraction blocks opening it, mid latent shard 1
    # (its first batch, tar 2, already in the temp tar).
    saved = tars[3].read_bytes()
    tars[3].unlink()
    os.mkfifo(tars[3])
    feeder = _feed_once(tars[3], saved)
    proc = subprocess.Popen(_cli(data, out, tiny_vae_dir), cwd=ROOT, env=_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not (sidecar_path(out, 0).exists() and stale_tmps(out / shard_name(1))):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "timed out waiting for shard 1 to be half written"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        tars[3].unlink()
        tars[3].write_bytes(saved)
        feeder.join(timeout=1)
    assert not (out / INDEX_NAME).exists()
    result = subprocess.run(_cli(data, out, tiny_vae_dir), cwd=ROOT, env=_ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "this run encoded 8 images" in result.stdout  # shard 0 kept; 1 and 2 encoded
    names = [*_shards(ref), INDEX_NAME, "index-arrays.npz", BAD_FILES_NAME]
    assert {n: (out / n).read_bytes() for n in names} == {n: (ref / n).read_bytes() for n in names}


# ----------------------------------------------------------------------------------------------------------
# Several processes
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_split_a_parquet_source_with_decoding_workers(tmp_path, tiny_vae_dir, folder_run):
    """torchrun (what `accelerate launch --multi_gpu` runs) on CPU/gloo: latent shard j goes to rank j % 2, each
    rank's readers travel to a decoding worker, only the main process reads the source to list it, and the folder
    comes out as one process writes it."""
    import re

    from tests.test_extract import _free_port

    images, _ = folder_run
    scan = scan_image_folder(images)
    (tmp_path / "p").mkdir()
    for half, rows in enumerate((slice(0, 7), slice(7, None))):  # two files: the listing's progress bar shows
        table = pa.table({"image": [{"bytes": (images / f).read_bytes()} for f in scan.files[rows]],
                          "label": scan.labels[rows]})
        pq.write_table(table, tmp_path / "p" / f"train-{half}.parquet", row_group_size=3)
    ref, out = tmp_path / "ref", tmp_path / "out"

    def argv(folder, workers):
        line = _cli(tmp_path / "p", folder, tiny_vae_dir)
        line[line.index("--num-workers") + 1] = workers
        return line

    one = subprocess.run(argv(ref, "0"), cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
              "--master_port", str(_free_port())]
    result = subprocess.run([*launch, *argv(out, "1")[1:]], cwd=ROOT, env=_ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    writers = [json.loads(sidecar_path(out, j).read_text())["written_by"]["rank"] for j in range(3)]
    assert writers == [0, 1, 0]
    assert _shards(out) == _shards(ref)
    listed = [len(re.findall(r"list: 100%", run.stderr)) for run in (one, result)]
    assert listed[0] >= 1 and listed[1] == listed[0]  # rank 1 read the main process's listing, not the files


def test_a_rerun_reads_the_listing_kept_in_out_not_the_source(tmp_path, tiny_vae_dir, folder_run, monkeypatch):
    """Resume at ImageNet scale: the listing (labels, content hashes) is kept in --out; a rerun with the same flags
    and shards of the same sizes reads no shard to list it again, and a shard whose size changed is listed anew."""
    from shared.datasets import sources

    images, ref = folder_run
    tars = _write_tars(images, tmp_path / "wds" / "train-%06d.tar")
    data, out = f"{tmp_path}/wds/train-{{000000..000002}}.tar", tmp_path / "lat"
    _extract(data, out, tiny_vae_dir)
    assert (out / sources.LISTING_NAME).is_file()
    for name in ("shard-000002.tar", "shard-000002.done.json", INDEX_NAME):
        (out / name).unlink()  # as a run killed before its last shard leaves the folder
    listed = []
    list_tar = sources._list_tar
    monkeypatch.setattr(sources, "_list_tar", lambda url, *a: listed.append(url) or list_tar(url, *a))
    _extract(data, out, tiny_vae_dir)
    assert listed == [] and _shards(out) == _shards(ref)
    with open(tars[1], "ab") as grown:
        grown.write(b"\0" * 1024)  # tar padding: the same samples, another size
    (out / INDEX_NAME).unlink()
    _extract(data, out, tiny_vae_dir)
    assert len(listed) == 3 and _shards(out) == _shards(ref)


def test_a_folder_of_tar_shards_and_an_unlabelled_split(tmp_path, folder_run, capsys):
    images, _ = folder_run
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar")
    assert main(["--data-path", str(tmp_path / "wds"), "--check", "--num-workers", "0"]) == 0
    assert "(webdataset tar shards): 3 classes, 12 images" in capsys.readouterr().out
    table = pa.table({"image": [{"bytes": b"x", "path": None}], "label": [-1]})  # as ImageNet's test split
    pq.write_table(table, tmp_path / "test.parquet")
    err = _refused(capsys, ["--data-path", tmp_path / "test.parquet", "--check"])
    assert "label -1 (1 sample in all) is not a class index" in err


def test_a_source_flag_the_source_does_not_read_is_refused(tmp_path, folder_run, capsys):
    images, _ = folder_run
    err = _refused(capsys, ["--data-path", images, "--check", "--class-map", _class_map(tmp_path, ["a"])])
    assert "--class-map applies to webdataset tar shards or parquet files, but --data-path names an ImageFolder" in err
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar")
    err = _refused(capsys, ["--data-path", tmp_path / "wds", "--check", "--image-column", "jpg"])
    assert "--image-column applies to parquet files, but --data-path names webdataset tar shards" in err


def test_images_smaller_than_the_image_size_are_upscaled_as_from_the_folder(tmp_path, tiny_vae_dir, folder_run):
    images, _ = folder_run  # 20x24 images, --image-size 32: the folder's rule (upscaled, counted by --check)
    _write_tars(images, tmp_path / "wds" / "train-%06d.tar")
    ref = _extract(images, tmp_path / "ref", tiny_vae_dir, image_size=32)
    out = _extract(tmp_path / "wds", tmp_path / "lat", tiny_vae_dir, image_size=32)
    assert _shards(out) == _shards(ref) and not (out / BAD_FILES_NAME).read_text()
