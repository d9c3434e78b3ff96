"""The latent shard format: writer, index and zero-copy reader.

Layout of a latent folder (written by `extract`, read by `train`):

    shard-000000.tar ...   webdataset-compatible ustar archives; per sample KEY two members:
                           KEY.latent.safetensors  the folder's columns (below)
                           KEY.cls                 the class index in ASCII
    shard-000000.done.json ... after each tar, its completion record {"shard": ShardInfo, ...} (ShardWriter.close)
    index-arrays.npz       per-sample arrays, concatenated in shard order: "offsets" (int64, byte offset of
                           each safetensors payload inside its tar) and "labels" (int64)
    index.json             written LAST (shared.runtime.fsio.atomic_write): format, version, counts, latent shape,
                           dtype, flips (F: 2 = FLIP_MODES["both"], 1 = "none"), image size, classes, VAE
                           identity, the payload layout, per shard {name, num_samples, size, sha256} and
                           {name, size, sha256} of the sidecar

Why a sidecar: 1.28M samples would be 2.5M JSON integers (seconds to parse); a .npz of two int64 arrays loads in
milliseconds, and index.json covers it by size and sha256. Every payload has the same tensor layout (shapes, dtype,
header bytes), recorded once, so the reader maps each tar with mmap and views tensors in place (torch.frombuffer at
the recorded offset): no tar parsing, no copy per item. A DataLoader batch is gathered at once (`__getitems__`)
straight into one batch tensor, in shared memory inside workers: one memcpy per tensor, no per-sample collate.

A payload (KEY.latent.safetensors) is one safetensors file of named columns, each (F, ...) with F flip frames
(F=2 with flips: 0 original, 1 mirrored). A folder's column set is declared once, when its shards are written
(mosaicml streaming's `columns={name: encoding}`), e.g. `{"mean": "fp16", "std": "fp16", "repr": "bf16"}`:

    "mean"   (F, C, h, w)  the latent: a VAE's posterior mean, or a deterministic tokenizer's latent; always stored
    "std"    (F, C, h, w)  the posterior std, same dtype and shape as "mean"; no "std" column = deterministic
                           tokenizer (AutoencoderDC, RAE): the latent is "mean" itself, nothing is drawn
    any other name         (F, ...) e.g. "repr": a frozen encoder's patch tokens (F, T, D) for REPA

Every payload of a folder shares one safetensors header, so a folder's layout records each column once:

    layout = {"dtype", "shape"            the latent's ("mean") dtype and (F, C, h, w): the format's first version
              "header_size", "payload_size",
              "tensors": {name: offset}   byte offset of every column's data inside a payload
              "extra": {name: {"dtype", "shape"}}}   only when columns besides "mean" and "std" are stored

A mean+std folder written before other columns existed has no "extra" and reads unchanged; the writer gives the
same bytes as then. index.json also lists every column as {"name", "dtype", "shape"} under "tensors" (`write_index`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import mmap
import tarfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from shared.runtime.errors import UserError, disk_full
from shared.datasets.integrity import damaged_error, damaged_files, file_problem
from shared.runtime.fsio import TMP_PREFIX, atomic_write_bytes, atomic_write_text, publish_file, space_guard, tmp_name
from shared.tokenizers.tokenizer import LatentNorm


LATENT = "mean"  # the column every payload holds
STD = "std"  # the posterior spread; absent for a deterministic tokenizer
MOMENT_NAMES = (LATENT, STD)  # described by the layout's own "dtype"/"shape", never under "extra"


@dataclass(frozen=True)
class StorageDtype:
    """One storage dtype under each of its names."""

    name: str  # index.json and the layout ("float16")
    flag: str  # the command-line word (extract --dtype / --repr-dtype: "fp16")
    safetensors: str  # the payload header's word ("F16")
    torch: torch.dtype


DTYPES = (StorageDtype("float16", "fp16", "F16", torch.float16),
          StorageDtype("bfloat16", "bf16", "BF16", torch.bfloat16),
          StorageDtype("float32", "fp32", "F32", torch.float32))
FLAG_DTYPES = {d.flag: d.torch for d in DTYPES}  # a flag word -> torch dtype (the word a column record names)


def storage_dtype(dtype) -> StorageDtype:
    """The vocabulary entry of a torch/numpy dtype or any of its words ("float16", "fp16", "F16")."""
    for d in DTYPES:
        if dtype is d.torch or dtype in (d.name, d.flag, d.safetensors):
            return d
    with contextlib.suppress(TypeError):
        dtype = np.dtype(dtype).name  # a numpy dtype, or a type such as np.float16
    found = [d for d in DTYPES if d.name == dtype]
    assert found, f"storage dtype must be one of {[d.name for d in DTYPES]}, got {dtype}"
    return found[0]


def payload_layout(payload: bytes) -> dict:
    """The layout of a payload's header (see the module docstring); "extra" appears only when present."""
    data_start = 8 + int.from_bytes(payload[:8], "little")  # where tensor data starts, after the JSON header
    header = json.loads(payload[8:data_start])
    header.pop("__metadata__", None)
    latent = header[LATENT]
    layout = {"dtype": storage_dtype(latent["dtype"]).name, "shape": list(latent["shape"]),  # (F, C, h, w)
              "header_size": data_start, "payload_size": len(payload),
              # byte offset of each column's data relative to the start of the payload
              "tensors": {name: data_start + header[name]["data_offsets"][0] for name in sorted(header)}}
    extra = {name: {"dtype": storage_dtype(spec["dtype"]).name, "shape": list(spec["shape"])}
             for name, spec in sorted(header.items()) if name not in MOMENT_NAMES}
    if extra:
        layout["extra"] = extra
    return layout


