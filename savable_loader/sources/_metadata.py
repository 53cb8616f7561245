"""The manifest of a shard folder: ``metadata.json`` (versions 1 and 2), or the manifest
another library wrote (Energon's ``.nv-meta/.info.json``, MosaicML Streaming's or
LitData's ``index.json``), read unchanged.

Version 2 of ``metadata.json`` (written by ``python -m savable_loader index``)::

    {"format": 2,
     "shards": [
       {"path": "train-000.tar", "samples": 1000, "format": "tar", "size": 52428800,
        "index": "train-000.tar.idx", "sha256": "9f86d0..."},
       {"path": "part-0.parquet", "samples": 30000, "format": "parquet", "size": 9431221,
        "row_groups": [10000, 10000, 10000]},
       {"path": "rows.npy", "samples": 100, "format": "npy", "size": 51328}]}

Per shard: ``path`` (relative to the folder, POSIX, no ``..``), ``samples``, ``format``
(one of :data:`FORMATS`), ``size`` in bytes (checked when the shard is opened: a shard
that changed after indexing is an error, never different data), optional ``sha256`` and
``etag`` (for storage layers that check downloads), and what a reader needs without
listing or scanning anything: ``index`` (a tar's byte-offset index, Energon's
``.tar.idx`` layout), ``row_groups`` (a Parquet file's rows per row group, the units
a shuffle permutes), ``options`` (MDS / LitData decoding settings copied from their
``index.json``).

Version 1 (``{"format": 1, "shards": [{"path": ..., "samples": ...}]}``, written by
``write_shards``) stays valid: the suffix (``.npy``, ``.pt``, ``.jsonl``) is the format.

:func:`load_metadata` looks, in this order, for ``metadata.json``, Energon's
``.nv-meta/.info.json``, and an ``index.json`` from MosaicML Streaming (MDS) or LitData.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Annotated, Any

import msgspec

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.sources._store import LocalShardStore, ShardStore

__all__ = [
    "FORMATS",
    "METADATA_NAME",
    "SUFFIX_FORMATS",
    "Metadata",
    "ShardEntry",
    "encode_metadata",
    "foreign_metadata",
    "load_metadata",
    "order_digest_input",
    "parse_metadata",
    "read_metadata",
    "units_of",
]

METADATA_NAME = "metadata.json"
VERSIONS = (1, 2)
#: Shard formats a version-2 ``metadata.json`` may name.
FORMATS = ("npy", "pt", "jsonl", "tar", "parquet", "mds", "litdata")
#: The format of a file by its suffix, for version 1 and for the indexer.
SUFFIX_FORMATS = {".npy": "npy", ".pt": "pt", ".jsonl": "jsonl", ".tar": "tar", ".parquet": "parquet"}
V1_SUFFIXES = (".npy", ".pt", ".jsonl")
ENERGON_INFO = ".nv-meta/.info.json"
ENERGON_INFO_YAML = ".nv-meta/.info.yaml"
ENERGON_SPLITS = (".nv-meta/split.yaml", ".nv-meta/split.json")
INDEX_JSON = "index.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ShardEntry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One shard of the manifest (the fields are described in the module docstring)."""

    path: str
    samples: NonNegative
    format: str | None = None
    size: NonNegative | None = None
    sha256: str | None = None
    etag: str | None = None
    index: str | None = None
    row_groups: list[NonNegative] | None = None
    options: dict[str, Any] | None = None

    @property
    def tar_index(self) -> str:
        """The path of a tar shard's byte-offset index (``index`` or ``<path>.idx``)."""
        return self.index or f"{self.path}.idx"


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    """The whole manifest: ``format`` is its version (1 or 2), ``shards`` its entries in order.

    ``source`` (not part of the file) says where it came from: ``metadata.json``,
    ``energon``, ``mds`` or ``litdata``.
    """

    format: int
    shards: list[ShardEntry]
    source: str = METADATA_NAME


def units_of(entry: ShardEntry) -> list[int]:
    """Rows of each unit a shuffle permutes: a Parquet file's row groups, else the whole shard."""
    if entry.row_groups is not None and len(entry.row_groups) > 1:
        return list(entry.row_groups)
    return [entry.samples]


def order_digest_input(meta: Metadata) -> list[dict[str, Any]]:
    """What the order of an epoch depends on: paths, sample counts and units (nothing else,
    so that re-indexing a version-1 folder as version 2 keeps its states valid)."""
    out: list[dict[str, Any]] = []
    for e in meta.shards:
        item: dict[str, Any] = {"path": e.path, "samples": e.samples}
        units = units_of(e)
        if len(units) > 1:
            item["units"] = units
        out.append(item)
    return out


