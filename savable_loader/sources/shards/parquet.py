"""Parquet shards (the optional ``pyarrow`` extra, imported only when a folder has one).

A sample is a dict of one row's values as Python objects (``str``, ``int``, ``float``,
``bytes``, lists, dicts, ``None``; what ``pyarrow``'s ``to_pylist`` gives). The unit a
shuffle permutes is the row group (``row_groups`` in ``metadata.json``): the reader
decodes one row group at a time, only the ``columns`` asked for, and keeps the last two
decoded (the one being iterated and one for ``restore_sample``), so memory holds at
most two row groups of Python objects per worker.

A local file is read by pyarrow from the file, not memory-mapped (a file cut while open
is a DataError naming it, never a ``SIGBUS``); without a local copy (``restore_sample``
on a remote store) the reader reads the footer and the row group's column chunks with
ranged reads.
"""

from __future__ import annotations

import bisect
import copy
import io
import os
from collections import OrderedDict
from typing import Any

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.sources.shards.held_file import HeldFile, truncated
from savable_loader.sources.shards.manifest import ShardEntry
from savable_loader.sources.shards.reader import ReadOptions, ShardReader
from savable_loader.sources.shards.store import ShardFile, ShardStore

__all__ = ["ParquetReader", "require_pyarrow", "row_groups"]

_CACHED_GROUPS = 2


def require_pyarrow(where: str) -> Any:
    """``pyarrow.parquet``, or a LoaderUsageError saying how to install it."""
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise LoaderUsageError(
            f"{where}: reading Parquet shards needs pyarrow: pip install 'savable-loader[parquet]'"
        ) from None
    return pq


class _RangeFile(io.RawIOBase):
    """A read-only file object over ``ShardFile.read`` (ranged reads), for pyarrow."""

    def __init__(self, file: ShardFile) -> None:
        self.file = file
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.file.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.file.size - self.pos))
        if n:
            buffer[:n] = self.file.read(self.pos, n)
            self.pos += n
        return n


def _open(file: ShardFile) -> Any:
    pq = require_pyarrow(file.name)
    try:
        if file.local_path is not None:
            return pq.ParquetFile(str(file.local_path), memory_map=False)  # read, not mapped: see HeldFile
        return pq.ParquetFile(_RangeFile(file))
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        cut = _cut_since_checked(file)
        if cut is not None:  # cut between the store's size check and pyarrow's read of the footer
            raise cut from None
        raise DataError(f"{file.name}: cannot read the Parquet file ({type(e).__name__}: {e})") from None


def _cut_since_checked(file: ShardFile) -> DataError | None:
    """The truncation error of a local shard now shorter than its checked size (pyarrow
    reads the footer, the last 8 bytes first, through the path), else None."""
    path, size = file.local_path, file.size
    if path is None or size is None:
        return None
    try:
        found = os.stat(path).st_size
    except OSError:
        return None
    return truncated(file.name, max(0, size - 8), found, size) if found < size else None


def row_groups(file: ShardFile) -> list[int]:
    """Rows per row group of a Parquet file (read from its footer only)."""
    meta = _open(file).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


class ParquetReader(ShardReader):
    """Rows of a Parquet file, decoded one row group at a time."""

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        self.parquet = _open(file)
        meta = self.parquet.metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        if entry.row_groups is not None and groups != entry.row_groups:
            raise DataError(
                f"{file.name}: the metadata says row groups of {_short(entry.row_groups)} rows, the file has "
                f"{_short(groups)} (it changed after it was indexed: index the folder again)"
            )
        names = list(self.parquet.schema_arrow.names)
        if options.columns is not None:
            missing = [c for c in options.columns if c not in names]
            if missing:
                raise DataError(f"{file.name}: no column {missing[0]!r} (columns: {names})")
            names = list(options.columns)
        self.names = names
        schema = self.parquet.schema_arrow
        # values of nested columns (lists, structs, maps) are mutable: each sample gets its own
        self.nested = [schema.field(name).type.num_fields > 0 for name in names]
        self.starts = [0]
        for n in groups:
            self.starts.append(self.starts[-1] + n)
        self._groups: OrderedDict[int, list[tuple[Any, ...]]] = OrderedDict()
        self.any_nested = any(self.nested)
        self._low = self._high = 0
        self._rows: list[tuple[Any, ...]] = []
        path = file.local_path  # a file truncated meanwhile is checked for before each row group
        self.watch = HeldFile(path, file.name, file.size) if path is not None else None

    def __len__(self) -> int:
        return self.starts[-1]

    def _group(self, g: int) -> list[tuple[Any, ...]]:
        """Row group ``g`` as one tuple of values per row: converted to Python a column at
        a time (``to_pylist``), then transposed once, so a read only builds its dict."""
        rows = self._groups.get(g)
        if rows is not None:
            self._groups.move_to_end(g)
            return rows
        group = self.parquet.metadata.row_group(g)
        if self.watch is not None:
            self.watch.check(group.column(0).data_page_offset if group.num_columns else 0)
        try:
            table = self.parquet.read_row_group(g, columns=self.names, use_threads=False)
            rows = list(zip(*(table.column(name).to_pylist() for name in self.names)))
        except Exception as e:  # noqa: BLE001
            if self.watch is not None:  # cut short during the read: say so
                self.watch.check(group.column(0).data_page_offset if group.num_columns else 0)
            raise DataError(f"{self.file.name}: cannot read row group {g} ({type(e).__name__}: {e})") from None
        self._groups[g] = rows
        while len(self._groups) > _CACHED_GROUPS:
            self._groups.popitem(last=False)
        return rows

    def read(self, i: int) -> dict[str, Any]:
        if not self._low <= i < self._high:  # another row group than the last read's
            g = bisect.bisect_right(self.starts, i) - 1
            self._rows = self._group(g)
            self._low, self._high = self.starts[g], self.starts[g + 1]
        row = self._rows[i - self._low]
        if self.any_nested:
            return {
                name: copy.deepcopy(value) if nested else value
                for name, value, nested in zip(self.names, row, self.nested)
            }
        return dict(zip(self.names, row))

    def close(self) -> None:
        self._groups.clear()
        self._rows = []
        self.parquet = None
        if self.watch is not None:
            self.watch.close()
        super().close()


def _short(values: list[int]) -> str:
    text = str(values)
    return text if len(text) <= 60 else text[:57] + "...]"