def tensor_specs(layout: dict) -> dict:
    """name -> {"dtype", "shape", "offset"} of every column of a payload of this layout ("mean", "std" first)."""
    described = {name: {"dtype": layout["dtype"], "shape": list(layout["shape"])}
                 for name in MOMENT_NAMES if name in layout["tensors"]}
    described.update(layout.get("extra", {}))
    return {name: {"dtype": s["dtype"], "shape": list(s["shape"]), "offset": layout["tensors"][name]}
            for name, s in described.items()}


def as_column(x, dtype: StorageDtype) -> torch.Tensor:
    """A contiguous CPU tensor of `x` (torch or numpy) in the column's dtype."""
    # numpy input is cast by numpy where numpy has the dtype (the bytes the first version wrote); torch by torch
    if not isinstance(x, torch.Tensor):
        x = np.asarray(x)
        if dtype.torch is not torch.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(x, dtype=dtype.name))
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.detach().to("cpu", dtype.torch).contiguous()


FORMAT_NAME = "dit-latent-shards"
FORMAT_VERSION = 1  # every folder whose payloads hold "mean" and "std": what the first readers read
# A folder with no "std" column (a deterministic tokenizer's latents): readers of version 1 only would look for
# "std", so such a folder says version 2 and they refuse it by its version, naming the fix.
DETERMINISTIC_VERSION = 2
READ_VERSIONS = (FORMAT_VERSION, DETERMINISTIC_VERSION)
INDEX_NAME = "index.json"
ARRAYS_NAME = "index-arrays.npz"
PAYLOAD_EXT = "latent.safetensors"
LABEL_EXT = "cls"
ELEMENT_STATS_SUFFIX = ".stats.safetensors"  # shard-000000.stats.safetensors: its per-element sums (RAE tokens)
SIDECAR_SUFFIX = ".done.json"  # shard-000000.tar -> shard-000000.done.json: {"shard": ShardInfo, **the writer's record}
BLOCK = 512
RECORD = 20 * BLOCK  # tar's default record size; the archive is padded to a whole record like GNU tar
# The domain name of a latent folder in errors (shared.runtime.lock's {setting} field): stages map it to their flag.
FOLDER_KIND = "latent folder"
# The --flip vocabulary of extract: mode -> F, the moments stored per sample (original, then its mirror).
FLIP_MODES = {"both": 2, "none": 1}
# The --dtype vocabulary of extract: how the moments are stored (the encoder always runs in fp32).
# bf16 keeps fp32's range with 8 bits of mantissa (fp16 has 11), for tokens of large magnitude; fp16 is the finer
# of the two for values within its range (a VAE's posterior moments).
STORAGE_DTYPES = {flag: FLAG_DTYPES[flag] for flag in ("fp16", "bf16", "fp32")}


def shard_name(index: int) -> str:
    """The file name of shard number `index` (shard-000000.tar, ...)."""
    return f"shard-{index:06d}.tar"


def sidecar_path(out, index: int) -> Path:
    """The completion record of shard number `index` (shard-000000.done.json), written by ShardWriter.close."""
    return (Path(out) / shard_name(index)).with_suffix(SIDECAR_SUFFIX)


def element_stats_path(out, index: int) -> Path:
    """The per-element partial sums of shard number `index` (RAE tokens), written by ShardWriter.close."""
    return (Path(out) / shard_name(index)).with_suffix(ELEMENT_STATS_SUFFIX)