def encode_metadata(meta: Metadata) -> bytes:
    """``meta`` as the indented JSON of a ``metadata.json`` file."""
    doc = {"format": meta.format, "shards": msgspec.to_builtins(meta.shards)}
    return msgspec.json.format(msgspec.json.encode(doc)) + b"\n"


def _decode(raw: bytes, kind: type[Any], where: str) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise DataError(f"{where}: {e}") from None
    except msgspec.DecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e})") from None


def parse_metadata(raw: bytes, where: str) -> Metadata:
    """Decode and check the text of a ``metadata.json`` (``where`` names it in errors)."""
    meta = _decode(raw, _MetadataFile, where)
    if meta.format not in VERSIONS:
        raise DataError(f"{where}: `$.format` is {meta.format!r}, this version of savable_loader reads formats 1 and 2")
    seen: set[str] = set()
    for i, shard in enumerate(meta.shards):
        _check_entry(shard, meta.format, f"{where}: `$.shards[{i}]", seen)
    return Metadata(format=meta.format, shards=meta.shards)


class _MetadataFile(msgspec.Struct, forbid_unknown_fields=True):
    format: int
    shards: list[ShardEntry]


def check_path(path: str, where: str) -> None:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path:
        raise DataError(f"{where} is {path!r}; expected a path relative to the folder, without '..'")


def _check_entry(shard: ShardEntry, version: int, where: str, seen: set[str]) -> None:
    check_path(shard.path, f"{where}.path`")
    suffix = PurePosixPath(shard.path).suffix
    if version == 1:
        extra = [
            f
            for f in ("format", "size", "sha256", "etag", "index", "row_groups", "options")
            if getattr(shard, f) is not None
        ]
        if extra:
            raise DataError(f"{where}.{extra[0]}` is a field of format 2, but `$.format` is 1")
        if suffix not in V1_SUFFIXES:
            raise DataError(
                f"{where}.path` is {shard.path!r}; expected a file ending in one of {', '.join(V1_SUFFIXES)}"
            )
        shard.format = SUFFIX_FORMATS[suffix]
    elif shard.format not in FORMATS:
        raise DataError(f"{where}.format` is {shard.format!r}; expected one of {', '.join(FORMATS)}")
    if shard.path in seen:
        raise DataError(f"{where}.path` is {shard.path!r}, which is listed twice")
    seen.add(shard.path)
    if shard.sha256 is not None and not _SHA256.match(shard.sha256):
        raise DataError(f"{where}.sha256` is {shard.sha256!r}; expected 64 lowercase hexadecimal digits")
    if shard.index is not None:
        if shard.format != "tar":
            raise DataError(f"{where}.index` is set for a {shard.format!r} shard; only tar shards have one")
        check_path(shard.index, f"{where}.index`")
    if shard.row_groups is not None:
        if shard.format != "parquet":
            raise DataError(f"{where}.row_groups` is set for a {shard.format!r} shard; only parquet shards have them")
        if sum(shard.row_groups) != shard.samples:
            raise DataError(
                f"{where}.row_groups` add up to {sum(shard.row_groups)} rows, but `samples` is {shard.samples}"
            )
    elif shard.format == "parquet":
        raise DataError(f"{where}.row_groups` is missing: a parquet shard lists its rows per row group")
    if shard.format in ("mds", "litdata") and shard.options is None:
        raise DataError(f"{where}.options` is missing: a {shard.format} shard needs its decoding settings")


def load_metadata(store: ShardStore, check_files: bool = True, split: str | None = None) -> Metadata:
    """The manifest of the folder behind ``store`` (see the module docstring for where it
    is looked for); with ``check_files``, every shard file must exist. ``split`` names a
    part of an Energon dataset's split config (``.nv-meta/split.yaml``).

    Example::

        meta = load_metadata(LocalShardStore("data/train"))
        sum(s.samples for s in meta.shards)
    """
    raw = store.read_small(METADATA_NAME)
    if raw is not None:
        meta = parse_metadata(raw, store.describe(METADATA_NAME))
    else:
        meta = foreign_metadata(store, split)
    if split is not None and meta.source != "energon":
        raise LoaderUsageError(
            f"{store.describe()}: split={split!r} selects a part of an Energon dataset (.nv-meta/split.yaml), "
            f"but the folder's manifest is {meta.source}"
        )
    if check_files:
        for i, shard in enumerate(meta.shards):
            if not store.exists(shard.path):
                where = (
                    store.describe(METADATA_NAME)
                    if meta.source == METADATA_NAME
                    else store.describe({"energon": ENERGON_INFO}.get(meta.source, INDEX_JSON))
                )
                raise DataError(
                    f"{where}: `$.shards[{i}].path`: shard file {store.describe(shard.path)} does not exist"
                )
            if shard.format == "tar" and not store.exists(shard.tar_index):
                raise DataError(
                    f"{store.describe(shard.tar_index)}: the index of tar shard {store.describe(shard.path)} does "
                    f"not exist: write it with `python -m savable_loader index {store.describe()}`"
                )
    return meta


