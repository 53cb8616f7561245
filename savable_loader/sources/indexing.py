"""Index a folder of shards where it is: ``metadata.json`` (version 2) and missing tar indexes.

``index_folder(folder)`` (and ``python -m savable_loader index FOLDER``) finds the
shards, reads what each one needs (sample counts, sizes, a tar's byte offsets, a Parquet
file's row groups), writes every missing ``<shard>.tar.idx`` (Energon's layout) next to
its tar and, last, ``metadata.json``. It never writes to a shard file.

Which shards, in which order:

* an existing ``metadata.json`` (version 1 or 2): its shards, in its order (re-indexing a
  version-1 folder keeps the epoch order, so its loader states stay valid). Delete it to
  pick up added files;
* else Energon's ``.nv-meta/.info.json``, or a MosaicML Streaming or LitData
  ``index.json``: their shards, in their order (existing ``.tar.idx`` files are reused);
* else every ``.tar``, ``.parquet``, ``.npy``, ``.pt`` and ``.jsonl`` file under the
  folder (hidden files and folders excepted), sorted by path.

``files=`` keeps some of them (a glob, a list of paths and globs, or a ``slice`` of that
order: ``slice(None, -1)`` is all but the last, as nanochat keeps its last file for
validation); the manifest then lists only those.

Shards are indexed in parallel (``workers`` threads; reading headers and footers is I/O
bound, and ``hashlib`` releases the GIL). Each finished shard is appended to a journal
(``.savable_loader-index.jsonl``), so a run that is killed resumes where it stopped:
the next run skips every shard whose size and modification time are unchanged. A tar
index is reused when it is newer than its tar and consistent with it (``force=True``
rebuilds them). Files are written atomically: a killed run never leaves a partial index
or manifest.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.sources.shards.folder import foreign_metadata
from savable_loader.sources.shards.manifest import (
    ENERGON_INFO,
    INDEX_JSON,
    METADATA_NAME,
    SUFFIX_FORMATS,
    FileChoice,
    Metadata,
    ShardEntry,
    SplitRequired,
    choose_files,
    encode_metadata,
    parse_metadata,
)
from savable_loader.sources.shards.parquet import row_groups
from savable_loader.sources.shards.readers import ReadOptions, reader_class
from savable_loader.sources.shards.remote import store_for
from savable_loader.sources.shards.store import ShardFile, ShardStore
from savable_loader.sources.shards.tar import TarIndexError, check_index, encode_index, scan_tar, tar_sample

if TYPE_CHECKING:
    from savable_loader.storage import Storage

__all__ = ["IndexProgress", "index_folder"]

JOURNAL = ".savable_loader-index.jsonl"
_CHUNK = 1 << 22


class _JournalLine(msgspec.Struct):
    path: str
    size: int
    stamp: int
    sha256: bool
    entry: ShardEntry


class IndexProgress:
    """A progress line on ``stream`` (stderr): shards and bytes done, rate, time left.

    On a terminal the line is redrawn in place (at most 10 times a second); otherwise a
    line is printed every 10 % of the shards. Example::

        index_folder("data/train", progress=IndexProgress(sys.stdout))
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = self.total_bytes = self.done = self.done_bytes = self.reused = 0
        self.started = time.monotonic()
        self._shown = 0.0
        self._decile = -1

    def start(self, shards: int, total_bytes: int, reused: int) -> None:
        """Called once, with the work ahead (``reused`` shards come from the journal)."""
        self.total, self.total_bytes, self.reused = shards, total_bytes, reused
        self.done = reused
        self.started = time.monotonic()
        self._show(force=True)

    def advance(self, nbytes: int) -> None:
        """Called after each shard indexed."""
        self.done += 1
        self.done_bytes += nbytes
        self._show(force=self.done == self.total)

    def finish(self) -> None:
        """Called at the end."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        decile = 10 * self.done // max(self.total, 1)
        if self.live and not force and now - self._shown < 0.1:
            return
        if not self.live and not force and decile == self._decile:
            return
        self._shown, self._decile = now, decile
        elapsed = now - self.started
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        left = (self.total_bytes - self.done_bytes) / rate if rate > 0 else 0.0
        text = (
            f"indexing: {self.done}/{self.total} shards, {_size(self.done_bytes)}/{_size(self.total_bytes)}"
            f" in {elapsed:.0f} s ({_size(rate)}/s)"
        )
        if self.done < self.total and rate > 0:
            text += f", about {left:.0f} s left"
        if self.reused:
            text += f"; {self.reused} from an earlier run"
        self.stream.write(("\r" + text + "\x1b[K") if self.live else text + "\n")
        self.stream.flush()


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _plan(store: ShardStore) -> tuple[list[ShardEntry], str, list[str]]:
    """The shards to index (entries with what is already known), where the list came from,
    and the files that were left out."""
    raw = store.read_small(METADATA_NAME)
    if raw is not None:
        meta = parse_metadata(raw, store.describe(METADATA_NAME))
        return (
            [
                ShardEntry(path=e.path, samples=e.samples, format=e.format, index=e.index, options=e.options)
                for e in meta.shards
            ],
            METADATA_NAME,
            [],
        )
    if store.read_small(ENERGON_INFO) is not None or store.read_small(INDEX_JSON) is not None:
        try:
            meta = foreign_metadata(store)
        except SplitRequired as e:
            raise DataError(
                f"{e}; an Energon folder needs no indexing: read it as it is, with "
                "ShardedFileDataset(folder, wc, split=...) (a metadata.json would hide its splits)"
            ) from None
        return meta.shards, meta.source, []
    entries, ignored = [], []
    for name in store.list_files():
        parts = PurePosixPath(name).parts
        fmt = SUFFIX_FORMATS.get(PurePosixPath(name).suffix)
        if any(p.startswith(".") for p in parts) or name == METADATA_NAME:
            continue
        if fmt is None:
            if not name.endswith(".idx"):
                ignored.append(name)
            continue
        entries.append(ShardEntry(path=name, samples=0, format=fmt))
    if not entries:
        raise DataError(f"{store.describe()}: no shard files (.tar, .parquet, .npy, .pt, .jsonl) to index")
    return entries, "files", ignored


def _sha256(file: ShardFile) -> str:
    digest = hashlib.sha256()
    if file.local_path is not None:
        with open(file.local_path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    else:
        for at in range(0, file.size, _CHUNK):
            digest.update(file.read(at, min(_CHUNK, file.size - at)))
    return digest.hexdigest()


def _index_tar(store: ShardStore, entry: ShardEntry, file: ShardFile, stamp: int, force: bool) -> int:
    name = entry.tar_index
    raw = None if force else store.read_small(name)
    if raw is not None and store.stat(name)[1] >= stamp:
        try:
            offsets = check_index(raw, file.size, None, store.describe(name))
            get = file.read
            for i in {0, len(offsets) - 2} if len(offsets) > 1 else ():  # spot checks: first and last sample
                tar_sample(get, offsets[i], offsets[i + 1], file.size, file.name)
            return len(offsets) - 1
        except TarIndexError:
            pass  # stale or foreign: rebuilt below
    scanned = scan_tar(file)
    store.write_small(name, encode_index(scanned))
    return len(scanned) - 1


def _index_one(store: ShardStore, entry: ShardEntry, size: int, stamp: int, sha256: bool, force: bool) -> ShardEntry:
    file = store.open_shard(entry.path, size, whole=True)
    try:
        out = ShardEntry(
            path=entry.path, samples=0, format=entry.format, size=file.size, etag=entry.etag, options=entry.options
        )
        if entry.format == "tar":
            out.index = entry.tar_index
            out.samples = _index_tar(store, out, file, stamp, force)
        elif entry.format == "parquet":
            out.row_groups = row_groups(file)
            out.samples = sum(out.row_groups)
        else:
            reader = reader_class(entry.format or "")(file, out, store, ReadOptions())
            out.samples = len(reader)
            if entry.format in ("mds", "litdata") and out.samples != entry.samples:
                raise DataError(
                    f"{file.name}: its index.json says {entry.samples} samples, the shard holds {out.samples}"
                )
        if sha256:
            out.sha256 = _sha256(file)
        return out
    finally:
        file.close()


def _journal(store: ShardStore) -> dict[str, _JournalLine]:
    raw = store.read_small(JOURNAL) or b""
    decoder = msgspec.json.Decoder(_JournalLine)
    out = {}
    for line in raw.split(b"\n"):
        try:
            item = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # a torn last line of a killed run, or an older layout
        out[item.path] = item
    return out


def index_folder(
    folder: str | os.PathLike[str] | ShardStore | Storage,
    *,
    storage_options: Mapping[str, Any] | None = None,
    workers: int = 8,
    sha256: bool = False,
    force: bool = False,
    progress: bool | IndexProgress = True,
    on_shard: Callable[[ShardEntry], Any] | None = None,
    files: FileChoice = None,
) -> Metadata:
    """Index ``folder`` (see the module docstring) and return the manifest it wrote.

    ``folder`` may be a URL (``s3://bucket/wds``, with ``storage_options``) or a
    :class:`~savable_loader.storage.Storage`: shards are downloaded through its cache,
    ``metadata.json`` and tar indexes are written beside them, the journal of an
    interrupted run is kept in the local cache folder. ``workers``: shards indexed at once. ``sha256``: record each shard's SHA-256 (reads
    every byte). ``force``: rebuild tar indexes and ignore the journal of an earlier run.
    ``progress``: a progress line on stderr (True), none (False), or an
    :class:`IndexProgress`. ``on_shard(entry)`` is called after each shard is journaled.
    ``files``: index only these (a glob, a list of paths and globs, or a slice of the
    files in order, ``slice(None, -1)`` for all but the last); ``metadata.json`` lists
    only them.

    Example::

        meta = index_folder("data/wds", workers=16)
        print(sum(s.samples for s in meta.shards), "samples")
        ds = ShardedFileDataset("data/wds", wc)
        index_folder("data/train", files=slice(None, -1))   # all files but the last
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise LoaderUsageError(f"index_folder workers must be an int >= 1, got {workers!r}")
    store = store_for(folder, storage_options)
    entries, _, _ = _plan(store)
    if files is not None:
        keep = choose_files([e.path for e in entries], files, f"index_folder({store.describe()!r}) files")
        entries = [entries[i] for i in keep]
    done = {} if force else _journal(store)
    if force:
        store.remove_small(JOURNAL)
    results: dict[str, ShardEntry] = {}
    todo: list[tuple[ShardEntry, int, int]] = []
    for entry in entries:
        try:
            size, stamp = store.stat(entry.path)
        except FileNotFoundError:
            raise DataError(f"{store.describe(entry.path)}: shard file does not exist") from None
        old = done.get(entry.path)
        if old is not None and (old.size, old.stamp) == (size, stamp) and (old.sha256 or not sha256):
            results[entry.path] = old.entry
        else:
            todo.append((entry, size, stamp))
    bar = progress if isinstance(progress, IndexProgress) else IndexProgress() if progress else None
    if bar is not None:
        bar.start(len(entries), sum(size for _, size, _ in todo), len(results))
    lock = threading.Lock()
    encoder = msgspec.json.Encoder()

    def run(entry: ShardEntry, size: int, stamp: int) -> None:
        out = _index_one(store, entry, size, stamp, sha256, force)
        line = encoder.encode(_JournalLine(entry.path, size, stamp, sha256, out)) + b"\n"
        with lock:
            store.append_small(JOURNAL, line)
            results[entry.path] = out
            if bar is not None:
                bar.advance(size)
            if on_shard is not None:
                on_shard(out)

    try:
        with ThreadPoolExecutor(max_workers=min(workers, max(len(todo), 1))) as pool:
            futures = [pool.submit(run, *job) for job in todo]
            try:
                for future in as_completed(futures):
                    future.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        if bar is not None:
            bar.finish()
    meta = Metadata(format=2, shards=[results[e.path] for e in entries])
    store.write_small(METADATA_NAME, encode_metadata(meta))
    store.remove_small(JOURNAL)
    return meta