def read_sidecar(out, index: int) -> dict | None:
    """Shard `index`'s completion record while its tar is in place at the recorded size, else None (redo it)."""
    try:
        record = json.loads(sidecar_path(out, index).read_text())
        return record if (Path(out) / record["shard"]["name"]).stat().st_size == record["shard"]["size"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class ShardInfo:
    """What a finished shard holds; JSON-serialisable so extract can keep a per-shard sidecar for resume."""

    name: str
    num_samples: int
    size: int
    sha256: str
    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # byte offset of each safetensors payload in the tar
    layout: dict = field(default_factory=dict)  # shared layout of every payload (payload_layout)

    def to_dict(self) -> dict:
        """A plain JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ShardInfo":
        """Rebuild from `to_dict` output."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


# ---- Statistics of the stored moments, float64 (each shard's sidecar holds its partial sums; extract merges them) ----
# Per channel: mean = mean of the means; variance = variance of the means + mean of the variances (the law of
# total variance over images, positions and posterior noise). Partial sums combine by Chan et al.'s parallel update.

def _chan(a: tuple, b: tuple) -> tuple:
    """Two partial (count, mean, m2) combined, float64 tensors (Chan, Golub & LeVeque 1979, the pairwise update)."""
    (na, mean_a, m2_a), (nb, mean_b, m2_b) = a, b
    if not (na and nb):  # an empty part: the other one as it is
        return a if nb == 0 else (nb, mean_b.clone(), m2_b.clone())
    n, delta = na + nb, mean_b - mean_a
    return n, mean_a + delta * nb / n, m2_a + m2_b + delta ** 2 * na * nb / n


@dataclass
class ChannelStats:
    """Running per-channel count, mean of the means, sum of squared deviations of the means, sum of variances."""

    count: int = 0
    mean: list = field(default_factory=list)  # (C,) float64 as a list (JSON-able)
    m2: list = field(default_factory=list)    # (C,) sum over values of (mean_value - channel mean)^2
    var_sum: list = field(default_factory=list)  # (C,) sum of the posterior variances (0 when deterministic)

    def add(self, mean: torch.Tensor, std: torch.Tensor | None) -> None:
        """Fold in moments (..., C, h, w) (any leading dims: images, flips); std None for a deterministic latent."""
        m = mean.double().movedim(-3, 0).reshape(mean.shape[-3], -1)  # (C, n)
        part_mean = m.mean(dim=1)
        self.merge(ChannelStats(m.shape[1], part_mean.tolist(), ((m - part_mean[:, None]) ** 2).sum(dim=1).tolist(),
                                (std.double().movedim(-3, 0).reshape(std.shape[-3], -1) ** 2).sum(dim=1).tolist()
                                if std is not None else [0.0] * m.shape[0]))

    def merge(self, other: "ChannelStats") -> None:
        """Combine two partial statistics (`_chan`; the variances simply add)."""
        if other.count == 0:
            return
        t = functools.partial(torch.tensor, dtype=torch.float64)
        var_sum = (t(self.var_sum) if self.count else 0.0) + t(other.var_sum)
        self.count, mean, m2 = _chan((self.count, t(self.mean), t(self.m2)), (other.count, t(other.mean), t(other.m2)))
        self.mean, self.m2, self.var_sum = mean.tolist(), m2.tolist(), var_sum.tolist()

    def to_dict(self) -> dict:
        """The partial sums (written in each shard's sidecar)."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "var_sum": self.var_sum}

    @classmethod
    def from_dict(cls, d: dict) -> "ChannelStats":
        return cls(int(d["count"]), list(d["mean"]), list(d["m2"]), list(d["var_sum"]))

    def result(self) -> tuple[list[float], list[float]]:
        """(mean_c, std_c): std^2 = variance of the means + mean of the variances (population, /N)."""
        return list(self.mean), [math.sqrt((m2 + vs) / self.count) for m2, vs in zip(self.m2, self.var_sum)]

    def summary(self, images: int, flips: int, deterministic: bool) -> tuple[LatentNorm, dict]:
        """The folder's "channel" normalisation and what it was computed from."""
        mean, std = self.result()
        moments = "latents" if deterministic else "posterior moments (mean of the means; variance of the means + " \
                                                  "mean of the variances)"
        return (LatentNorm.channel(mean, std, 1.0, source="the latent folder's per-channel statistics"),
                {"values_per_channel": self.count, "images": images, "flips": flips,
                 "computed_from": f"the stored {moments} of every image and flip, float64"})


# RAE's eps (bytetriper/RAE src/stage1/rae.py: (z - mean) / sqrt(var + eps), eps 1e-5): the per-element std of a
# folder is sqrt(var + ELEMENT_EPS), so an element that never varies (a border token, a tiny folder) stays finite.
ELEMENT_EPS = 1e-5


@dataclass
class ElementStats:
    """Running count, mean and sum of squared deviations of every element (C, h, w) of deterministic latents."""

    count: int = 0
    mean: torch.Tensor | None = None  # (C, h, w) float64
    m2: torch.Tensor | None = None    # (C, h, w) float64

    def add(self, latents: torch.Tensor) -> None:
        """Fold in latents (..., C, h, w) (any leading dims: images, flips)."""
        z = latents.double().reshape(-1, *latents.shape[-3:])  # (n, C, h, w)
        part_mean = z.mean(dim=0)
        self.merge(ElementStats(z.shape[0], part_mean, ((z - part_mean) ** 2).sum(dim=0)))

    def merge(self, other: "ElementStats") -> None:
        """Chan et al.'s pairwise update (`_chan`), element by element."""
        assert not (self.count and other.count) or other.mean.shape == self.mean.shape, \
            f"per-element sums of shapes {self.mean.shape}, {other.mean.shape}"
        self.count, self.mean, self.m2 = _chan((self.count, self.mean, self.m2), (other.count, other.mean, other.m2))

    def to_bytes(self) -> bytes:
        """The partial sums as safetensors bytes, float64 exact (each shard's stats file beside its sidecar)."""
        sums = {"mean": self.mean, "m2": self.m2} if self.count else {}
        return safetensors.torch.save({"count": torch.tensor([self.count]), **sums})

    @classmethod
    def from_bytes(cls, data: bytes) -> "ElementStats":
        tensors = safetensors.torch.load(data)
        count = int(tensors["count"])
        return cls(count, tensors["mean"], tensors["m2"]) if count else cls()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) (C, h, w) float64: std = sqrt(population variance + ELEMENT_EPS), RAE's convention."""
        return self.mean, torch.sqrt(self.m2 / self.count + ELEMENT_EPS)

    def summary(self, images: int, flips: int) -> tuple[LatentNorm, dict]:
        """The folder's "element" normalisation (float32) and what it was computed from."""
        mean, std = self.result()
        return (LatentNorm.element(mean, std, 1.0, source="the latent folder's per-element statistics"),
                {"eps": ELEMENT_EPS, "values_per_element": self.count, "images": images, "flips": flips,
                 "computed_from": f"the stored latents of every image and flip, float64; std = sqrt(variance + "
                                  f"{ELEMENT_EPS:g}) as RAE's stat.pt is used"})


