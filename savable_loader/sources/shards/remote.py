"""A shard folder behind a :class:`~savable_loader.storage.Storage`: any fsspec URL as a
:class:`~savable_loader.sources.shards.store.ShardStore`.

This is the remote side of the seam described in ``sources/shards/store.py``; the readers and the
dataset do not change:

* ``read_small`` reads ``metadata.json``, the manifests and tar indexes whole, uncached,
  under the storage's retry policy (a missing file is None).
* ``open_shard(whole=True)`` (iteration) hands out the shard's copy in the node's cache,
  downloaded now unless the cache or the prefetch thread already holds it; the download
  is checked against the size, SHA-256 and ETag the manifest records.
* ``open_shard(whole=False)`` (``restore_sample``, inspection) reads byte ranges: from
  the cached copy when there is one, else one ranged request per read.
* ``prefetch(entries)`` names the shards the worker reads next (the dataset calls it each
  time it moves to a new shard, from its exact epoch layout).
* ``exists`` answers True without a request (a folder of thousands of shards is not
  probed at construction); a missing shard is an error when it is opened.
* The indexer's writes (``metadata.json``, tar indexes) go to the bucket; its journal is
  kept in the local cache folder (object stores cannot append).

Nothing of it enters a state: the store pickles as the storage's settings.

Example::

    from savable_loader.storage import Storage

    store = StorageShardStore(Storage("s3://bucket/train", cache_dir="/local/cache"))
    ds = ShardedFileDataset(store, wc)   # or ShardedFileDataset(Storage(...), wc)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.sources.shards.manifest import ShardEntry
from savable_loader.sources.shards.store import LocalShardFile, LocalShardStore, ShardFile, ShardStore

if TYPE_CHECKING:
    from savable_loader.storage import CachedFile, FileRef, Storage

__all__ = ["StorageShardFile", "StorageShardStore", "store_for"]

_JOURNAL = ".savable_loader-index.jsonl"


class StorageShardFile(ShardFile):
    """One shard of a :class:`StorageShardStore`: the cached copy (``local_path``) when
    opened whole, ranged reads otherwise."""

    def __init__(self, storage: Storage, ref: FileRef, size: int, cached: CachedFile | None) -> None:
        self.name = storage.remote.url_of(ref.path)
        self.size = size
        self._storage = storage
        self._ref = ref
        self._cached = cached
        self._local: LocalShardFile | None = None
        if cached is not None:
            try:
                self._local = LocalShardFile(cached.path, size)
            except BaseException:
                cached.close()
                raise
            self._local.name = self.name

    @property
    def local_path(self) -> Path | None:
        return self._local.path if self._local is not None else None

    def read(self, offset: int, length: int) -> bytes:
        if self._local is not None:
            return self._local.read(offset, length)
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DataError(
                f"{self.name}: truncated: wanted bytes [{offset}, {offset + length}), the file has {self.size} bytes"
            )
        return self._storage.read_range(self._ref, offset, offset + length)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        if self._cached is not None:
            self._cached.close()
            self._cached = None


class StorageShardStore(ShardStore):
    """A shard folder at any fsspec URL, read through ``storage`` (cache, prefetch,
    retries, integrity checks; see the module docstring).

    Example::

        store = StorageShardStore(Storage("memory://data", cache_dir="cache"))
        raw = store.read_small("metadata.json")
    """

    def __init__(self, storage: Storage) -> None:
        from savable_loader.storage import Storage

        if not isinstance(storage, Storage):
            raise LoaderUsageError(f"StorageShardStore needs a savable_loader.storage.Storage, got {storage!r}")
        self.storage = storage

    def __repr__(self) -> str:
        return f"StorageShardStore({self.storage!r})"

    @property
    def prefetch_depth(self) -> int:
        """How many upcoming shards the storage downloads ahead."""
        return 0 if self.storage.is_local else self.storage.prefetch_depth

    def describe(self, name: str = "") -> str:
        return self.storage.remote.url_of(name) if name else self.storage.url

    def read_small(self, name: str) -> bytes | None:
        if name == _JOURNAL:
            return self._journal_read()
        return self.storage.read(name, missing_ok=True)

    def exists(self, name: str) -> bool:
        return True

    def _ref(self, name: str, size: int | None, sha256: str | None, etag: str | None) -> FileRef:
        from savable_loader.storage import FileRef

        return FileRef(name, size=size, sha256=sha256, etag=etag)

    def open_shard(
        self, name: str, size: int | None, whole: bool, *, sha256: str | None = None, etag: str | None = None
    ) -> StorageShardFile:
        ref = self._ref(name, size, sha256, etag)
        if whole:
            cached = self.storage.open(ref)
            return StorageShardFile(self.storage, ref, cached.size, cached)
        if size is None:
            found = self.storage.remote.info(name)["size"]
            if found is None:  # the server does not say: read the file whole
                cached = self.storage.open(ref)
                return StorageShardFile(self.storage, ref, cached.size, cached)
            size = int(found)
        return StorageShardFile(self.storage, ref, size, None)

    def prefetch(self, entries: Sequence[ShardEntry]) -> None:
        self.storage.prefetch([self._ref(e.path, e.size, e.sha256, e.etag) for e in entries])

    def close(self) -> None:
        self.storage.close()

    # -- indexer ----------------------------------------------------------------------

    def list_files(self) -> list[str]:
        return self.storage.remote.find()

    def stat(self, name: str) -> tuple[int, int]:
        return self.storage.remote.stat(name)

    def write_small(self, name: str, data: bytes) -> None:
        if name == _JOURNAL:
            path = self._journal_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return
        self.storage.remote.write(name, data)

    def append_small(self, name: str, data: bytes) -> None:
        if name != _JOURNAL:
            raise DataError(f"{self.describe(name)}: an object store cannot append")
        path = self._journal_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)

    def remove_small(self, name: str) -> None:
        if name != _JOURNAL:
            raise DataError(f"{self.describe(name)}: the indexer removes only its journal")
        self._journal_path().unlink(missing_ok=True)

    def _journal_path(self) -> Path:
        from savable_loader.storage import default_cache_dir

        folder = self.storage.cache.folder if self.storage.cache is not None else default_cache_dir()
        digest = hashlib.blake2b(self.storage.url.encode(), digest_size=10).hexdigest()
        return folder / "index-journals" / f"{digest}.jsonl"

    def _journal_read(self) -> bytes | None:
        try:
            return self._journal_path().read_bytes()
        except FileNotFoundError:
            return None


def storage_store(folder: Any, storage_options: Any = None) -> ShardStore | None:
    """The store of a URL or a :class:`~savable_loader.storage.Storage` (None for a local
    path): a local Storage is read in place, anything else through the cache."""

    if isinstance(folder, (str, os.PathLike)) and not _is_url(os.fspath(folder)):
        if storage_options:
            raise LoaderUsageError(f"storage_options are for URLs; {os.fspath(folder)!r} is a local folder")
        return None
    from savable_loader.storage import Storage

    if isinstance(folder, Storage):
        if storage_options:
            raise LoaderUsageError("storage_options are given to the Storage, not beside it")
        storage = folder
    else:
        storage = Storage(os.fspath(folder), storage_options=storage_options)
    if storage.is_local:
        return LocalShardStore(storage.remote.root, verify_sha256=storage.verify_local_sha256)
    return StorageShardStore(storage)


def _is_url(text: str) -> bool:
    head, sep, _ = text.partition("://")
    return bool(sep) and len(head) > 1 or "::" in text


def store_for(
    folder: str | os.PathLike[str] | ShardStore | Storage, storage_options: Mapping[str, Any] | None = None
) -> ShardStore:
    """The store of ``folder``: a store is used as is, a local path becomes a
    LocalShardStore, a URL (``s3://...``) or a :class:`~savable_loader.storage.Storage`
    a :class:`~savable_loader.sources.shards.remote.StorageShardStore`."""
    if isinstance(folder, ShardStore):
        if storage_options:
            raise LoaderUsageError("storage_options are for URLs, not for a ShardStore")
        return folder
    store = storage_store(folder, storage_options)
    if store is not None:
        return store
    return LocalShardStore(os.fspath(folder))  # type: ignore[arg-type]  # a Storage gives a store above
