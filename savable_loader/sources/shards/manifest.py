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

This module is a leaf: it reads no file and imports no store. ``folder.py``
(:func:`~savable_loader.sources.shards.folder.load_metadata`) finds a folder's manifest
in its store.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Annotated, Any

import msgspec

from savable_loader.errors import DataError, LoaderUsageError

__all__ = [
    "FORMATS",
    "METADATA_NAME",
    "SUFFIX_FORMATS",
    "Metadata",
    "ShardEntry",
    "encode_metadata",
    "order_digest_input",
    "parse_metadata",
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


class SplitRequired(DataError):
    """An Energon dataset with several splits was opened without choosing one."""


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
