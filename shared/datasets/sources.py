"""Where extract's images come from: an ImageFolder, webdataset tar shards, or a parquet dataset.

`open_source` lists a source once, deterministically, as an ImageFolderScan (ids SHARD#KEY or FILE#ROW, labels,
content hashes), so positions, resume, --limit, --duplicates and ranks hold for every source. Listing reads every byte
once; extraction then reads each sample at random through fsspec (one ranged read per tar image, one parquet row
group at a time). Tar shards must be plain .tar: offsets into a .tar.gz are not seekable.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from shared.datasets.imagefolder import ImageFolderScan, Skipped, is_image_file, scan_image_folder
from shared.runtime.cli import counted
from shared.runtime.errors import UserError
from shared.runtime.fsio import atomic_write_bytes

DEFAULT_LABEL_KEY = "cls"
DEFAULT_IMAGE_COLUMN = "image"
DEFAULT_LABEL_COLUMN = "label"
HF_METADATA = b"huggingface"  # the schema metadata key where `datasets` writes its features (ClassLabel names)
PARQUET_SPLIT = "train"  # a folder's files named train-* are taken; other splits only on request by glob


@dataclass(frozen=True)
class SourceOptions:
    """How to read labels and class names from a tar or parquet source (an ImageFolder ignores them)."""
    label_key: str = DEFAULT_LABEL_KEY
    class_map: Path | None = None
    image_column: str = DEFAULT_IMAGE_COLUMN
    label_column: str = DEFAULT_LABEL_COLUMN


@dataclass(frozen=True)
class SourceScan(ImageFolderScan):
    """A tar or parquet source listed like an ImageFolder: `files` are sample ids, bytes come from `reader`."""
    reader: object = field(default=None, compare=False)  # TarReader | ParquetReader
    digests: dict = field(default_factory=dict, compare=False)  # sample id -> sha256 of its image bytes

    def image(self, pos: int):
        """The sample's encoded image as a file object PIL can open."""
        return io.BytesIO(self.reader.read(self.files[pos]))

    def where(self, pos: int) -> str:
        """The sample's id (shard and key) for messages."""
        return self.files[pos]


def is_url(path: str) -> bool:
    """True for fsspec URLs (scheme://...), which are never read as local paths."""
    return "://" in path


def open_binary(url: str):
    """An open binary file for a local path or any fsspec URL; UserError naming the fix when it cannot open."""
    import fsspec
    try:
        return fsspec.open(url, "rb").open() if is_url(url) else open(url, "rb")  # noqa: SIM115 - the caller closes
    except ImportError as err:  # fsspec's http filesystem needs aiohttp, s3 needs s3fs, gs needs gcsfs
        raise UserError(f"cannot open {url}: {err}. Install the package named there (pip install aiohttp for "
                        f"https://, s3fs for s3://, gcsfs for gs://).") from None
    except FileNotFoundError:
        raise UserError(f"--data-path: {url} does not exist. Check the shard names (a brace pattern such as "
                        f"train-{{000000..000146}}.tar must match the files exactly) and the URL.") from None
    except (OSError, ValueError) as err:
        raise UserError(f"--data-path: cannot open {url} ({type(err).__name__}: {err}). Check the URL, the network "
                        f"and any credentials the filesystem needs.") from None


def _reading_error(url: str, err: Exception) -> UserError:
    """The refusal for a shard that opened but could not be read to its end."""
    return UserError(f"--data-path: reading {url} failed ({type(err).__name__}: {err}). If the file is damaged or "
                     f"truncated, replace it; for a URL check the network and rerun the same command.")