class ShardWriter:
    """Context manager writing ONE webdataset-compatible shard of the declared columns, atomically.

    `columns` {name: dtype (torch, or a vocabulary word)}: every payload's named tensors (the module docstring).
    Samples stream into fsio.tmp_name(path); a clean exit or `close(record)` publishes the padded archive as `path`
    (fsio.publish_file: a durable rename), then the record's sidecar; an exception or `abort` removes the temp file.
    The same input always gives byte-identical shards.
    """

    def __init__(self, path, *, columns: dict, stats: bool = False, element_stats: bool = False):
        self.path = Path(path)
        assert LATENT in columns, \
            f"a latent shard stores a {LATENT!r} column (the latent); got columns {sorted(columns)}"
        self.columns = {name: storage_dtype(dtype) for name, dtype in columns.items()}  # name -> StorageDtype
        latent, std = self.columns[LATENT], self.columns.get(STD)
        assert std in (None, latent), \
            f"{STD!r} must be stored in the dtype of {LATENT!r} ({latent.name}), got {std.name}"
        # the partial sums of the moments as stored, for the sidecar (`add_batch`); per element: RAE tokens
        self.stats = ChannelStats() if stats else None
        self.elements = ElementStats() if element_stats else None
        self.tmp_path, self._file = tmp_name(self.path), None
        self._pos, self._digest = 0, hashlib.sha256()  # of every byte written to the tar so far
        self._header, self._layout = None, {}  # the first payload's safetensors header (all must match it), its layout
        self._keys, self._key_set, self._labels, self._offsets = [], set(), [], []
        self.info: ShardInfo | None = None

    def __enter__(self) -> "ShardWriter":
        self._file = open(self.tmp_path, "wb")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()  # the exception propagates (None returned)

    def close(self, record: dict | None = None) -> ShardInfo:
        """Publish the shard, then write its sidecar {"shard": ShardInfo, **record} when given a record; its info."""
        try:
            with space_guard(self.path, self.tmp_path):  # the last buffer, close and fsync can hit a full disk
                self._write(b"\0" * (2 * BLOCK))  # the end-of-archive marker
                self._write(b"\0" * (-self._pos % RECORD))  # padded to a whole record, like GNU tar
                self._file.close()
                publish_file(self.tmp_path, self.path)
                self.info = ShardInfo(self.path.name, len(self._keys), self._pos, self._digest.hexdigest(),
                                      list(self._keys), list(self._labels), list(self._offsets), dict(self._layout))
        finally:
            self.abort()  # a failed finish (e.g. disk full) leaves no temp file
        if record is not None:  # the statistics: per channel inline; per element in a file beside it, with its sha256
            record = {"shard": self.info.to_dict(), **record}
            if self.stats is not None:
                record["latent_stats"] = self.stats.to_dict()
            if self.elements is not None:  # the sha256 in the sidecar: a damaged stats file re-encodes its shard
                data, path = self.elements.to_bytes(), self.path.with_suffix(ELEMENT_STATS_SUFFIX)
                atomic_write_bytes(path, data)
                record.update(element_stats=path.name, element_stats_sha256=hashlib.sha256(data).hexdigest())
            atomic_write_text(self.path.with_suffix(SIDECAR_SUFFIX), json.dumps(record, indent=1) + "\n")
        return self.info

    def abort(self) -> None:
        """Close and delete an unfinished shard's temp file, so a rerun starts it afresh (nothing once published)."""
        if self.info is None:
            with contextlib.suppress(OSError):  # flushing the buffer fails again on a full disk; the file still closes
                self._file.close()
            self.tmp_path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str, tensors: dict, label: int) -> None:
        """Append one sample: {column: torch or numpy tensor (F, ...)}, each cast to its column's dtype; its label."""
        assert self._file is not None, "ShardWriter.add called outside its `with` block"
        # keys are short ASCII names without dots or slashes (webdataset splits on the first dot, merges repeats)
        assert key and "." not in key and "/" not in key and key.isascii() and len(key) <= 80, \
            f"bad sample key {key!r}: use a short ASCII name without '.' or '/'"
        assert key not in self._key_set, f"sample key {key!r} appears twice in {self.path.name}"
        assert set(tensors) == set(self.columns), \
            f"a sample holds columns {sorted(tensors)}, the shard declares {sorted(self.columns)}"
        tensors = {name: as_column(x, self.columns[name]) for name, x in tensors.items()}
        latent, shapes = tensors[LATENT], [tuple(tensors[n].shape) for n in MOMENT_NAMES if n in tensors]
        assert latent.ndim == 4 and len(set(shapes)) == 1, f"the moments must be (F, C, h, w); got {shapes}"
        for name, t in tensors.items():
            assert t.ndim >= 1 and t.shape[0] == latent.shape[0], \
                f"column {name!r} {tuple(t.shape)} must lead with the latent's {latent.shape[0]} flip frame(s)"
        out, seen = {}, set()
        for name, t in tensors.items():  # safetensors refuses tensors sharing memory ("mean" given as "std"): copy
            out[name] = t.clone() if t.untyped_storage().data_ptr() in seen else t
            seen.add(t.untyped_storage().data_ptr())
        payload = safetensors.torch.save(out)  # torch's writer: it knows bf16, which numpy does not
        head = payload[: int.from_bytes(payload[:8], "little") + 8]  # one header, so one layout, for the whole shard
        if self._header is None:
            self._header, self._layout = head, payload_layout(payload)
        assert head == self._header, f"sample layout {payload_layout(payload)} differs from the shard's {self._layout}"
        self._offsets.append(self._pos + BLOCK)  # the payload starts right after its tar header
        self._write_member(f"{key}.{PAYLOAD_EXT}", payload)
        self._write_member(f"{key}.{LABEL_EXT}", str(int(label)).encode("ascii"))
        self._keys.append(key)
        self._key_set.add(key)
        self._labels.append(int(label))

    def add_batch(self, keys: list[str], columns: dict, labels: list[int]) -> None:
        """Append samples {column: (B, F, ...)}, their stored moments folded into the shard's statistics first."""
        if keys and self.stats is not None:
            self.stats.add(columns[LATENT], columns.get(STD))  # (B, F, C, h, w), as stored
        if keys and self.elements is not None:
            self.elements.add(columns[LATENT])
        for k, key in enumerate(keys):
            self.add(key, {name: t[k] for name, t in columns.items()}, labels[k])

    def _write(self, data: bytes) -> None:
        """Write bytes and fold them into the shard's sha256; a full disk becomes DiskFullError naming the shard."""
        try:
            self._file.write(data)
        except OSError as err:
            full = disk_full(err, self.path, self._pos)
            if full is None:
                raise
            raise full from None
        self._digest.update(data)
        self._pos += len(data)

    def _write_member(self, name: str, data: bytes) -> None:
        """Write one tar member: its ustar header, the data, zero padding to the next 512-byte block."""
        info = tarfile.TarInfo(name)  # its defaults are the deterministic ones: regular file, mtime 0, mode 0644, ids 0
        info.size = len(data)
        self._write(info.tobuf(format=tarfile.USTAR_FORMAT, encoding="ascii", errors="strict"))
        self._write(data)
        self._write(b"\0" * (-len(data) % BLOCK))


