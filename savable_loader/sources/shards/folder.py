"""A shard folder's manifest, found in its store: ``metadata.json``, or the manifest another
library wrote (Energon's ``.nv-meta/.info.json``, MosaicML Streaming's or LitData's
``index.json``), read unchanged.

:func:`load_metadata` looks for them in that order; :func:`read_metadata` does it for a
local folder. The manifest's own format (its fields and checks) is ``manifest.py``; the
stores are ``store.py`` and ``remote.py``.

Example::

    meta = read_metadata("data/train")
    meta.shards[0].samples
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from typing import Any

import msgspec

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.sources.shards import litdata, mds
from savable_loader.sources.shards.manifest import (
    ENERGON_INFO,
    ENERGON_INFO_YAML,
    ENERGON_SPLITS,
    INDEX_JSON,
    METADATA_NAME,
    Metadata,
    NonNegative,
    ShardEntry,
    SplitRequired,
    _decode,
    brace_expand,
    check_path,
    parse_metadata,
)
from savable_loader.sources.shards.store import LocalShardStore, ShardStore

__all__ = ["foreign_metadata", "load_metadata", "read_metadata"]


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
            return Metadata(format=2, shards=litdata.entries_from_index(doc, where), source="litdata")
        if isinstance(doc, dict) and "shards" in doc:
            return Metadata(format=2, shards=mds.entries_from_index(doc, where), source="mds")
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


class _EnergonSplits(msgspec.Struct):
    split_parts: dict[str, list[str]]
    exclude: list[str] = []
