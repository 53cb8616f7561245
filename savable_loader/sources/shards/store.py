"""Where the bytes of a shard folder come from: the one seam between readers and storage.

Every shard reader (``sources/shards/readers.py``, ``sources/shards/tar.py``, ``sources/shards/parquet.py``, ``sources/shards/mds.py``,
``sources/shards/litdata.py``) sees a shard only through a :class:`ShardFile`, and the dataset and the
indexer see the folder only through a :class:`ShardStore`. :class:`LocalShardStore` is
a folder on the local disk; a remote store (fsspec URLs, a whole-shard cache, prefetch)
implements the same two classes, and nothing else changes:
:class:`~savable_loader.sources.shards.remote.StorageShardStore` does, over a
:class:`~savable_loader.storage.Storage`.

The contract, all of it:

``ShardStore``
    * ``describe(name)``: how to name a file of the folder in messages (path or URL).
    * ``read_small(name)``: the whole content of a small file of the folder
      (``metadata.json``, ``index.json``, ``.nv-meta/.info.json``, a ``.tar.idx``), or
      ``None`` if it does not exist. Called at construction and when a shard is opened.
    * ``open_shard(name, size, whole, sha256=, etag=)``: a :class:`ShardFile` for one
      shard. ``size`` is the size ``metadata.json`` records (None if unknown); a store
      must refuse a shard of another size with a :class:`~savable_loader.errors.DataError`
      naming both sizes (a remote store checks ``sha256`` and ``etag`` too, when given).
      ``whole=True`` is asked by iteration, which reads most of the shard: a remote store
      downloads the shard (into its cache) and returns a file with a ``local_path``.
      ``whole=False`` is asked by ``restore_sample`` and inspection, which read a few
      byte ranges: a remote store may serve them with ranged reads and no local copy.
    * ``prefetch(entries)`` / ``prefetch_depth``: the dataset names the next
      ``prefetch_depth`` shards each time it moves to a new shard; a remote store
      downloads them in the background (a local one does nothing). ``close()`` stops it.
    * ``exists(name)``: whether a shard file exists (checked at construction for local
      folders; a remote store may return True and let ``open_shard`` fail).
    * indexer only: ``list_files()`` (every file under the folder, relative POSIX paths,
      sorted), ``write_small(name, data)`` (atomic: a reader never sees a partial file),
      ``append_small(name, data)`` (the indexer's journal), ``remove_small(name)``,
      ``stat(name)`` (``(size, stamp)``, the stamp changing whenever the file does).

``ShardFile``
    * ``name`` (for messages), ``size`` (bytes).
    * ``read(offset, length)``: exactly ``length`` bytes from ``offset``; a short read is a
      :class:`~savable_loader.errors.DataError` naming the file and the range.
    * ``local_path``: a local file holding the whole shard, or None. Readers that need a
      file (``.npy`` and ``.pt`` rows are read from it, ``.jsonl`` is read whole) are
      opened with ``whole=True``; the tar, Parquet, MDS and LitData readers use
      ``local_path`` when there is one and ``read`` otherwise. Local files are read with
      ``pread`` through a held descriptor, never memory-mapped (``sources/shards/held_file.py``).
    * ``close()``.

Stores and files are created in the process that uses them (a dataset drops its open
files when it is pickled to a worker), so a store holds only picklable settings.
``remote.store_for(folder)`` is the one place that turns what a user passes
(``ShardedFileDataset(folder)``, ``index_folder(folder)``) into a store: a URL scheme
maps to a remote store there.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from savable_loader.errors import DataError
from savable_loader.sources.shards.held_file import HeldFile, truncated
from savable_loader.sources.shards.manifest import ShardEntry

__all__ = ["LocalShardFile", "LocalShardStore", "ShardFile", "ShardStore", "byte_getter"]

_HASH_CHUNK = 8 * 2**20  # bytes read at a time to hash a local shard


class ShardFile(ABC):
    """The bytes of one shard, as a reader sees them (see the module docstring)."""

    name: str
    size: int

    @property
    def local_path(self) -> Path | None:
        """A local file with the whole shard, or None (then use ``read``)."""
        return None

    @abstractmethod
    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``; DataError if the file is shorter."""

    def close(self) -> None:
        """Release what the file holds."""