def read_class_map(path: Path | None) -> list[str] | None:
    """--class-map: a JSON list of names or {index: name} with indices 0..K-1; None without the flag."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"--class-map {path} cannot be read as JSON ({err}). Pass a JSON list of class names "
                        f"(index i = name i) or an object {{\"0\": \"tench\", ...}}.") from None
    if isinstance(data, dict):
        try:
            by_index = {int(k): str(v) for k, v in data.items()}
        except ValueError:
            by_index = {}
        if sorted(by_index) != list(range(len(data))) or not data:
            raise UserError(f"--class-map {path}: the keys of an index -> name object must be the integers 0..K-1 "
                            f"with none missing; found {sorted(data)[:5]}...")
        return [by_index[i] for i in range(len(data))]
    if isinstance(data, list) and data and all(isinstance(v, (str, int)) for v in data):
        return [str(v) for v in data]
    raise UserError(f"--class-map {path} must hold a non-empty JSON list of names or an {{index: name}} object.")


def class_names(labels: list[int], options: SourceOptions, data_path: str, listed: list | None = None) -> list[str]:
    """--class-map's names, else `listed` (parquet's ClassLabel names), else the indices as text; UserError for a label
    outside them."""
    where, names = f"--data-path {data_path}", read_class_map(options.class_map)
    origin = "the dataset's ClassLabel names" if names is None else f"--class-map {options.class_map}"
    names = listed if names is None else names
    if names is None:
        negative = [label for label in labels if label < 0]
        if negative:  # -1: `datasets`' "no label" (the test split of ImageNet)
            raise UserError(f"{where}: label {negative[0]} ({counted(len(negative), 'sample')} in all) is not a "
                            f"class index; a split without labels (ImageNet's test split holds -1) cannot be "
                            f"trained on. Pass the train split, or the --label-key/--label-column that holds the "
                            f"class index.")
        return [str(i) for i in range(max(labels, default=-1) + 1)]
    outside = [label for label in labels if not 0 <= label < len(names)]
    if outside:
        raise UserError(f"{where}: label {outside[0]} ({counted(len(outside), 'sample')} in all) is outside the "
                        f"{counted(len(names), 'class', 'classes')} of {origin}. Pass the --class-map that "
                        f"covers every label, or a source whose labels are 0..{len(names) - 1}.")
    return names


def parse_label(value, where: str, key: str) -> int:
    """An integer class index from a label member or field (text digits or a JSON integer)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace").strip()
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{where}: the label {key} is {value!r}, not an integer class index. Pass the --label-key "
                        f"(or --label-column) that holds the index.")
    return value


def expand_shards(data_path: str) -> list[str]:
    """The shard list of a brace pattern or a '::'-separated list (webdataset's own expansion), or the sorted *.tar
    of a local folder holding no sub-folder (not an ImageFolder)."""
    from webdataset.shardlists import expand_urls
    folder = Path(data_path).expanduser()
    if not is_url(data_path) and folder.is_dir() and not any(p.is_dir() for p in folder.iterdir()):
        found = sorted(str(p) for p in folder.glob("*.tar"))
        if found:
            return found
    return [url if is_url(url) else str(Path(url).expanduser()) for url in expand_urls(data_path)]


def _label_of(sample: dict, label_key: str, where: str) -> int:
    """The label of one tar sample: member `label_key` (text digits), or a JSON member's field (json:FIELD)."""
    member, _, json_field = label_key.partition(":")
    found = {k.lower(): v for k, v in sample.items() if not k.startswith("__")}
    if member.lower() not in found:
        present = ", ".join(sorted(found)) or "none"
        raise UserError(f"{where} has no {member!r} member (its members: {present}), so --label-key {label_key} "
                        f"gives it no label. Pass the --label-key that every sample holds (cls, or json:FIELD for "
                        f"a field of its .json), or fix the shard.")
    if not json_field:
        return parse_label(found[member.lower()], where, label_key)
    try:
        record = json.loads(found[member.lower()])
    except ValueError as err:
        raise UserError(f"{where}: its {member} member is not JSON ({err}); fix the shard or the "
                        f"--label-key.") from None
    if not isinstance(record, dict) or json_field not in record:
        raise UserError(f"{where}: its {member} member has no field {json_field!r}; pass the --label-key "
                        f"json:FIELD that names the label field.")
    return parse_label(record[json_field], where, label_key)


META_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's own rule: such members are shard metadata, not samples


def _tar_members(stream, url: str, spans: dict):
    """The regular members of a plain tar stream as webdataset's file samples; their data spans go to `spans`."""
    archive = tarfile.open(fileobj=stream, mode="r|")  # plain tar only: offsets into a .tar.gz are not seekable
    for info in archive:
        if info.isreg() and not META_MEMBER.match(info.name):
            spans[info.name] = (info.offset_data, info.size)
            yield {"fname": info.name, "data": archive.extractfile(info).read(), "__url__": url}
        archive.members = []  # stream mode: no member list kept (a shard may hold a million)


