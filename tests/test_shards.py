"""The latent shard format: writer determinism, index-last, webdataset compatibility, reader errors, sampler."""
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import webdataset as wds

from shared.datasets import integrity, shards
from shared.runtime.errors import UserError
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.space import LatentSpace
from shared.datasets.shards import GatheredBatch, LatentDataset, ShardInfo, ShardWriter, collate, shard_name, write_index
from train.latents import StreamSampler, epoch_permutation
from shared.runtime.fsio import tmp_name

# sha256[:16] of the folder test_folder_bytes_are_pinned writes (moments fp16 + a bf16 column, 3 samples)
PINNED_DIGESTS = {"index-arrays.npz": "d0cc18593469dea2", "index.json": "9f8fc77972782931",
                  "shard-000000.tar": "0feb622c0ebf82a7"}  # the shard as the writer before named columns wrote it
MOMENTS = {"mean": torch.float16, "std": torch.float16}  # the columns extract writes by default
META = {"image_size": 16, "num_classes": 3, "class_names": ["cat", "dog", "eel"]}
VAE = {"source": "tiny", "scaling_factor": 0.25, "latent_channels": 4}


def index_meta(root, shape=(4, 4, 4)) -> dict:
    """META with the sha256 of the folder's latent space (a tiny scale-0.25 VAE's), written into root."""
    identity = {**VAE, "latent_channels": shape[0], "downsample_factor": META["image_size"] // shape[-1]}
    space = LatentSpace(identity, shape, META["image_size"], META["class_names"],
                        {"native": LatentNorm.scale_only(0.25, "tiny")})
    return {**META, "latent_space": space.write(root)}


def make_moments(n, flips=2, shape=(4, 4, 4), seed=0):
    """n random (mean, std, label) triples; mean[0,0,0,0] == sample index so a sample identifies itself."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        mean = rng.standard_normal((flips, *shape)).astype(np.float32)
        mean[0, 0, 0, 0] = i
        std = rng.random((flips, *shape)).astype(np.float32)
        out.append((mean, std, int(rng.integers(0, META["num_classes"]))))
    return out


def write_folder(root: Path, counts=(3, 5, 2), flips=2, dtype=torch.float16, seed=0, index=True):
    """Write shards of the given sizes (and index.json); return (root, samples, shard infos)."""
    root.mkdir(parents=True, exist_ok=True)
    samples = make_moments(sum(counts), flips=flips, seed=seed)
    infos, k = [], 0
    for s, n in enumerate(counts):
        with ShardWriter(root / shard_name(s), columns={"mean": dtype, "std": dtype}) as writer:
            for mean, std, label in samples[k : k + n]:
                # torch input for even keys, numpy for odd: the writer takes both
                as_t = (lambda a: torch.from_numpy(a)) if k % 2 == 0 else (lambda a: a)
                writer.add(f"{k:06d}", {"mean": as_t(mean), "std": as_t(std)}, label)
                k += 1
        infos.append(writer.info)
    if index:
        write_index(root, infos, index_meta(root))
    return root, samples, infos


@pytest.fixture
def folder(tmp_path):
    """A finished fp16, F=2 latent folder with uneven shards (3, 5, 2)."""
    return write_folder(tmp_path / "latents")


# --------------------------------------------------------------------------------------------------------
# Round trip and metadata
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("flips", [1, 2])
def test_round_trip(tmp_path, dtype, flips):
    root, samples, _ = write_folder(tmp_path / "lat", flips=flips, dtype=dtype)
    ds = LatentDataset(root)
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    assert len(ds) == len(samples) == 10
    assert ds.dtype == dtype and ds.flips == flips and ds.latent_shape == (4, 4, 4)
    assert ds.num_classes == 3 and ds.class_names == META["class_names"] and ds.image_size == 16
    assert ds.scaling_factor == 0.25 and ds.vae == {**VAE, "downsample_factor": 4}  # 16 px / 4 latent
    assert ds.labels.dtype == np.int64 and ds.labels.tolist() == [s[2] for s in samples]
    for i, (mean, std, label) in enumerate(samples):
        item = ds[i]
        assert item["mean"].dtype == dtype and item["mean"].shape == (flips, 4, 4, 4)
        np.testing.assert_array_equal(item["mean"].numpy(), mean.astype(np_dtype))
        np.testing.assert_array_equal(item["std"].numpy(), std.astype(np_dtype))
        assert item["label"] == label
    np.testing.assert_array_equal(ds[-1]["mean"].numpy(), samples[-1][0].astype(np_dtype))
    with pytest.raises(IndexError):
        ds[10]


def test_gather_matches_items(folder):
    root, samples, _ = folder
    ds = LatentDataset(root)
    idx = [9, 0, 4, 3, 4, 7]  # crosses all three shards, with a repeat
    batch = ds.gather(idx)
    assert batch["mean"].shape == (6, 2, 4, 4, 4) and batch["label"].dtype == torch.int64
    for row, i in enumerate(idx):
        assert torch.equal(batch["mean"][row], ds[i]["mean"]) and torch.equal(batch["std"][row], ds[i]["std"])
        assert batch["label"][row] == samples[i][2]
    assert ds.gather([])["mean"].shape == (0, 2, 4, 4, 4)
    with pytest.raises(IndexError):
        ds.gather([0, 10])


def test_items_are_views_and_writes_never_reach_the_file(folder):
    root, samples, _ = folder
    ds = LatentDataset(root)
    item = ds[2]
    item["mean"].fill_(7.0)  # copy-on-write mapping: the file stays intact
    assert torch.all(ds[2]["mean"] == 7.0)  # same process sees its private copy: it is a view, not a copy
    np.testing.assert_array_equal(LatentDataset(root)[2]["mean"].numpy(), samples[2][0].astype(np.float16))


def test_collate_and_gathered_batch(folder):
    root, _, _ = folder
    ds = LatentDataset(root)
    gathered = ds.__getitems__([1, 8])
    assert isinstance(gathered, GatheredBatch) and len(gathered) == 2
    assert collate(gathered) is gathered.batch
    stacked = collate([ds[1], ds[8]])
    default = torch.utils.data.default_collate(gathered)  # the sequence form works with torch's collate
    for k in ("mean", "std", "label"):
        assert torch.equal(stacked[k], gathered.batch[k]) and torch.equal(default[k], stacked[k])


# --------------------------------------------------------------------------------------------------------
# Writer: determinism, atomicity, validation
# --------------------------------------------------------------------------------------------------------

def test_same_input_gives_byte_identical_shards(tmp_path):
    _, _, a = write_folder(tmp_path / "a")
    _, _, b = write_folder(tmp_path / "b")
    for ia, ib in zip(a, b):
        da, db = (tmp_path / "a" / ia.name).read_bytes(), (tmp_path / "b" / ib.name).read_bytes()
        assert da == db and len(da) == ia.size and len(da) % 10240 == 0
        assert ia.sha256 == hashlib.sha256(da).hexdigest()
        assert ia.to_dict() == ib.to_dict()
    assert (tmp_path / "a" / "index.json").read_bytes() == (tmp_path / "b" / "index.json").read_bytes()
    # ShardInfo survives JSON (extract keeps it as a per-shard resume sidecar).
    assert ShardInfo.from_dict(json.loads(json.dumps(a[1].to_dict()))) == a[1]


def test_offsets_point_at_the_payloads(folder):
    root, samples, infos = folder
    data = (root / infos[1].name).read_bytes()
    for key, offset in zip(infos[1].keys, infos[1].offsets):
        payload = data[offset : offset + infos[1].layout["payload_size"]]
        tensors = safetensors.torch.load(payload)
        assert tensors["mean"][0, 0, 0, 0].item() == int(key)


def test_writer_uses_temp_name_and_index_comes_last(tmp_path):
    root = tmp_path / "lat"
    root.mkdir()
    (mean, std, label), = make_moments(1)
    with ShardWriter(root / shard_name(0), columns=MOMENTS) as writer:
        writer.add("000000", {"mean": mean, "std": std}, label)
        assert sorted(p.name for p in root.iterdir()) == [tmp_name(root / shard_name(0)).name]
    assert sorted(p.name for p in root.iterdir()) == ["shard-000000.tar"]
    with pytest.raises(UserError, match="extraction did not finish.*[Rr]erun the same extract command"):
        LatentDataset(root)
    renamed = []
    real_publish = shards.atomic_write_bytes
    def spy(path, data):
        renamed.append(Path(path).name)
        return real_publish(path, data)
    shards.atomic_write_bytes = spy
    try:
        write_index(root, [writer.info], index_meta(root))
    finally:
        shards.atomic_write_bytes = real_publish
    assert renamed == ["index-arrays.npz", "index.json"]
    assert sorted(p.name for p in root.iterdir()) == ["index-arrays.npz", "index.json", "latent_space.json",
                                                     "latent_space.safetensors", "shard-000000.tar"]


def test_writer_removes_temp_file_on_error(tmp_path):
    (mean, std, label), = make_moments(1)
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path / shard_name(0), columns=MOMENTS) as writer:
            writer.add("000000", {"mean": mean, "std": std}, label)
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == [] and writer.info is None


class _FullDisk(io.FileIO):
    """A real file that runs out of space after `room` bytes, as a full disk does (close fails again too)."""

    room = 3000

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_writer_turns_a_full_disk_into_one_error_and_removes_its_temp_file(tmp_path, monkeypatch):
    from shared.runtime.errors import DiskFullError

    monkeypatch.setattr(shards, "open", lambda path, mode: io.BufferedWriter(_FullDisk(path, "w"), 512),
                        raising=False)
    with pytest.raises(DiskFullError, match=r"no space left on the disk holding .*shard-000000\.tar.*rerun"):
        with ShardWriter(tmp_path / shard_name(0), columns=MOMENTS) as writer:
            for key, (mean, std, label) in enumerate(make_moments(4)):
                writer.add(f"{key:06d}", {"mean": mean, "std": std}, label)
    assert list(tmp_path.iterdir()) == [] and writer.info is None


def test_writer_rejects_bad_samples(tmp_path):
    mean, std, _ = make_moments(1)[0]
    with ShardWriter(tmp_path / shard_name(0), columns=MOMENTS) as writer:
        writer.add("5", {"mean": mean, "std": std}, 0)
        for key in ("a.b", "", "x/y"):
            with pytest.raises(AssertionError, match="bad sample key"):
                writer.add(key, {"mean": mean, "std": std}, 0)
        with pytest.raises(AssertionError, match="appears twice"):
            writer.add("5", {"mean": mean, "std": std}, 0)
        with pytest.raises(AssertionError, match=r"\(F, C, h, w\)"):
            writer.add("6", {"mean": mean[0], "std": std[0]}, 0)
        with pytest.raises(AssertionError, match="differs from the shard"):
            writer.add("6", {"mean": mean[:, :2], "std": std[:, :2]}, 0)
        with pytest.raises(AssertionError, match=r"holds columns \['mean'\], the shard declares \['mean', 'std'\]"):
            writer.add("6", {"mean": mean}, 0)
        with pytest.raises(AssertionError, match=r"holds columns \['mean', 'repr', 'std'\]"):
            writer.add("6", {"mean": mean, "std": std, "repr": mean}, 0)
    assert writer.info.keys == ["5"]


def test_writer_checks_its_column_set(tmp_path):
    with pytest.raises(AssertionError, match="stores a 'mean' column"):
        ShardWriter(tmp_path / shard_name(0), columns={"std": torch.float16})
    with pytest.raises(AssertionError, match="'std' must be stored in the dtype of 'mean' \\(float16\\)"):
        ShardWriter(tmp_path / shard_name(0), columns={"mean": torch.float16, "std": torch.float32})
    with pytest.raises(AssertionError, match="storage dtype must be one of"):
        ShardWriter(tmp_path / shard_name(0), columns={"mean": torch.int8})
    mean, std, _ = make_moments(1)[0]
    with ShardWriter(tmp_path / shard_name(0), columns={**MOMENTS, "repr": "bf16"}) as writer:
        with pytest.raises(AssertionError, match="column 'repr' \\(3, 5\\) must lead with the latent's 2 flip"):
            writer.add("0", {"mean": mean, "std": std, "repr": torch.zeros(3, 5)}, 0)
    assert writer.info.keys == []


def test_folder_bytes_are_pinned(tmp_path):
    """The bytes of a folder are the format: a writer change that moves one byte fails here (old folders must
    keep reading, and re-extracting must reproduce them)."""
    root = tmp_path / "lat"
    root.mkdir()
    with ShardWriter(root / shard_name(0), columns={**MOMENTS, "repr": torch.bfloat16}) as writer:
        for i in range(3):
            mean = torch.arange(2 * 4 * 2 * 2, dtype=torch.float32).reshape(2, 4, 2, 2) / (i + 1)
            writer.add(f"{i:06d}", {"mean": mean, "std": mean.numpy() / 7, "repr": mean[:, :2, :, 0] - i}, i)
    write_index(root, [writer.info], {**META, "latent_space": "0" * 64})
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(root.iterdir())}
    assert digest == PINNED_DIGESTS


def test_deterministic_latents_store_the_latent_alone(tmp_path):
    """A deterministic tokenizer (AutoencoderDC, RAE) stores "mean" with no "std": read back, in one loop."""
    root = tmp_path / "lat"
    root.mkdir()
    latents = torch.randn(4, 1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    with ShardWriter(root / shard_name(0), columns={"mean": "bf16"}) as writer:
        for i in range(4):
            writer.add(f"{i:06d}", {"mean": latents[i]}, i % 3)
    write_index(root, [writer.info], index_meta(root, (4, 2, 2)))
    index = json.loads((root / "index.json").read_text())
    assert index["version"] == shards.DETERMINISTIC_VERSION and index["dtype"] == "bfloat16"
    assert index["tensors"] == [{"name": "mean", "dtype": "bfloat16", "shape": [1, 4, 2, 2]}]
    ds = LatentDataset(root)
    assert ds.deterministic and ds.tensor_names == ("mean",) and ds.dtype == torch.bfloat16
    assert not LatentDataset(write_folder(tmp_path / "vae")[0]).deterministic
    assert set(ds[1]) == {"mean", "label"} and torch.equal(ds[1]["mean"], latents[1].bfloat16())
    batch = ds.gather([3, 0], frames=[0, 0])
    assert torch.equal(batch["mean"], latents[[3, 0], 0].bfloat16()) and batch["label"].tolist() == [0, 0]
    # Readers of version 1 only would look for "std": the version tells them to refuse the folder instead.
    index["version"] = 3
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="version 3; this code reads 'dit-latent-shards' versions 1, 2"):
        LatentDataset(root)


def test_write_index_validates(tmp_path):
    _, _, infos16 = write_folder(tmp_path / "a", counts=(2,), index=False)
    _, _, infos32 = write_folder(tmp_path / "a2", counts=(2,), dtype=torch.float32, index=False)
    mixed = ShardInfo.from_dict({**infos32[0].to_dict(), "name": "shard-000001.tar"})
    (tmp_path / "a" / mixed.name).write_bytes((tmp_path / "a2" / infos32[0].name).read_bytes())
    with pytest.raises(AssertionError, match="shard-000001.tar has layout"):
        write_index(tmp_path / "a", [infos16[0], mixed], index_meta(tmp_path / "a"))
    with pytest.raises(AssertionError, match="outside"):
        write_index(tmp_path / "a", infos16, {**index_meta(tmp_path / "a"), "num_classes": 1, "class_names": ["x"]})
    with pytest.raises(AssertionError, match="file size"):
        write_index(tmp_path / "a", [ShardInfo.from_dict({**infos16[0].to_dict(), "size": 1})],
                    index_meta(tmp_path / "a"))
    assert not (tmp_path / "a" / "index.json").exists()


# --------------------------------------------------------------------------------------------------------
# webdataset compatibility
# --------------------------------------------------------------------------------------------------------

def test_plain_webdataset_streams_the_same_data(folder):
    root, _, infos = folder
    ds = LatentDataset(root)
    urls = [str(root / info.name) for info in infos]
    seen = 0
    for i, sample in enumerate(wds.WebDataset(urls, shardshuffle=False)):
        tensors = safetensors.torch.load(sample["latent.safetensors"])
        assert sample["__key__"] == f"{i:06d}" and int(sample["cls"]) == ds[i]["label"]
        assert torch.equal(tensors["mean"], ds[i]["mean"]) and torch.equal(tensors["std"], ds[i]["std"])
        seen += 1
    assert seen == len(ds)


# --------------------------------------------------------------------------------------------------------
# Reader failure modes: each names the problem, the file and the fix
# --------------------------------------------------------------------------------------------------------

def test_missing_folder_and_empty_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist.*run extract"):
        LatentDataset(tmp_path / "nope")
    with pytest.raises(UserError, match="no index.json.*python -m extract"):
        LatentDataset(tmp_path)


FIX = r"rerun the same `python -m extract` command.*redoes exactly the damaged ones.*--verify --out"


def test_missing_shard(folder):
    root, _, _ = folder
    (root / "shard-000001.tar").unlink()
    with pytest.raises(UserError, match=f"shard-000001.tar is missing.*{FIX}"):
        LatentDataset(root)


def test_truncated_shard(folder):
    root, _, _ = folder
    path = root / "shard-000002.tar"
    path.write_bytes(path.read_bytes()[:-512])
    with pytest.raises(UserError, match=f"shard-000002.tar is .* bytes.*truncated.*{FIX}"):
        LatentDataset(root, verify=False)  # sizes are checked even without hashing


def _flip_byte(root: Path, info: ShardInfo) -> None:
    """Flip one byte inside a stored tensor, keeping the size and (as disk rot does) the mtime."""
    path = root / info.name
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[info.offsets[0] + info.layout["tensors"]["std"]] ^= 0xFF
    with open(path, "r+b") as f:  # in place: same inode
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_corrupted_shard_is_refused_by_default(folder):
    root, samples, infos = folder
    path = root / "shard-000001.tar"
    data = bytearray(path.read_bytes())
    data[infos[1].offsets[0] + infos[1].layout["tensors"]["std"]] ^= 0xFF
    path.write_bytes(bytes(data))
    LatentDataset(root, verify=False)  # same size: only hashing sees it
    with pytest.raises(UserError, match=f"damaged: shard-000001.tar fails its sha256 check.*{FIX}") as caught:
        LatentDataset(root)
    assert "shard-000000" not in str(caught.value) and "shard-000002" not in str(caught.value)


def test_verified_shards_are_not_hashed_again(folder, monkeypatch):
    root, _, infos = folder
    hashed = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda path, *a: hashed.append(Path(path).name) or real(path, *a))
    LatentDataset(root)
    assert sorted(hashed) == [i.name for i in infos] and (root / integrity.VERIFIED_NAME).is_file()
    hashed.clear()
    LatentDataset(root)  # a resume: stats only
    assert hashed == []
    path = root / infos[2].name
    path.write_bytes(path.read_bytes())  # rewritten (new mtime): hashed again, still fine
    LatentDataset(root)
    assert hashed == [infos[2].name]
    assert integrity.damaged_files(root, json.loads((root / "index.json").read_text())["shards"], rehash=True) == {}
    assert sorted(hashed) == sorted([infos[2].name] + [i.name for i in infos])  # rehash reads everything


def test_a_copied_folder_is_hashed_again(folder, tmp_path):
    """rsync -t and cp -p keep size and mtime; the new inode still tells that the bytes were never checked."""
    root, _, infos = folder
    LatentDataset(root)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)  # copy2: size and mtime kept, the verification record travels along
    _flip_byte(copy, infos[0])   # damage in transfer, mtime kept
    with pytest.raises(UserError, match="shard-000000.tar fails its sha256"):
        LatentDataset(copy)


def test_unwritable_folder_verifies_without_failing(folder, tmp_path, monkeypatch):
    root, _, infos = folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = integrity.atomic_write_text

    def read_only(path, text):
        if Path(path).parent == root:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, text)

    monkeypatch.setattr(integrity, "atomic_write_text", read_only)
    LatentDataset(root)
    assert not (root / integrity.VERIFIED_NAME).exists()
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1  # the user cache holds the record instead
    _flip_byte(root, infos[1])
    os.utime(root / infos[1].name)  # a real change moves mtime
    with pytest.raises(UserError, match="shard-000001.tar fails"):
        LatentDataset(root)
    monkeypatch.setattr(integrity, "atomic_write_text", lambda path, text: (_ for _ in ()).throw(OSError(30, "ro")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="shard-000001.tar fails"):  # no record at all: still checked, no crash
        LatentDataset(root)


def test_a_garbled_verification_record_is_ignored(folder):
    root, _, infos = folder
    (root / integrity.VERIFIED_NAME).write_text("{not json")
    LatentDataset(root)
    record = json.loads((root / integrity.VERIFIED_NAME).read_text())
    assert sorted(record["files"]) == [i.name for i in infos]
    _flip_byte(root, infos[2])
    record["files"][infos[2].name]["sha256"] = "0" * 64  # a record that disagrees with the index is not trusted
    (root / integrity.VERIFIED_NAME).write_text(json.dumps(record))
    with pytest.raises(UserError, match="shard-000002.tar fails"):
        LatentDataset(root)


def test_unknown_version_and_bad_json(folder):
    root, _, _ = folder
    index = json.loads((root / "index.json").read_text())
    (root / "index.json").write_text(json.dumps({**index, "version": 99}))
    with pytest.raises(UserError, match="version 99.*Re-extract"):
        LatentDataset(root)
    (root / "index.json").write_text("{")
    with pytest.raises(UserError, match="index.json is not valid JSON"):
        LatentDataset(root)


def test_tampered_sidecar(folder):
    root, _, _ = folder
    path = root / "index-arrays.npz"
    original = path.read_bytes()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, different bytes
    with pytest.raises(UserError, match="index-arrays.npz.*sha256"):
        LatentDataset(root)
    buf = io.BytesIO()
    np.savez(buf, offsets=np.zeros(11, np.int64), labels=np.zeros(11, np.int64))
    (root / "index-arrays.npz").write_bytes(buf.getvalue())
    with pytest.raises(UserError, match="index-arrays.npz.*bytes"):
        LatentDataset(root)


# --------------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------------

def test_epoch_permutation_is_a_deterministic_permutation():
    p = epoch_permutation(50, seed=3, epoch=1)
    assert sorted(p.tolist()) == list(range(50))
    assert np.array_equal(p, epoch_permutation(50, 3, 1))
    assert not np.array_equal(p, epoch_permutation(50, 3, 2)) and not np.array_equal(p, epoch_permutation(50, 4, 1))


@pytest.mark.parametrize("n, world", [(10, 1), (10, 3), (7, 2), (5, 8)])
def test_stream_is_concatenated_epochs_split_by_position(n, world):
    stream = np.concatenate([epoch_permutation(n, 1, e) for e in range(6)])  # global stream
    for rank in range(world):
        got = list(islice(StreamSampler(n, rank, world, seed=1), len(stream[rank::world]) - 1))
        assert got == stream[rank::world][: len(got)].tolist()
    first_epoch = sorted(i for r in range(world) for i in islice(StreamSampler(n, r, world, 1), len(range(r, n, world))))
    assert first_epoch == list(range(n))  # one epoch's positions: every sample exactly once across ranks


@pytest.mark.parametrize("start", [0, 1, 9, 10, 11, 23])
def test_resume_continues_the_exact_stream(start):
    n, world = 10, 3
    for rank in range(world):
        full = list(islice(StreamSampler(n, rank, world, seed=5), 40))
        positions = [rank + world * j for j in range(40)]
        expected = [i for p, i in zip(positions, full) if p >= start]
        resumed = list(islice(StreamSampler(n, rank, world, seed=5, start=start), len(expected)))
        assert resumed == expected


def test_unshuffled_stream_and_argument_checks():
    assert list(islice(StreamSampler(4, 1, 2, shuffle=False), 5)) == [1, 3, 1, 3, 1]
    for kwargs in ({"num_samples": 0}, {"num_samples": 4, "rank": 2, "world_size": 2}, {"num_samples": 4, "start": -1}):
        with pytest.raises(AssertionError):
            StreamSampler(**kwargs)


@pytest.mark.parametrize("collate_fn", [collate, None])
def test_dataloader_workers_ranks_cover_one_epoch_exactly(tmp_path, collate_fn):
    """Map-style dataset + StreamSampler + 2 workers, 3 ranks on 10 samples in uneven shards: no loss, no dup."""
    root, samples, _ = write_folder(tmp_path / "lat", counts=(3, 5, 2), dtype=torch.float32)
    ds, world, seen = LatentDataset(root), 3, []
    ds.gather([0, 9])  # maps already open in the parent: forked workers inherit them
    for rank in range(world):
        sampler = StreamSampler(len(ds), rank, world, seed=2, start=0)
        per_rank = len(range(rank, len(ds), world))  # this rank's share of one epoch's positions
        loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2,
                                             collate_fn=collate_fn, persistent_workers=False)
        got = []
        for batch in loader:
            got += batch["mean"][:, 0, 0, 0, 0].long().tolist()
            assert [samples[i][2] for i in batch["mean"][:, 0, 0, 0, 0].long().tolist()] == batch["label"].tolist()
            if len(got) >= per_rank:
                break
        seen += got[:per_rank]
    assert sorted(seen) == list(range(len(ds)))


def test_pickles_without_maps_and_works_under_spawn(folder):
    root, samples, _ = folder
    ds = LatentDataset(root)
    ds[0], ds.gather([4, 9])  # open some maps first
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._maps == {} and torch.equal(clone[4]["mean"], ds[4]["mean"])
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=StreamSampler(len(ds), shuffle=False),
                                         num_workers=1, multiprocessing_context="spawn", collate_fn=collate)
    batch = next(iter(loader))
    assert batch["mean"][:, 0, 0, 0, 0].tolist() == [0, 1, 2, 3]