class ShardStore(ABC):
    """A shard folder: small files read whole, shard files opened one at a time."""

    @abstractmethod
    def describe(self, name: str = "") -> str:
        """The folder (``name=""``) or one of its files as shown in messages."""

    @abstractmethod
    def read_small(self, name: str) -> bytes | None:
        """The content of a small file of the folder, or None if it does not exist."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether the file ``name`` exists."""

    @abstractmethod
    def open_shard(
        self, name: str, size: int | None, whole: bool, *, sha256: str | None = None, etag: str | None = None
    ) -> ShardFile:
        """One shard; DataError if it is missing or its size is not ``size`` (a remote
        store also checks ``sha256`` and ``etag`` when it downloads the shard)."""

    @property
    def prefetch_depth(self) -> int:
        """How many upcoming shards :meth:`prefetch` wants named (0: it does nothing)."""
        return 0

    def prefetch(self, entries: Sequence[ShardEntry]) -> None:
        """The shards this process reads next, in order (a remote store downloads them)."""

    def close(self) -> None:
        """Stop background work (prefetch) of this process."""

    def list_files(self) -> list[str]:
        """Every file under the folder (relative POSIX paths, sorted); for the indexer."""
        raise DataError(f"{self.describe()}: this store cannot list its files")

    def stat(self, name: str) -> tuple[int, int]:
        """``(size, stamp)`` of a file; the stamp changes when the file does. For the indexer."""
        raise DataError(f"{self.describe(name)}: this store cannot stat files")

    def write_small(self, name: str, data: bytes) -> None:
        """Write a small file atomically (metadata, tar indexes); for the indexer."""
        raise DataError(f"{self.describe(name)}: this store is read-only")

    def append_small(self, name: str, data: bytes) -> None:
        """Append to a small file, creating it (the indexer's journal)."""
        raise DataError(f"{self.describe(name)}: this store is read-only")

    def remove_small(self, name: str) -> None:
        """Remove a small file if it exists (the indexer's journal)."""
        raise DataError(f"{self.describe(name)}: this store is read-only")