def _list_tar(url: str, label_key: str, skipped: Skipped) -> list[tuple[str, tuple, int, bytes]]:
    """(key, (offset, size) of its image, label, sha256) of every sample of one shard, in the shard's order."""
    from webdataset.tariterators import group_by_keys
    found, spans = [], {}
    with open_binary(url) as stream:
        try:
            for sample in group_by_keys(_tar_members(stream, url, spans), lcase=False):  # suffix case kept
                key, where = sample["__key__"], f"{url}#{sample['__key__']}"
                names = sorted(k for k in sample if not k.startswith("__"))
                span = {name: spans.pop(f"{key}.{name}", None) for name in names}  # the next sample's: kept
                suffix = next((n for n in names if is_image_file("." + n)), None)  # the first with an image extension
                if suffix is None:
                    skipped.add("no image", where)
                    continue
                found.append((key, span[suffix], _label_of(sample, label_key, where),
                              hashlib.sha256(sample[suffix]).digest()))
        except (OSError, tarfile.TarError, ValueError, KeyError) as err:
            raise _reading_error(url, err) from None
    return found


class TarReader:
    """One sample's image bytes by id: a ranged read at the member's data offset recorded by the listing."""
    def __init__(self, shards: list[str], members: dict):
        self.shards, self.members = shards, members  # id -> (shard index, data offset, size)
        self._open = None  # (shard index, file): the last shard read, per process

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}  # open files stay in the process that opened them

    def read(self, sample_id: str) -> bytes:
        """The bytes of the sample's image member."""
        shard, offset, size = self.members[sample_id]
        if self._open is None or self._open[0] != shard:
            self.close()
            self._open = (shard, open_binary(self.shards[shard]))
        try:
            self._open[1].seek(offset)
            data = self._open[1].read(size)
        except (OSError, ValueError) as err:
            raise _reading_error(self.shards[shard], err) from None
        if len(data) != size:
            raise _reading_error(self.shards[shard], EOFError(f"{len(data)} of {size} bytes at offset {offset}"))
        return data

    def close(self) -> None:
        """Close the open shard, if any."""
        if self._open is not None:
            self._open[1].close()
            self._open = None


def scan_tar_shards(data_path: str, options: SourceOptions) -> SourceScan:
    """List webdataset tar shards: ids SHARD#KEY in shard order then member order."""
    shards = expand_shards(data_path)
    skipped, files, labels, digests, members = Skipped(), [], [], {}, {}
    for index, url in enumerate(tqdm(shards, unit="shard", desc="list", dynamic_ncols=True, disable=len(shards) < 2)):
        for key, (offset, size), label, digest in _list_tar(url, options.label_key, skipped):
            sample_id = f"{url}#{key}"
            files.append(sample_id)
            labels.append(label)
            digests[sample_id], members[sample_id] = digest, (index, offset, size)
    if not files:
        raise UserError(f"--data-path {data_path}: the {counted(len(shards), 'shard')} hold no sample with an image "
                        f"member ({skipped.describe()}). Pass webdataset shards whose samples hold KEY.jpg (or .png, "
                        f".webp, ...) beside the label member.")
    return SourceScan(data_path, class_names(labels, options, data_path), files, labels, skipped, (),
                      TarReader(shards, members), digests)


def parquet_files(data_path: str) -> list[str]:
    """The parquet files of a path, glob or URL; a folder gives its train split (HF layout) or all its files."""
    import fsspec
    local = Path(data_path).expanduser()
    if not is_url(data_path) and local.is_dir():
        for pattern in (f"{PARQUET_SPLIT}-*.parquet", f"data/{PARQUET_SPLIT}-*.parquet", f"*/{PARQUET_SPLIT}-*.parquet",
                        "*.parquet", "data/*.parquet"):
            found = sorted(str(p) for p in local.glob(pattern))
            if found:
                return found
        return []
    try:
        fs, _, paths = fsspec.get_fs_token_paths(data_path)
    except ImportError as err:
        raise UserError(f"cannot open {data_path}: {err}. Install the package named there (pip install aiohttp "
                        f"for https://, s3fs for s3://).") from None
    return [fs.unstrip_protocol(p) if is_url(data_path) else p for p in sorted(paths)]


def _hf_class_names(schema, label_column: str) -> list[str] | None:
    """ClassLabel names of the label column from the `datasets` features in the schema metadata, if any."""
    try:
        info = json.loads((schema.metadata or {})[HF_METADATA])
        feature = info["info"]["features"][label_column]
        return [str(n) for n in feature["names"]] if feature.get("_type") == "ClassLabel" else None
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def image_bytes(column) -> list:
    """The encoded images of one arrow column: a struct with `bytes` (as `datasets` writes Image) or binary."""
    import pyarrow as pa
    if pa.types.is_struct(column.type):
        column = (column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column).field("bytes")
    return column.to_pylist()