def write_index(out_dir, shard_infos, meta: dict) -> Path:
    """Validate the shards, write the per-sample sidecar, then index.json last (atomically); return its path.

    `meta`: image_size, num_classes, class_names, latent_space (the sha256 of latent_space.json), any others as given.
    """
    out_dir = Path(out_dir)
    shards = [s if isinstance(s, ShardInfo) else ShardInfo.from_dict(s) for s in shard_infos]
    missing = [k for k in ("image_size", "num_classes", "class_names", "latent_space") if k not in meta]
    assert not missing, f"write_index meta is missing {missing}"
    assert len(meta["class_names"]) == meta["num_classes"], \
        f"{len(meta['class_names'])} class names for num_classes={meta['num_classes']}"
    # all shards exist with their recorded size and share one layout
    assert any(s.num_samples for s in shards), "write_index needs at least one non-empty shard"
    layout, num_classes = next(s.layout for s in shards if s.num_samples), int(meta["num_classes"])
    assert len({s.name for s in shards}) == len(shards), f"a shard is listed twice: {[s.name for s in shards]}"
    for s in shards:
        assert not s.num_samples or s.layout == layout, f"shard {s.name} has layout {s.layout}, another has {layout}"
        assert len(s.keys) == len(s.labels) == len(s.offsets) == s.num_samples, f"shard {s.name}: keys/labels/offsets"
        size = (out_dir / s.name).stat().st_size if (out_dir / s.name).exists() else None
        assert size == s.size, f"shard {s.name}: file size {size} in {out_dir}, expected {s.size}"
        assert all(0 <= y < num_classes for y in s.labels), f"shard {s.name}: a label outside [0, {num_classes})"
    buf = io.BytesIO()  # the per-sample sidecar (offsets, labels)
    np.savez(buf, offsets=np.array([o for s in shards for o in s.offsets], dtype=np.int64),
             labels=np.array([y for s in shards for y in s.labels], dtype=np.int64))
    data = buf.getvalue()
    atomic_write_bytes(out_dir / ARRAYS_NAME, data)
    flips, *latent_shape = layout["shape"]
    index = {
        "format": FORMAT_NAME, "version": DETERMINISTIC_VERSION if STD not in layout["tensors"] else FORMAT_VERSION,
        **{k: v for k, v in meta.items() if k not in ("format", "version")},
        "num_samples": sum(s.num_samples for s in shards), "latent_shape": latent_shape,  # [C, h, w]
        "dtype": layout["dtype"], "flips": flips, "layout": layout,
        "tensors": [{"name": n, "dtype": s["dtype"], "shape": s["shape"]} for n, s in tensor_specs(layout).items()],
        "arrays": {"name": ARRAYS_NAME, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "shards": [{"name": s.name, "num_samples": s.num_samples, "size": s.size, "sha256": s.sha256} for s in shards],
    }
    path = out_dir / INDEX_NAME
    atomic_write_bytes(path, (json.dumps(index, indent=1) + "\n").encode())
    return path


_RERUN = "rerun the same extract command to finish or repair the folder"


def load_index(root: Path) -> dict:
    """Read index.json, or explain why the folder is not a finished latent folder (no file is hashed)."""
    if not root.is_dir():
        raise UserError(f"latent folder {root} does not exist. Use the folder a finished `python -m extract` "
                        f"run wrote, or run extract into it first.")
    path = root / INDEX_NAME
    if not path.is_file():
        leftovers = sorted(p.name for p in root.glob("*.tar")) + sorted(p.name for p in root.glob(f"{TMP_PREFIX}*"))
        if leftovers:
            raise UserError(f"{root} holds shards ({leftovers[0]}, ...) but no {INDEX_NAME}: extraction did not "
                            f"finish. Rerun the same extract command; it resumes and writes {INDEX_NAME} last.")
        from shared.datasets.imagefolder import is_image_file

        out, folders = root.parent / f"{root.name}-latents", [root, *(p for p in root.iterdir() if p.is_dir())]
        if any(is_image_file(f.name) for folder in folders for f in folder.iterdir()):  # root or a sub-folder: images
            raise UserError(f"{root} holds images, not latents (it has no {INDEX_NAME}). Extract them into a separate "
                            f"folder first, never into the images themselves: `python -m extract --data-path {root} "
                            f"--out {out}`, then pass --latents {out}.")
        raise UserError(f"{root} has no {INDEX_NAME}, so it is not a latent folder. Pass the --out folder of a "
                        f"finished `python -m extract` run (`python -m extract --data-path <images> --out {root}` "
                        f"writes one here; keep it apart from the images).")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); {_RERUN}.") from None
    if index.get("format") != FORMAT_NAME or index.get("version") not in READ_VERSIONS:
        raise UserError(f"{path} has format {index.get('format')!r} version {index.get('version')!r}; this code "
                        f"reads {FORMAT_NAME!r} versions {', '.join(map(str, READ_VERSIONS))}. Re-extract the "
                        f"latents with this version of `python -m extract` (or use the code version that wrote them).")
    return index


