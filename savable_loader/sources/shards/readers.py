"""Shard readers: one class per format behind one interface, and ``write_shards``.

A reader gives random access to the samples of one shard: ``len(reader)`` and
``reader.read(i)``. It sees the shard only through a
:class:`~savable_loader.sources.shards.store.ShardFile` (the storage seam, see ``sources/shards/store.py``),
and is built by :func:`open_reader` from the shard's manifest entry (``sources/shards/manifest.py``).

* ``npy``: a NumPy array (not an object array); sample ``i`` is row ``i``
  (``array[i]``) read from the file into a ``torch.Tensor``.
* ``pt``: a file written by ``torch.save`` holding a tensor or a dict of tensors with
  a common first dimension, opened with ``weights_only=True`` and ``mmap=True`` (which
  reads no data); sample ``i`` is ``tensor[i]`` (or ``{name: tensor[i]}``) read from the
  file into a tensor of its own (``sources/shards/pt_layout.py`` finds where each tensor lies).
* ``jsonl``: one JSON value per line (UTF-8, ``\\n`` separated, a final newline
  optional), each decoded with msgspec when it is read.
* ``tar`` (``sources/shards/tar.py``), ``parquet`` (``sources/shards/parquet.py``), ``mds`` (``sources/shards/mds.py``),
  ``litdata`` (``sources/shards/litdata.py``): dicts, see those modules.

Local rows and bytes are read with ``pread`` (``sources/shards/held_file.py``), never through a memory
map: a shard cut while open is a DataError naming it and the offset, never a
``SIGBUS``. Rows that do not lie contiguously in the file (a Fortran-order array, a
transposed tensor) are read into memory once when the shard is opened.

``columns`` keeps only some fields of dict samples (tar extensions, Parquet columns,
MDS / LitData fields, the tensors of a ``.pt`` dict, the keys of JSON objects);
``decoders`` decodes tar members by extension (``decoders.py``). Every problem with the
data is a :class:`~savable_loader.errors.DataError` naming the file (and the field, line
or byte offset). ``write_shards`` writes a folder of ``npy`` / ``pt`` / ``jsonl`` shards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from savable_loader.errors import DataError
from savable_loader.sources.shards.held_file import FileRows, HeldFile, truncated
from savable_loader.sources.shards.litdata import LitDataReader
from savable_loader.sources.shards.manifest import (
    METADATA_NAME,
    SUFFIX_FORMATS,
    V1_SUFFIXES,
    Metadata,
    ShardEntry,
    encode_metadata,
)
from savable_loader.sources.shards.mds import MdsReader
from savable_loader.sources.shards.parquet import ParquetReader
from savable_loader.sources.shards.pt_layout import storage_offsets
from savable_loader.sources.shards.reader import ReadOptions, ShardReader
from savable_loader.sources.shards.store import LocalShardStore, ShardFile, ShardStore, changed_since_indexed
from savable_loader.sources.shards.tar import TarReader

__all__ = ["ReadOptions", "ShardReader", "open_reader", "open_shard", "reader_class", "write_shards"]

METADATA_VERSION = 1
FORMATS = V1_SUFFIXES  # what write_shards writes


class _NpyReader(ShardReader):
    needs_local_file = True

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        path = self.path = self._local()
        if options.columns is not None:
            raise DataError(f"{path}: columns= selects fields of dict samples; an .npy shard holds rows")
        try:  # the header only: a memory map that is never read, the rows are read with pread
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any failure means an unreadable file
            _check_not_cut(path, file.size, entry.size)
            raise DataError(f"{path}: cannot read the .npy shard ({type(e).__name__}: {e})") from None
        if not isinstance(array, np.ndarray) or array.ndim == 0:
            raise DataError(f"{path}: a .npy shard must hold an array with at least one dimension")
        try:
            dtype = torch.from_numpy(np.zeros(0, dtype=array.dtype)).dtype
        except (TypeError, ValueError):  # (ValueError: another byte order than this machine's)
            raise DataError(f"{path}: dtype {array.dtype.str} ({array.dtype}) cannot become a torch.Tensor") from None
        self.length = int(array.shape[0])
        self.held = HeldFile(path, str(path))
        offset = int(getattr(array, "offset", 0))
        self.whole: np.ndarray | None = None
        self.rows: FileRows | None = None
        if array.flags.c_contiguous:
            self.rows = FileRows(self.held, offset, int(array.strides[0]), tuple(array.shape[1:]), dtype)
        else:  # Fortran order: a row is not contiguous in the file; read the array once
            whole = np.empty(array.shape, array.dtype, order="F")
            self.held.readinto(offset, whole.T.reshape(-1).view(np.uint8))
            self.whole = whole

    def __len__(self) -> int:
        return self.length

    def read(self, i: int) -> torch.Tensor:
        if self.rows is not None:
            return self.rows.read(i)
        return torch.from_numpy(np.array(self.whole[i]))  # type: ignore[index]  # set when rows is None

    def close(self) -> None:
        self.whole = self.rows = None
        self.held.close()
        super().close()


class _PtReader(ShardReader):
    needs_local_file = True

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        path = self.path = self._local()
        try:  # (mmap=True reads no data: the tensors give their layout, the rows are read with pread)
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001
            _check_not_cut(path, file.size, entry.size)
            raise DataError(
                f"{path}: cannot read the .pt shard ({type(e).__name__}: {str(e).splitlines()[0]})"
            ) from None
        if isinstance(data, torch.Tensor):
            tensors = {"": data}
        elif isinstance(data, dict) and data and all(isinstance(k, str) for k in data):
            tensors = data
        else:
            raise DataError(f"{path}: a .pt shard must hold a tensor or a dict of tensors, got {type(data).__name__}")
        lengths = set()
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise DataError(f"{path}: entry {name!r} is not a tensor with at least one dimension")
            lengths.add(t.shape[0])
        if len(lengths) != 1:
            sizes = {k: int(v.shape[0]) for k, v in tensors.items()}
            raise DataError(f"{path}: the tensors of a .pt shard must have a common first dimension, got {sizes}")
        if options.columns is not None:
            if isinstance(data, torch.Tensor):
                raise DataError(f"{path}: columns= selects fields of dict samples; this .pt shard holds one tensor")
            missing = [c for c in options.columns if c not in tensors]
            if missing:
                raise DataError(f"{path}: no field {missing[0]!r} (fields: {sorted(tensors)})")
            tensors = {c: tensors[c] for c in options.columns}
        self.single = isinstance(data, torch.Tensor)
        self.length = int(lengths.pop())
        self.held = HeldFile(path, str(path))
        self.rows = self._rows(path, tensors)

    def _rows(self, path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, FileRows | torch.Tensor]:
        """Per tensor, a :class:`FileRows` reading its rows from the file, or the tensor
        in memory (rows not contiguous in the file, or a layout not found)."""
        offsets = storage_offsets(path, [t.untyped_storage() for t in tensors.values()])
        if offsets is None:  # read the whole file (not mapped): never a row from a map
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - cut or rewritten since it was opened
                _check_not_cut(path, self.held.size, self.entry.size)
                raise DataError(f"{path}: cannot read the .pt shard ({type(e).__name__}: {e})") from None
            return {k: (loaded if self.single else loaded[k]) for k in tensors}
        rows: dict[str, FileRows | torch.Tensor] = {}
        for (name, t), at in zip(tensors.items(), offsets):
            size = t.element_size()
            if self.length == 0 or t[0].is_contiguous():
                first = at + int(t.storage_offset()) * size
                rows[name] = FileRows(self.held, first, int(t.stride(0)) * size, tuple(t.shape[1:]), t.dtype)
            else:  # rows not contiguous: read the tensor's storage once
                storage = np.empty(t.untyped_storage().nbytes(), np.uint8)
                self.held.readinto(at, storage)
                memory = torch.from_numpy(storage).view(t.dtype) if storage.size else torch.empty(0, dtype=t.dtype)
                rows[name] = memory.as_strided(t.shape, t.stride(), t.storage_offset())
        return rows

    def __len__(self) -> int:
        return self.length

    def read(self, i: int) -> Any:
        if self.single:
            return _row(self.rows[""], i)
        return {k: _row(v, i) for k, v in self.rows.items()}

    def close(self) -> None:
        self.rows = {}
        self.held.close()
        super().close()


def _row(rows: FileRows | torch.Tensor, i: int) -> torch.Tensor:
    return rows.read(i) if isinstance(rows, FileRows) else rows[i].clone()


def _check_not_cut(path: Path, size: int, indexed: int | None) -> None:
    """DataError if the file at ``path`` is now shorter than the ``size`` it had when it
    was opened (cut while this reader opened it), or is not the size the folder's
    manifest records (``indexed``; cut before it was opened, in the moment between the
    store's look and the reader's own open), or is empty."""
    try:
        found = os.stat(path).st_size
    except OSError:
        return
    if found < size:
        raise truncated(str(path), 0, found, size)
    if indexed is not None and found != indexed:
        raise changed_since_indexed(str(path), found, indexed)
    if found == 0:  # (a manifest without sizes: written by write_shards) never a whole shard
        raise DataError(
            f"{path}: the file has 0 bytes (something cut or is rewriting it); restore the file, then resume "
            "from the last saved state"
        )


class _JsonlReader(ShardReader):
    needs_local_file = True

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        path = self.path = self._local()
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read the .jsonl shard ({e.strerror or e})") from None
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        self.lines = lines
        self.decoder = msgspec.json.Decoder()

    def __len__(self) -> int:
        return len(self.lines)

    def read(self, i: int) -> Any:
        try:
            value = self.decoder.decode(self.lines[i])
        except msgspec.DecodeError as e:
            raise DataError(f"{self.path}: line {i + 1} is not valid JSON ({e})") from None
        return self.project(value)

    def close(self) -> None:
        self.__dict__.pop("lines", None)
        super().close()


_READERS: dict[str, type[ShardReader]] = {
    "npy": _NpyReader,
    "pt": _PtReader,
    "jsonl": _JsonlReader,
    "tar": TarReader,
    "parquet": ParquetReader,
    "mds": MdsReader,
    "litdata": LitDataReader,
}


def reader_class(fmt: str) -> type[ShardReader]:
    """The reader class of a format (the optional libraries a format needs, pyarrow or
    Pillow, are imported by its reader when it first reads)."""
    return _READERS[fmt]


def open_reader(store: ShardStore, entry: ShardEntry, whole: bool, options: ReadOptions = ReadOptions()) -> ShardReader:
    """Open the shard ``entry`` of ``store``; its length must agree with the metadata.

    ``whole``: the caller will read most of the shard (iteration); False for a few samples
    (``restore_sample``). See ``sources/shards/store.py``.
    """
    if entry.format is None:  # pragma: no cover - the metadata parser sets it
        raise DataError(f"{store.describe(entry.path)}: no format")
    cls = reader_class(entry.format)
    file = store.open_shard(entry.path, entry.size, whole or cls.needs_local_file, sha256=entry.sha256, etag=entry.etag)
    try:
        reader = cls(file, entry, store, options)
    except BaseException:
        file.close()
        raise
    if len(reader) != entry.samples:
        found = len(reader)
        reader.close()
        raise DataError(f"{reader.path}: the metadata says {entry.samples} samples, the shard holds {found}")
    return reader


def open_shard(
    path: str | os.PathLike[str],
    expected: int | None = None,
    *,
    columns: Sequence[str] | None = None,
    decode: Mapping[str, Callable[[bytes], Any]] | None = None,
) -> ShardReader:
    """Open one shard file by its suffix (``.npy``, ``.pt``, ``.jsonl``, ``.tar``,
    ``.parquet``); with ``expected``, its length must agree with it. A tar uses the index
    ``<path>.idx`` if there is one, else scans the tar.

    Example::

        reader = open_shard("data/train/shard-00000.npy", expected=100)
        first = reader.read(0)
    """
    path = Path(path)
    fmt = SUFFIX_FORMATS.get(path.suffix)
    if fmt is None:
        raise DataError(f"{path}: unknown shard format {path.suffix!r}; expected one of {', '.join(SUFFIX_FORMATS)}")
    if not path.is_file():
        raise DataError(f"{path}: shard file does not exist")
    store = LocalShardStore(path.parent)
    entry = ShardEntry(path=path.name, samples=0, format=fmt)
    cls = reader_class(fmt)
    file = store.open_shard(entry.path, None, True)
    try:
        options = ReadOptions(tuple(columns) if columns is not None else None, decode, scan_missing_index=True)
        reader = cls(file, entry, store, options)
    except BaseException:
        file.close()
        raise
    if expected is not None and len(reader) != expected:
        found = len(reader)
        reader.close()
        raise DataError(f"{path}: the metadata says {expected} samples, the shard holds {found}")
    return reader


def _shard_length(shard: Any, fmt: str) -> int:
    if fmt == ".jsonl":
        return len(shard)
    if isinstance(shard, dict):
        return int(next(iter(shard.values())).shape[0]) if shard else 0
    return int(shard.shape[0])


def write_shards(
    folder: str | os.PathLike[str],
    shards: Sequence[Any],
    *,
    fmt: str = ".npy",
    prefix: str = "shard",
) -> Path:
    """Write ``shards`` as a shard folder and return the path of its ``metadata.json``.

    Each element of ``shards`` is one shard: a NumPy array (``fmt=".npy"``), a tensor or
    a dict of tensors with a common first dimension (``".pt"``), or a list of
    JSON-encodable values (``".jsonl"``). Files are named ``{prefix}-00000{fmt}``, ...;
    the metadata is written last, atomically.

    Example::

        write_shards("data/train", [np.arange(100).reshape(50, 2), np.arange(40).reshape(20, 2)])
        ds = ShardedFileDataset("data/train", worker_config=wc)
    """
    if fmt not in FORMATS:
        raise DataError(f"write_shards: fmt is {fmt!r}; expected one of {', '.join(FORMATS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    encoder = msgspec.json.Encoder()
    for i, shard in enumerate(shards):
        name = f"{prefix}-{i:05d}{fmt}"
        path = folder / name
        if fmt == ".npy":
            np.save(path, np.asarray(shard), allow_pickle=False)
        elif fmt == ".pt":
            torch.save(shard, path)
        else:
            with open(path, "wb") as f:
                for value in shard:
                    f.write(encoder.encode(value))
                    f.write(b"\n")
        entries.append(ShardEntry(path=name, samples=_shard_length(shard, fmt)))
    target = folder / METADATA_NAME
    LocalShardStore(folder).write_small(
        METADATA_NAME, encode_metadata(Metadata(format=METADATA_VERSION, shards=entries))
    )
    return target