def read_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """The manifest of a local shard folder (``metadata.json``, or Energon's, MosaicML
    Streaming's or LitData's); every shard file must exist.

    Example::

        meta = read_metadata("data/train")
        sum(s.samples for s in meta.shards)
    """
    return load_metadata(LocalShardStore(folder))


def foreign_metadata(store: ShardStore, split: str | None = None) -> Metadata:
    """The manifest of a folder without ``metadata.json``: Energon's, MDS's or LitData's."""
    from savable_loader.sources import _litdata, _mds

    info = store.read_small(ENERGON_INFO)
    if info is not None:
        meta = _energon_metadata(info, store.describe(ENERGON_INFO))
        meta.shards = _energon_split(store, meta.shards, split)
        return meta
    index = store.read_small(INDEX_JSON)
    if index is not None:
        where = store.describe(INDEX_JSON)
        doc = _decode(index, Any, where)
        if isinstance(doc, dict) and "chunks" in doc and "config" in doc:
            return Metadata(format=2, shards=_litdata.entries_from_index(doc, where), source="litdata")
        if isinstance(doc, dict) and "shards" in doc:
            return Metadata(format=2, shards=_mds.entries_from_index(doc, where), source="mds")
        raise DataError(
            f"{where}: neither a MosaicML Streaming index (`shards`) nor a LitData index (`chunks`, `config`)"
        )
    hint = f"write one with `python -m savable_loader index {store.describe()}`"
    if store.read_small(ENERGON_INFO_YAML) is not None:
        hint = (
            f"found {ENERGON_INFO_YAML} of an older Energon version, which this reader does not parse: "
            + hint
            + " (it reuses the .tar.idx files)"
        )
    raise DataError(
        f"{store.describe(METADATA_NAME)}: cannot read the shard metadata (No such file; no Energon "
        f"{ENERGON_INFO}, MosaicML Streaming or LitData {INDEX_JSON} either): {hint}"
    )


class _EnergonInfo(msgspec.Struct):
    shard_counts: dict[str, NonNegative]
    energon_version: str | None = None


def _energon_metadata(raw: bytes, where: str) -> Metadata:
    info = _decode(raw, _EnergonInfo, where)
    entries = []
    for name, count in info.shard_counts.items():
        check_path(name, f"{where}: `$.shard_counts` key")
        # Energon names the index with Path.with_suffix(".tar.idx"): "a.tar" -> "a.tar.idx"
        index = str(PurePosixPath(name).with_suffix(".tar.idx"))
        entries.append(ShardEntry(path=name, samples=count, format="tar", index=index))
    return Metadata(format=2, shards=entries, source="energon")


def _energon_split(store: ShardStore, shards: list[ShardEntry], split: str | None) -> list[ShardEntry]:
    """The shards of one part of an Energon split config, in its order, without excluded
    shards; all shards when the folder has no split config."""
    raw, name = None, ""
    for name in ENERGON_SPLITS:
        raw = store.read_small(name)
        if raw is not None:
            break
    where = store.describe(name)
    if raw is None:
        if split is not None:
            raise DataError(f"{store.describe(ENERGON_SPLITS[0])}: no split config, but split={split!r} was asked for")
        return shards
    if name.endswith(".yaml"):
        try:
            import yaml
        except ImportError:
            raise DataError(f"{where}: reading it needs PyYAML (pip install pyyaml)") from None
        try:
            doc = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise DataError(f"{where}: not valid YAML ({e})") from None
    else:
        doc = _decode(raw, Any, where)
    if not isinstance(doc, dict):
        raise DataError(f"{where}: expected a mapping with `split_parts`, got {type(doc).__name__}")
    try:
        config = msgspec.convert(doc, _EnergonSplits)
    except msgspec.ValidationError as e:
        raise DataError(f"{where}: {e}") from None
    parts = {k: [n for pattern in v for n in brace_expand(pattern, where)] for k, v in config.split_parts.items()}
    if split is None:
        filled = [k for k, v in parts.items() if v]
        if len(filled) != 1:
            described = ", ".join(f"{k!r} ({len(v)} shards)" for k, v in parts.items())
            raise SplitRequired(f"{where}: the dataset is split into {described}: pass split= to choose one")
        split = filled[0]
    if split not in parts:
        raise DataError(f"{where}: no split {split!r} (splits: {sorted(parts)})")
    excluded = {n for pattern in config.exclude for n in brace_expand(pattern, where)}
    by_name = {e.path: e for e in shards}
    out = []
    for shard in parts[split]:
        if shard in excluded:
            continue
        samples_out = sorted(x for x in excluded if x.startswith(shard + "/"))
        if samples_out:
            raise DataError(
                f"{where}: excludes samples of {shard!r} ({samples_out[0]!r}, ...); sample-level "
                "excludes are not supported"
            )
        if shard not in by_name:
            raise DataError(f"{where}: split {split!r} names {shard!r}, which {ENERGON_INFO} does not list")
        out.append(by_name[shard])
    if not out:
        raise DataError(f"{where}: split {split!r} has no shards left (after `exclude`)")
    return out