class ParquetReader:
    """One row's image bytes by id: pyarrow reads the row group holding it (the last one kept, per process)."""
    def __init__(self, files: list[str], rows: dict, image_column: str):
        self.files, self.rows, self.image_column = files, rows, image_column  # id -> (file, row group, row)
        self._group = None  # ((file, row group), list of bytes)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_group": None}

    def read(self, sample_id: str) -> bytes:
        """The bytes of the row's image (empty when the row holds none: decoded as a bad sample)."""
        import pyarrow.parquet as pq
        file, group, row = self.rows[sample_id]
        if self._group is None or self._group[0] != (file, group):
            with open_binary(self.files[file]) as handle:
                try:
                    table = pq.ParquetFile(handle).read_row_group(group, columns=[self.image_column])
                except (OSError, ValueError) as err:
                    raise _reading_error(self.files[file], err) from None
            self._group = ((file, group), image_bytes(table.column(self.image_column)))
        return self._group[1][row] or b""


def scan_parquet(data_path: str, options: SourceOptions) -> SourceScan:
    """List a parquet dataset: ids FILE#ROW in file order then row order."""
    files = parquet_files(data_path)
    if not files:
        raise UserError(f"--data-path {data_path} holds no parquet file (looked for {PARQUET_SPLIT}-*.parquet, "
                        f"data/{PARQUET_SPLIT}-*.parquet, */{PARQUET_SPLIT}-*.parquet, *.parquet). Pass the files, "
                        f"a glob such as data/train-*.parquet, or the dataset's folder.")
    import pyarrow.parquet as pq
    ids, labels, digests, rows, hf_names = [], [], {}, {}, None
    for index, url in enumerate(tqdm(files, unit="file", desc="list", dynamic_ncols=True, disable=len(files) < 2)):
        with open_binary(url) as handle:  # rows addressed (file, row group, row)
            try:
                pf = pq.ParquetFile(handle)
                names = pf.schema_arrow.names
                for flag, name in (("--image-column", options.image_column), ("--label-column", options.label_column)):
                    if name not in names:
                        raise UserError(f"{url} has no column {name!r} (its columns: {', '.join(names)}). Pass the "
                                        f"{flag} that holds the {flag[2:7]}s.")
                found = pf.read(columns=[options.label_column]).column(options.label_column).to_pylist()
                start = len(ids)
                for group in range(pf.num_row_groups):
                    for row, data in enumerate(image_bytes(pf.read_row_group(group, columns=[options.image_column])
                                                           .column(options.image_column))):
                        ids.append(f"{url}#{len(ids) - start}")
                        rows[ids[-1]], digests[ids[-1]] = (index, group, row), hashlib.sha256(data or b"").digest()
            except (OSError, ValueError) as err:
                raise _reading_error(url, err) from None
        labels += [parse_label(v, f"{url}#{n}", options.label_column) for n, v in enumerate(found)]
        hf_names = hf_names or _hf_class_names(pf.schema_arrow, options.label_column)
    return SourceScan(data_path, class_names(labels, options, data_path, hf_names), ids, labels, Skipped(), (),
                      ParquetReader(files, rows, options.image_column), digests)


# ---- The listing kept in --out: a rerun (resume) does not read the whole source again ----

LISTING_NAME = "source-listing.json.gz"
LISTING_VERSION = 2


def unit_sizes(urls: list[str]) -> list[int]:
    """The byte size of each shard or file (os.stat, or the filesystem's info: one request per URL)."""
    import fsspec
    sizes = []
    for url in urls:
        try:
            sizes.append(fsspec.core.url_to_fs(url)[0].size(url) if is_url(url) else Path(url).stat().st_size)
        except (OSError, ValueError, ImportError):
            sizes.append(-1)
    return sizes