def _empty_batch(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised batch tensor; inside a DataLoader worker it is allocated in shared memory."""
    # A worker's batch crosses to the main process through shared memory; allocating it there up front (as torch's
    # default_collate does) saves a full copy of the batch (about 3x faster hand-over).
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # what default_collate uses; private
    if new_shared is None:
        return torch.empty(shape, dtype=dtype)  # still correct: torch copies it into shared memory on send
    return torch.empty(0, dtype=dtype).set_(new_shared(nbytes), 0, shape)


class LatentDataset(torch.utils.data.Dataset):
    """Map-style dataset over a latent folder; items are zero-copy views into memory-mapped shards.

    `ds[i]` -> {column: (F, ...) for every stored column, "label": int}. The maps are copy-on-write (writing to a
    returned tensor never touches the file), opened lazily in each process and dropped when pickled (DataLoader
    workers under fork or spawn). Opening checks every shard's sha256 against index.json, remembering what was
    verified (VERIFIED_NAME) so the next open only stats the files; verify=False checks names and sizes only.
    """

    def __init__(self, root, verify: bool = True, progress: bool = True):
        self.root = Path(root)
        self.meta = load_index(self.root)
        self._check_files(verify, progress)
        # (offsets, labels) from the sidecar, always checked against index.json (cheap)
        entry, root, count = self.meta["arrays"], self.root, self.meta["num_samples"]
        problem = file_problem(root, entry)
        if problem:
            raise UserError(f"index sidecar {entry['name']} in {root} {problem}; {_RERUN}.")
        data = (root / entry["name"]).read_bytes()  # read once: hash and parse the same bytes
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise UserError(f"index sidecar {entry['name']} in {root} fails its sha256 check; {_RERUN}.")
        with np.load(io.BytesIO(data)) as z:
            self._offsets, self.labels = z["offsets"].astype(np.int64), z["labels"].astype(np.int64)
        if len(self._offsets) != count or len(self.labels) != count:
            raise UserError(f"index sidecar in {root} has {len(self._offsets)} entries for {count} samples; {_RERUN}.")
        counts = np.array([s["num_samples"] for s in self.meta["shards"]], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])  # global index of each shard's first sample
        # every stored column, "mean" and "std" first (tensor_specs), with its torch dtype and bytes per sample
        self._specs = {name: {**spec, "torch": storage_dtype(spec["dtype"]).torch}
                       for name, spec in tensor_specs(self.meta["layout"]).items()}
        for spec in self._specs.values():
            spec["nbytes"] = math.prod(spec["shape"]) * spec["torch"].itemsize
        self._maps, self._bytes = {}, {}  # {shard: mmap.mmap}, {shard: memoryview of it}

    def _check_files(self, verify: bool, progress: bool) -> None:
        """Every listed shard present at its size (and sha256 unless verify=False), else the damage paragraph."""
        damaged = damaged_files(self.root, self.meta["shards"], verify=verify, progress=progress)
        if damaged:
            raise damaged_error(self.root, damaged)

    num_classes = property(lambda self: int(self.meta["num_classes"]), doc="Number of classes.")
    class_names = property(lambda self: list(self.meta["class_names"]), doc="Class names by index.")
    latent_shape = property(lambda self: tuple(self.meta["latent_shape"]), doc="(C, h, w) of one latent.")
    flips = property(lambda self: int(self.meta["flips"]), doc="F: 1, or 2 when mirrored copies are stored.")
    dtype = property(lambda self: storage_dtype(self.meta["dtype"]).torch, doc="The latent's storage dtype (torch).")
    image_size = property(lambda self: int(self.meta["image_size"]), doc="Image side the latents encode.")
    vae = property(lambda self: dict(self.space.tokenizer), doc="The tokenizer's identity (its LatentSpace's).")
    scaling_factor = property(lambda self: self.space.tokenizer.get("scaling_factor"),
                              doc="The tokenizer's scaling_factor if it has one (its normalisation: native_norm).")
    native_norm = property(lambda self: self.space.native, doc="The tokenizer's own normalisation, or None.")

    @functools.cached_property
    def space(self):
        """The folder's LatentSpace (latent_space.json, checked against index.json's sha256)."""
        from shared.tokenizers.space import LatentSpace, rebuild_folder_command

        if "latent_space" not in self.meta:
            raise UserError(f"{self.root}/index.json records no latent space (no \"latent_space\" entry): the folder "
                            "was written by an earlier version, so its latents cannot be tied to the tokenizer that "
                            f"decodes them. Nothing was changed. {rebuild_folder_command(self.root)}, or extract it "
                            "again.")
        return LatentSpace.read(self.root, self.meta["latent_space"], rebuild_folder_command(self.root))

    shard_counts = property(lambda self: np.diff(self._starts), doc="(S,) samples per shard, in folder order.")
    tensor_names = property(lambda self: tuple(self._specs), doc="Names of the stored columns.")
    deterministic = property(lambda self: STD not in self._specs,
                             doc="True when the latent is stored alone (no \"std\": a deterministic tokenizer).")

    def tensor_spec(self, name: str) -> dict:
        """{"dtype", "shape", "offset"} of a stored column (KeyError if absent)."""
        return {k: self._specs[name][k] for k in ("dtype", "shape", "offset")}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}, "_bytes": {}}  # mmaps do not pickle; each process maps its own

    def _map(self, shard: int) -> mmap.mmap:
        """The copy-on-write mapping of one shard, opened on first use in this process."""
        if shard not in self._maps:
            with open(self.root / self.meta["shards"][shard]["name"], "rb") as f:
                self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[shard]

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        mapping, base = self._map(shard), int(self._offsets[i])
        out = {name: torch.frombuffer(mapping, dtype=spec["torch"], count=spec["nbytes"] // spec["torch"].itemsize,
                                      offset=base + spec["offset"]).view(spec["shape"])  # (F, ...) view, no copy
               for name, spec in self._specs.items()}
        out["label"] = int(self.labels[i])
        return out

    def gather(self, indices, columns: Sequence[str] | None = None, frames=None) -> dict:
        """A batch {column: (B, F, ...), "label": (B,) int64} of the named columns (None: all), one memcpy each.

        frames (B,) ints: read only flip frames[b] of every column, (B, ...) without the F axis (training draws
        one flip per sample, so the other frames' bytes, most of them encoder tokens under REPA, stay unread).
        """
        idx = np.asarray(indices, dtype=np.int64)  # (B,)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"batch index out of range for {len(self)} samples")
        if frames is not None:
            frames = [int(f) for f in frames]
            if any(not 0 <= f < self.flips for f in frames):
                raise IndexError(f"frame outside the {self.flips} stored per sample")
        shards = (np.searchsorted(self._starts, idx, side="right") - 1).tolist()  # (B,)
        bases = self._offsets[idx].tolist()  # (B,) payload offsets inside their shards
        batch = {}
        for name in self.tensor_names if columns is None else columns:  # (B, *shape) or (B, *shape[1:]) of frames[b]
            spec = self._specs[name]
            nbytes, shape = spec["nbytes"], spec["shape"]
            if frames is not None:
                nbytes, shape = nbytes // shape[0], shape[1:]  # one frame of (F, ...)
            batch[name] = _empty_batch((len(bases), *shape), spec["torch"])
            dst = memoryview(batch[name].view(-1).view(torch.uint8).numpy())
            for row, (shard, base) in enumerate(zip(shards, bases)):  # one memcpy per row
                if shard not in self._bytes:  # a byte view of the mapping: slicing it copies without numpy overhead
                    self._bytes[shard] = memoryview(self._map(shard))
                start = base + spec["offset"] + (0 if frames is None else frames[row] * nbytes)
                dst[row * nbytes : (row + 1) * nbytes] = self._bytes[shard][start : start + nbytes]
        batch["label"] = torch.from_numpy(self.labels[idx])
        return batch

    def draw(self, indices, frames, norm, generators, columns: Sequence[str] = ()) -> dict:
        """gather's batch of flip frames[b] with "x0" (B, C, h, w) fp32: a fresh posterior draw of the stored moments,
        normalised by `norm` (draw_latents, one generator per row), and the other named `columns` (B, ...)."""
        spread = () if self.deterministic else (STD,)  # a deterministic tokenizer's latent has no std
        batch = self.gather(indices, (LATENT, *spread, *columns), frames)
        batch["x0"] = draw_latents(batch.pop(LATENT), batch.pop(STD, None), norm, generator=generators)
        return batch

    def __getitems__(self, indices) -> "GatheredBatch":
        """DataLoader's batched fetch: gather the batch at once; `collate` passes it through untouched."""
        return GatheredBatch(self.gather(indices))


class GatheredBatch(Sequence):
    """A gathered batch that also reads as a sequence of per-sample dicts (views, built on demand), so torch's
    default_collate works on it; `collate` returns `.batch` without a copy."""

    def __init__(self, batch: dict):
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["label"])

    def __getitem__(self, j: int) -> dict:
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        return {**{k: v[j] for k, v in self.batch.items() if k != "label"}, "label": int(self.batch["label"][j])}


