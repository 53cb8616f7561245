"""What every shard reader is: random access to the samples of one open shard.

A reader sees its shard only through a :class:`~savable_loader.sources.shards.store.ShardFile`
and is built from the shard's manifest entry; ``readers.py`` holds one reader per format
and :func:`~savable_loader.sources.shards.readers.open_reader`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from savable_loader.errors import DataError
from savable_loader.sources.shards.manifest import ShardEntry
from savable_loader.sources.shards.store import ShardFile, ShardStore

__all__ = ["ReadOptions", "ShardReader"]


@dataclass(frozen=True)
class ReadOptions:
    """What a dataset asks of its readers: a projection and tar decoders."""

    columns: tuple[str, ...] | None = None
    decoders: Mapping[str, Callable[[bytes], Any]] | None = None
    #: a tar without its index file is scanned (``open_shard``) instead of refused
    scan_missing_index: bool = False


class ShardReader:
    """Random access to the samples of one open shard (see ``open_reader``)."""

    #: True if the reader needs the whole shard as a local file (``ShardFile.local_path``).
    needs_local_file: ClassVar[bool] = False
    path: Path | str

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        self.file = file
        self.path = file.local_path or file.name
        self.entry = entry
        self.options = options

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def read(self, i: int) -> Any:  # pragma: no cover - abstract
        """Sample ``i`` of the shard, a fresh object (never a view into the file)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the file."""
        self.file.close()

    def _local(self) -> Path:
        path = self.file.local_path
        if path is None:
            raise DataError(
                f"{self.file.name}: a {self.entry.format} shard is read from a local file, but the store gave none"
            )
        return path

    def project(self, sample: Any) -> Any:
        """``sample`` restricted to ``options.columns`` (dict samples only)."""
        columns = self.options.columns
        if columns is None:
            return sample
        if not isinstance(sample, dict):
            raise DataError(
                f"{self.path}: columns={list(columns)} needs dict samples, "
                f"this shard holds {type(sample).__name__} samples"
            )
        missing = [c for c in columns if c not in sample]
        if missing:
            raise DataError(f"{self.path}: no field {missing[0]!r} (fields: {sorted(sample)})")
        return {c: sample[c] for c in columns}