def listed_source(data_path, options: SourceOptions, out: Path | None, extra: dict, make) -> tuple:
    """(scan, key to save it under, or None): the listing kept in `out` when it still fits, else make()."""
    data_path = str(data_path)
    if out is None or source_kind(data_path) == "folder":
        return make(), None
    try:  # the key: what a kept listing must have been made from to be reused
        class_map = None if options.class_map is None else Path(options.class_map).expanduser().read_text()
    except OSError:
        class_map = None  # read_class_map names the problem when the source is listed
    key = {"version": LISTING_VERSION, "data_path": data_path, "label_key": options.label_key, "class_map": class_map,
           "image_column": options.image_column, "label_column": options.label_column, **extra}
    try:  # the kept listing, if made from the same source and options and every shard still has its size
        record = json.loads(gzip.decompress((Path(out) / LISTING_NAME).read_bytes()))
    except (OSError, ValueError, EOFError):
        return make(), key
    if record.get("key") != key or unit_sizes(record["units"]) != record["sizes"]:
        return make(), key
    files = record["files"]
    where = {f: tuple(w) for f, w in zip(files, record["where"])}
    reader = (TarReader(record["units"], where) if record["kind"] == "tar"
              else ParquetReader(record["units"], where, record["image_column"]))
    digests = {f: bytes.fromhex(d) for f, d in zip(files, record["digests"])}
    return SourceScan(data_path, record["classes"], files, record["labels"], Skipped(*record["skipped"]),
                      tuple(record["notes"]), reader, digests), None


def save_listing(scan: SourceScan, path: Path, key: dict) -> None:
    """Write the listing (after --limit and --duplicates) beside the shards, atomically."""
    reader = scan.reader
    tar = isinstance(reader, TarReader)
    units, where = (reader.shards, reader.members) if tar else (reader.files, reader.rows)
    record = {"key": key, "kind": "tar" if tar else "parquet", "units": units, "sizes": unit_sizes(units),
              "classes": scan.classes, "files": scan.files, "labels": scan.labels,
              "digests": [scan.digests[f].hex() for f in scan.files], "where": [where[f] for f in scan.files],
              "skipped": [scan.skipped.counts, scan.skipped.first], "notes": list(scan.notes),
              "image_column": getattr(reader, "image_column", None)}
    atomic_write_bytes(path, gzip.compress(json.dumps(record).encode(), mtime=0))


def source_kind(data_path: str) -> str:
    """'tar', 'parquet' or 'folder', from the path's form (and a local folder's parquet files)."""
    if ".parquet" in data_path:
        return "parquet"
    if data_path.endswith(".tar") or all(u.endswith(".tar") for u in expand_shards(data_path)):
        return "tar"
    if not is_url(data_path) and Path(data_path).expanduser().is_dir() and parquet_files(data_path):
        return "parquet"
    if is_url(data_path):
        raise UserError(f"--data-path {data_path}: a URL must name webdataset tar shards (ending in .tar, e.g. "
                        f"https://host/train-{{000000..000146}}.tar) or parquet files (ending in .parquet, globs "
                        f"allowed); an ImageFolder must be a local folder.")
    return "folder"


# The flags each kind of source reads; any other set to a value of its own is refused (never silently ignored).
SOURCE_FLAGS = {"tar": ("label_key", "class_map"), "parquet": ("class_map", "image_column", "label_column"),
                "folder": ()}
KIND_NAMES = {"tar": "webdataset tar shards", "parquet": "parquet files", "folder": "an ImageFolder"}


def open_source(data_path, options: SourceOptions | None = None) -> ImageFolderScan:
    """The listing of an ImageFolder, webdataset tar shards or a parquet dataset (see the module docstring)."""
    options = options or SourceOptions()
    data_path = str(data_path)
    kind = source_kind(data_path)
    # a source flag set away from its default that this kind of source does not read is refused
    unused = [name for name in ("label_key", "class_map", "image_column", "label_column")
              if name not in SOURCE_FLAGS[kind] and getattr(options, name) != getattr(SourceOptions(), name)]
    if unused:
        flags, one = " and ".join("--" + name.replace("_", "-") for name in unused), len(unused) == 1
        readers = " or ".join(KIND_NAMES[k] for k, names in SOURCE_FLAGS.items() if unused[0] in names)
        raise UserError(f"{flags} {'applies' if one else 'apply'} to {readers}, but --data-path names "
                        f"{KIND_NAMES[kind]}. Drop {flags}, or point --data-path at the source "
                        f"{'it is' if one else 'they are'} for.")
    if kind == "folder":
        return scan_image_folder(data_path)
    return (scan_tar_shards if kind == "tar" else scan_parquet)(data_path, options)


def describe_source(scan: ImageFolderScan) -> str:
    """'tar shards', 'parquet files' or 'ImageFolder': what --check and the dry run say they read."""
    reader = getattr(scan, "reader", None)
    return {TarReader: "webdataset tar shards", ParquetReader: "parquet files"}.get(type(reader), "ImageFolder")