class SplitRequired(DataError):
    """An Energon dataset with several splits was opened without choosing one."""


class _EnergonSplits(msgspec.Struct):
    split_parts: dict[str, list[str]]
    exclude: list[str] = []


_BRACE = re.compile(r"\{([^{}]*)\}")


def brace_expand(pattern: str, where: str) -> list[str]:
    """Energon's shard patterns: ``{a,b}`` alternatives and ``{000..099}`` ranges."""
    m = _BRACE.search(pattern)
    if m is None:
        if "{" in pattern or "}" in pattern:
            raise DataError(f"{where}: cannot expand the pattern {pattern!r}")
        return [pattern]
    body = m.group(1)
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numbers:
        low, high = numbers.groups()
        width = len(low) if low.startswith("0") else 0
        step = 1 if int(high) >= int(low) else -1
        options = [str(n).zfill(width) for n in range(int(low), int(high) + step, step)]
    else:
        options = body.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [x for option in options for x in brace_expand(head + option + tail, where)]


#: Which files of a folder to index or read: None (all), a glob (``"train-*.parquet"``),
#: a list of paths and globs, or a ``slice`` of the files in their order
#: (``slice(None, -1)``: all but the last; ``slice(-1, None)``: the last).
FileChoice = str | Sequence[str] | slice | None


def choose_files(paths: Sequence[str], files: FileChoice, where: str) -> list[int]:
    """The positions in ``paths`` (in their order) that ``files`` chooses (see
    :data:`FileChoice`). A glob matches the whole path relative to the folder
    (``fnmatch``: ``*`` crosses ``/``). A pattern that matches nothing, or a choice of
    no file, is an error naming the files there are. Example::

        choose_files(["a.parquet", "b.parquet", "val.parquet"], slice(None, -1), "files")   # [0, 1]
    """
    if files is None:
        return list(range(len(paths)))
    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
    if isinstance(files, slice):
        if not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (files.start, files.stop, files.step)
        ):
            raise LoaderUsageError(f"{where}: a slice of ints expected, got {files!r}")
        keep = list(range(len(paths)))[files]
    elif isinstance(files, str) or (isinstance(files, Sequence) and files and all(isinstance(f, str) for f in files)):
        patterns = [files] if isinstance(files, str) else list(files)
        chosen: set[int] = set()
        for pattern in patterns:
            hits = {i for i, p in enumerate(paths) if p == pattern or fnmatch.fnmatchcase(p, pattern)}
            if not hits:
                raise DataError(f"{where}: {pattern!r} matches none of the {len(paths)} files ({shown})")
            chosen |= hits
        keep = sorted(chosen)
    else:
        raise LoaderUsageError(
            f"{where} must be None, a glob, a non-empty list of paths or globs, or a slice "
            f"(slice(None, -1): all but the last), got {files!r}"
        )
    if not keep:
        raise DataError(f"{where}: {files!r} chooses none of the {len(paths)} files ({shown})")
    return keep


def files_config(files: FileChoice) -> Any:
    """``files`` as a plain value for a dataset's config (a slice as ``"[start:stop:step]"``)."""
    if isinstance(files, slice):
        parts = ["" if v is None else str(v) for v in (files.start, files.stop, files.step)]
        return "[" + ":".join(parts if files.step is not None else parts[:2]) + "]"
    return files if isinstance(files, str) or files is None else list(files)