class LocalShardFile(ShardFile):
    """A shard on the local disk: ``read`` is one ``os.pread``."""

    def __init__(self, path: Path, size: int | None = None) -> None:
        self.name = str(path)
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise DataError(f"{path}: shard file does not exist") from None
        except OSError as e:
            raise DataError(f"{path}: cannot open the shard ({e.strerror or e})") from None
        self.size = os.fstat(self._fd).st_size
        if size is not None and self.size != size:
            found = self.size
            self.close()
            raise changed_since_indexed(str(path), found, size)

    @property
    def local_path(self) -> Path:
        return self.path

    def read(self, offset: int, length: int) -> bytes:
        if self._fd is None:
            raise DataError(f"{self.name}: read after close")
        data = os.pread(self._fd, length, offset) if length else b""
        if len(data) != length:
            raise DataError(
                f"{self.name}: truncated: wanted bytes [{offset}, {offset + length}), the file has {self.size} bytes"
            )
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalShardStore(ShardStore):
    """A shard folder on the local disk.

    Example::

        store = LocalShardStore("data/train")
        raw = store.read_small("metadata.json")
        f = store.open_shard("shard-00000.tar", size=None, whole=True)
    """

    def __init__(self, folder: str | os.PathLike[str], verify_sha256: bool = False) -> None:
        self.folder = Path(folder)
        self.verify_sha256 = verify_sha256
        self._verified: set[tuple[str, int, int]] = set()  # (name, size, mtime) hashed in this process

    def __repr__(self) -> str:
        return f"LocalShardStore({str(self.folder)!r})"

    def _path(self, name: str) -> Path:
        return self.folder / PurePosixPath(name) if name else self.folder

    def describe(self, name: str = "") -> str:
        return str(self._path(name))

    def read_small(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except IsADirectoryError:
            raise DataError(f"{self._path(name)}: is a folder, expected a file") from None
        except OSError as e:
            raise DataError(f"{self._path(name)}: cannot read ({e.strerror or e})") from None

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def open_shard(
        self, name: str, size: int | None, whole: bool, *, sha256: str | None = None, etag: str | None = None
    ) -> LocalShardFile:
        file = LocalShardFile(self._path(name), size)  # the size is always checked
        if self.verify_sha256 and sha256 is not None and whole:
            try:
                self._check_sha256(file, name, sha256)
            except BaseException:
                file.close()
                raise
        return file

    def _check_sha256(self, file: LocalShardFile, name: str, sha256: str) -> None:
        """Hash the file (once per process while its size and modification time stay)
        against the manifest's SHA-256: one more read of the whole file."""
        mtime = os.stat(file.path).st_mtime_ns
        if (name, file.size, mtime) in self._verified:
            return
        digest = hashlib.sha256()
        offset = 0
        while offset < file.size:
            chunk = file.read(offset, min(_HASH_CHUNK, file.size - offset))
            digest.update(chunk)
            offset += len(chunk)
        if digest.hexdigest() != sha256.lower():
            from savable_loader.storage.store import integrity_mismatch

            raise integrity_mismatch(str(file.path), "sha256", sha256.lower(), digest.hexdigest())
        self._verified.add((name, file.size, mtime))

    def list_files(self) -> list[str]:
        if not self.folder.is_dir():
            raise DataError(f"{self.folder}: not a folder")
        out = []
        for root, dirs, files in os.walk(self.folder):
            dirs.sort()
            rel = Path(root).relative_to(self.folder)
            out += [(rel / f).as_posix() for f in files]
        return sorted(out)

    def stat(self, name: str) -> tuple[int, int]:
        st = self._path(name).stat()
        return st.st_size, st.st_mtime_ns

    def append_small(self, name: str, data: bytes) -> None:
        with open(self._path(name), "ab") as f:
            f.write(data)

    def remove_small(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def write_small(self, name: str, data: bytes) -> None:
        target = self._path(name)
        # created with mode 0o666 less the umask, as open() makes files (mkstemp's 0o600
        # left a folder's metadata.json unreadable to the other users of a shared folder)
        tmp = str(target.parent / f".{target.name}-{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def changed_since_indexed(name: str, found: int, indexed: int) -> DataError:
    """The :class:`~savable_loader.errors.DataError` of a shard whose size is not the one
    the folder's manifest records."""
    return DataError(
        f"{name}: the file has {found} bytes, the folder's manifest says {indexed} (the shard changed "
        f"after it was indexed: index the folder again, e.g. `python -m savable_loader index`)"
    )


def byte_getter(file: ShardFile) -> tuple[Callable[[int, int], bytes], HeldFile | None]:
    """``(get, held)``: ``get(offset, length)`` reads bytes of ``file``, through a
    :class:`~savable_loader.sources.shards.held_file.HeldFile` ``held`` when it has a local copy
    (close ``held`` when done), else with ``file.read``. Reads past the end come back
    short: callers check lengths. A file truncated while open is a DataError naming the
    offset (never a ``SIGBUS``: nothing is memory-mapped)."""
    path = file.local_path
    if path is None or file.size == 0:
        return file.read, None
    held = HeldFile(path, file.name, file.size)
    size = os.fstat(held.fd).st_size  # type: ignore[arg-type]  # just opened
    if size != file.size:
        held.close()
        if size < file.size:
            raise truncated(file.name, 0, size, file.size)
        raise DataError(f"{file.name}: the file has {size} bytes, expected {file.size} (it changed while open)")
    return held.get, held