def collate(samples) -> dict:
    """Stack samples into {column: (B, F, ...), "label": (B,) int64}."""
    if isinstance(samples, GatheredBatch):
        return samples.batch
    return {
        **{k: torch.stack([s[k] for s in samples]) for k, v in samples[0].items()
           if k != "label" and isinstance(v, torch.Tensor)},  # (B, F, ...); names, keys and the like are dropped
        "label": torch.tensor([int(s["label"]) for s in samples], dtype=torch.int64),
    }


def draw_latents(mean, std, norm: LatentNorm, generator=None) -> torch.Tensor:
    """A fresh posterior sample, normalised: norm.apply(mean + std * eps), fp32 on mean's device (std None: no noise).

    `generator`: None, one torch.Generator, or one per batch row (a row's draw does not depend on its batch).
    """
    mean = mean.float()
    if std is None:
        return norm.apply(mean)
    if isinstance(generator, (list, tuple)):
        assert len(generator) == mean.shape[0], f"{len(generator)} generators for a batch of {mean.shape[0]}"
        eps = torch.stack([_randn(mean.shape[1:], g, mean.device) for g in generator])  # (N, C, h, w)
    else:
        eps = _randn(mean.shape, generator, mean.device)
    return norm.apply(mean + std.float() * eps)


def _randn(shape, generator, device) -> torch.Tensor:
    """Standard normal noise drawn on the generator's device (else on `device`), moved to `device`."""
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where, dtype=torch.float32).to(device)
