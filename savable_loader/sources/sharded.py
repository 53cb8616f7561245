"""ShardedFileDataset: samples from a folder of shard files, split over ranks and workers.

The folder's manifest (``metadata.json``, or the manifest of Energon, MosaicML Streaming
or LitData) is described in ``sources/shards/manifest.py``; the formats (``npy``, ``pt``, ``jsonl``,
WebDataset ``tar``, ``parquet``, ``mds``, ``litdata``) in ``sources/shards/readers.py`` and the
modules it names. ``write_shards`` writes a folder, ``index_folder`` indexes one.

How an epoch is laid out (the same computation on every rank and worker):

1. The epoch key is ``(epoch, *repetitions)``: the loader epoch and, inside a
   ``RepeatDataset``, the pass numbers, so every pass is shuffled anew.
2. The folder is cut into units: each row group of a Parquet file is one unit, every
   other shard is one unit (unit ``u`` is shard ``u`` in a folder without Parquet files).
   With ``shuffle`` the unit order is a permutation drawn from ``(seed, epoch key)``,
   and the samples inside unit ``u`` are a permutation drawn from
   ``(seed, epoch key, u)``; without it both are the metadata order.
3. The units, in that order, form the epoch's global sequence of ``N`` samples. Rank
   ``r`` of ``W`` takes the contiguous range ``[r * L, (r + 1) * L)`` of it, where ``L``
   (the same on every rank, so collective training cannot deadlock) depends on the
   strategy:

   * ``"exact"``: ``L = N / W``; every sample is read exactly once per epoch. If ``W``
     does not divide ``N`` the dataset refuses to be built, naming the ranks and the
     files they would read.
   * ``"oversampling"``: ``L = ceil(N / W)``; the sequence wraps around to its start to
     fill the last rank (as ``torch.utils.data.DistributedSampler`` pads), so up to
     ``W - 1`` samples are read twice in an epoch.
   * ``"undersampling"``: ``L = floor(N / W)``; the last ``N mod W`` samples of the
     epoch's sequence are skipped (different ones every epoch when shuffled).

4. A rank's range is cut into contiguous pieces for its workers: worker ``w`` of ``K``
   gets ``L // K`` samples, one more if ``w < L % K``.

A worker therefore opens only the shards its piece touches, one after another; it keeps
at most two open (the current one and, for ``restore_sample``, one more). Samples from
one unit come out together (shuffled inside the unit): put a ``ShuffleBufferDataset``
after the source to mix units.

Storage: the dataset reads the folder only through a ``ShardStore`` (``sources/shards/store.py``; a
URL or a ``Storage`` becomes a ``StorageShardStore``, ``sources/shards/remote.py``): iteration
opens a shard with ``whole=True`` (a remote store hands over a local copy),
``restore_sample`` with ``whole=False`` (a few ranged reads). Each time iteration moves
to another shard it names the next ``prefetch_depth`` shards of its reading order
(``upcoming_shards``) to the store, which downloads them in the background. The reading
order runs on past the end of the pass: the next pass's layout is a pure function of its
key (the next ``RepeatDataset`` pass, or the next loader epoch), so its first shards are
downloaded while the last ones of this pass are read. (At the very end of training that
is up to ``prefetch_depth`` shards downloaded for nothing.)

State: the epoch key and ``position``, the number of samples this worker has read in
the epoch. The shard and the offset inside it follow from the position by a binary
search, so a restore seeks straight to it: its cost does not grow with the position.

Restore key of a sample: ``[shard, index, lap]``: the shard's index in the metadata,
the row in the shard, and ``lap`` (1 for the samples oversampling reads a second time,
so their random draws differ from the first time; 0 otherwise).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from savable_loader.config import WorkerConfig, active_repetition_limits, active_repetitions
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import DataError, LoaderUsageError, RestoreKeyError
from savable_loader.rng.formulas import shard_order_seed, shard_samples_seed
from savable_loader.sources.decoders import DEFAULT_DECODERS
from savable_loader.sources.shards.folder import load_metadata
from savable_loader.sources.shards.manifest import (
    FileChoice,
    Metadata,
    choose_files,
    files_config,
    order_digest_input,
    units_of,
)
from savable_loader.sources.shards.parquet import require_pyarrow
from savable_loader.sources.shards.readers import ReadOptions, ShardReader, open_reader
from savable_loader.sources.shards.remote import store_for
from savable_loader.sources.shards.store import LocalShardStore, ShardStore

if TYPE_CHECKING:
    from savable_loader.storage import Storage

__all__ = ["RANK_LAYOUTS", "STRATEGIES", "ShardedFileDataset"]

STRATEGIES = ("exact", "oversampling", "undersampling")
RANK_LAYOUTS = ("contiguous", "strided")
_MAX_OPEN = 2


class _Layout:
    """One epoch's unit order and where each unit starts in the sequence ranks split:
    the global one (``rank is None``), or rank ``rank``'s units ``[rank::world]`` of the
    global order (the ``"strided"`` rank layout); ``rank_totals``: each rank's samples in
    such a view."""

    def __init__(
        self,
        counts: np.ndarray,
        seed: int,
        key: tuple[int, ...],
        shuffle: bool,
        rank: int | None = None,
        world: int = 1,
    ) -> None:
        self.seed, self.key, self.shuffle = seed, key, shuffle
        if shuffle:
            rng = np.random.Generator(np.random.PCG64(shard_order_seed(seed, tuple(key))))
            order = rng.permutation(len(counts))
        else:
            order = np.arange(len(counts))
        self.rank_totals = [int(counts[order[r::world]].sum()) for r in range(world)] if rank is not None else []
        self.order = order if rank is None else order[rank::world]
        self.starts = np.concatenate([[0], np.cumsum(counts[self.order])]).astype(np.int64)
        self.total = int(self.starts[-1])

    def locate(self, q: int) -> tuple[int, int]:
        """``(position in the unit order, offset in that unit)`` of global position ``q``."""
        j = int(np.searchsorted(self.starts, q, side="right")) - 1
        return j, q - int(self.starts[j])

    def sample_order(self, unit: int, count: int) -> np.ndarray:
        """The order in which the rows of ``unit`` are read in this epoch."""
        if not self.shuffle:
            return np.arange(count)
        rng = np.random.Generator(np.random.PCG64(shard_samples_seed(self.seed, tuple(self.key), unit)))
        return rng.permutation(count)


class ShardedFileDataset(SavableDataset):
    """Samples of a shard folder, split over ranks and workers, reshuffled every epoch.

    ``folder`` is a local folder or a URL (``s3://``, ``gs://``, ``az://``, ``hf://``,
    ``http(s)://``, ``memory://``: any fsspec URL, reached with ``storage_options``), or
    a :class:`~savable_loader.storage.Storage` (to set the cache folder and budget, the
    prefetch depth, the retry policy), with a ``metadata.json`` (``write_shards``,
    ``index_folder``), or a folder prepared by Megatron-Energon, MosaicML Streaming (MDS)
    or LitData, read unchanged. A remote shard is downloaded whole into the node's cache
    before it is read, and each worker downloads the next shards of its exact reading
    order in the background (``docs/storage.md``); nothing of it enters a state.

    ``strategy`` says how ranks get equal sample counts (``"exact"``, ``"oversampling"``,
    ``"undersampling"``; see the module docstring for the layout). Samples are
    ``torch.Tensor`` rows (``.npy``, ``.pt``), dicts of tensor rows (``.pt`` holding a
    dict), decoded JSON values (``.jsonl``), ``{"__key__": ..., "<ext>": bytes}`` dicts
    (WebDataset tars) or dicts of a row's values (Parquet, MDS, LitData). ``columns``
    keeps only those fields (Parquet reads only those columns); ``decode`` decodes tar
    members: ``True`` for :data:`~savable_loader.sources.decoders.DEFAULT_DECODERS`, or
    a mapping from extension to decoder. ``split`` chooses a part (``"train"``) of an
    Energon dataset whose ``.nv-meta/split.yaml`` has several.

    ``rank_layout``: how ranks split an epoch: ``"contiguous"`` ranges of its samples
    (step 3 of the module docstring), or ``"strided"``: rank ``r`` of ``W`` reads the
    units ``r, r + W, r + 2W, ...`` of the epoch's unit order (nanochat's layout), its
    workers contiguous pieces of them; every rank reads as many samples as the smallest
    (``"undersampling"``), the largest (``"oversampling"``, wrapping around its own
    units) or, with ``"exact"``, all must hold the same. ``files`` chooses which of
    the manifest's files are read: a glob, a list of paths and globs, or a ``slice`` of
    them in order (``slice(None, -1)``: all but the last, as a folder whose last file is
    for validation needs). Both are recorded in the config when not the default.

    Missing or malformed metadata raises :class:`~savable_loader.errors.DataError` here;
    a shard that is unreadable, truncated, of another size than the metadata says, or
    whose length disagrees with it raises it when the shard is first opened.

    ``samples_read`` and ``shards_opened`` count reads and opens in this process (for
    monitoring; they are not state).

    Example::

        write_shards("data/train", [np.zeros((100, 16), np.float32)] * 8)
        wc = WorkerConfig(num_workers=4, seed=0)
        ds = ShardedFileDataset("data/train", wc, strategy="undersampling")
        loader = SavableDataLoader(BatchDataset(ds, 32), batch_size=None, worker_config=wc)

        index_folder("data/wds")   # WebDataset tars, indexed where they are
        ds = ShardedFileDataset("data/wds", wc, decode=True, columns=["jpg", "cls"])

        ds = ShardedFileDataset("data/pretrain", wc, files=slice(None, -1), rank_layout="strided")
        ds = ShardedFileDataset("s3://bucket/wds", wc, storage_options={"profile": "training"})
        ds = ShardedFileDataset(Storage("s3://bucket/wds", cache_dir="/local/cache", prefetch=4), wc)
    """

    _savable_fields = ("epoch", "position")

    def __init__(
        self,
        folder: str | os.PathLike[str] | ShardStore | Storage,
        worker_config: WorkerConfig,
        *,
        strategy: str = "exact",
        shuffle: bool = True,
        columns: Sequence[str] | None = None,
        decode: bool | Mapping[str, Callable[[bytes], Any]] | None = None,
        split: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        rank_layout: str = "contiguous",
        files: FileChoice = None,
    ) -> None:
        super().__init__(worker_config)
        if strategy not in STRATEGIES:
            raise LoaderUsageError(f"ShardedFileDataset strategy must be one of {STRATEGIES}, got {strategy!r}")
        if rank_layout not in RANK_LAYOUTS:
            raise LoaderUsageError(f"ShardedFileDataset rank_layout must be one of {RANK_LAYOUTS}, got {rank_layout!r}")
        self.rank_layout = rank_layout
        if not isinstance(shuffle, bool):
            raise LoaderUsageError(f"ShardedFileDataset shuffle must be a bool, got {shuffle!r}")
        self.store: ShardStore = store_for(folder, storage_options)
        self.folder: Path | None = self.store.folder if isinstance(self.store, LocalShardStore) else None
        self.strategy = strategy
        self.shuffle = shuffle
        self.columns = _check_columns(columns)
        self.decode = decode
        self.options = ReadOptions(self.columns, _decoders(decode))
        if split is not None and not isinstance(split, str):
            raise LoaderUsageError(f"ShardedFileDataset split must be a str, got {split!r}")
        self.split = split
        self.metadata: Metadata = load_metadata(self.store, split=split)
        self.files = files
        if files is None and split is None:
            _warn_held_out(self.metadata, self.store.describe())
        if files is not None:
            paths = [s.path for s in self.metadata.shards]
            keep = choose_files(paths, files, f"ShardedFileDataset({self.store.describe()!r}) files")
            self.metadata = msgspec.structs.replace(self.metadata, shards=[self.metadata.shards[i] for i in keep])
        self.counts = np.array([s.samples for s in self.metadata.shards], dtype=np.int64)
        self.total = int(self.counts.sum())
        self.digest = hashlib.blake2b(
            msgspec.json.encode(order_digest_input(self.metadata)), digest_size=12
        ).hexdigest()
        unit_shard, unit_first, unit_count = [], [], []
        for i, entry in enumerate(self.metadata.shards):
            first = 0
            for n in units_of(entry):
                unit_shard.append(i)
                unit_first.append(first)
                unit_count.append(n)
                first += n
        self.unit_shard = np.array(unit_shard, dtype=np.int64)
        self.unit_first = np.array(unit_first, dtype=np.int64)
        self.unit_count = np.array(unit_count, dtype=np.int64)
        if any(e.format == "parquet" for e in self.metadata.shards):
            require_pyarrow(self.store.describe())
        world = worker_config.world_size
        if rank_layout == "strided":
            self._check_strided()
        elif strategy == "exact" and self.total % world:
            raise DataError(self._uneven_message())
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._whole: set[int] = set()
        self._layout: _Layout | None = None
        self._next_layout: _Layout | None = None
        self.samples_read = 0
        self.shards_opened = 0
        self.reset_state_own()

    # -- layout -----------------------------------------------------------------------

    def rank_length(self, layout: _Layout | None = None) -> int:
        """Samples every rank reads per epoch (with the ``"strided"`` rank layout, in the
        epoch of ``layout``, by default the current one)."""
        world = self.worker_config.world_size
        if self.rank_layout == "strided":
            totals = (layout or self._get_layout(tuple(self.epoch))).rank_totals
            return max(totals) if self.strategy == "oversampling" else min(totals)
        if self.strategy == "oversampling":
            return math.ceil(self.total / world)
        return self.total // world

    def worker_range(self, worker: int | None = None, layout: _Layout | None = None) -> tuple[int, int]:
        """``[start, end)`` of a worker's piece in the epoch's sequence (default: the
        calling worker): the global sequence, or the rank's own with the ``"strided"``
        rank layout; positions past its total wrap around."""
        wc = self.worker_config
        w = wc.rank_worker_id() if worker is None else worker
        k = wc.workers_per_rank
        length = self.rank_length(layout)
        base, extra = divmod(length, k)
        start = (0 if self.rank_layout == "strided" else wc.rank * length) + w * base + min(w, extra)
        return start, start + base + (1 if w < extra else 0)

    def _new_layout(self, key: tuple[int, ...]) -> _Layout:
        wc = self.worker_config
        if self.rank_layout == "strided":
            return _Layout(self.unit_count, wc.seed, key, self.shuffle, wc.rank, wc.world_size)
        return _Layout(self.unit_count, wc.seed, key, self.shuffle)

    def _check_strided(self) -> None:
        """Every rank has units, and with ``"exact"`` every epoch splits evenly."""
        world, units = self.worker_config.world_size, len(self.unit_count)
        where = f"ShardedFileDataset({self.store.describe()!r}) with rank_layout='strided'"
        if units < world:
            raise DataError(
                f"{where}: {units} units (row groups of Parquet files, other shards) for world_size={world} "
                f"ranks: expected at least {world}, one per rank (or use rank_layout='contiguous')"
            )
        if self.strategy != "exact":
            return
        totals = _Layout(self.unit_count, self.worker_config.seed, (0,), self.shuffle, 0, world).rank_totals
        even = len(set(totals)) == 1
        if self.shuffle:  # every epoch deals other units: even only if all are alike
            even = len(set(self.unit_count.tolist())) == 1 and units % world == 0
        if not even:
            shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(totals[:8]))
            raise DataError(
                f"{where} and strategy='exact': the ranks' units do not hold equal sample counts"
                f"{' in every epoch' if self.shuffle else ''} (epoch 0: {shown}{', ...' if world > 8 else ''}). "
                "Use strategy='undersampling' (every rank reads as many as the smallest) or 'oversampling' "
                "(as many as the largest, wrapping around its units)"
            )

    def _get_layout(self, key: tuple[int, ...]) -> _Layout:
        if self._layout is not None and self._layout.key == key:
            return self._layout
        if self._next_layout is not None and self._next_layout.key == key:  # the pass we prefetched for began
            self._layout, self._next_layout = self._next_layout, self._layout
            return self._layout
        self._layout = self._new_layout(key)
        return self._layout

    def _next_pass(self) -> tuple[int, ...]:
        """The layout key of the pass after this one. The innermost ``RepeatDataset`` with
        a pass left resets the source for its next pass inside the repetitions around it:
        key ``(epoch, *outer passes, its pass + 1)``; with none left, the next loader epoch
        resets it outside them: ``(epoch + 1,)``."""
        reps, limits = active_repetitions(), active_repetition_limits()
        epoch = self.epoch[0]
        for i in reversed(range(len(reps))):
            limit = limits[i]
            if limit is None or reps[i] + 1 < limit:
                return (epoch, *reps[:i], reps[i] + 1)
        return (epoch + 1,)

    def upcoming_shards(self, limit: int, worker: int | None = None) -> list[int]:
        """The next ``limit`` distinct shards (metadata indices, in reading order) the
        calling worker (or ``worker``) reads from its current position: the rest of this
        pass, then the first shards of the next pass (the next ``RepeatDataset`` pass or
        loader epoch, whose layout is known in advance): what a store that prefetches
        downloads next. Call it in the worker."""
        start, end = self.worker_range(worker)
        if start >= end or self.total == 0 or limit <= 0:
            return []
        out: list[int] = []
        key = tuple(self.epoch)
        p = start + self.position
        for _ in range(2):  # this pass, then the next one from its start
            layout = self._get_layout(key) if key == tuple(self.epoch) else self._pass_layout(key)
            if key != tuple(self.epoch) and self.rank_layout == "strided":
                start, end = self.worker_range(worker, layout)
                p = start
            while p < end and len(out) < limit:
                q = p % layout.total
                j, offset = layout.locate(q)
                unit = int(layout.order[j])
                shard = int(self.unit_shard[unit])
                if shard not in out:
                    out.append(shard)
                p += int(self.unit_count[unit]) - offset
            if len(out) >= limit:
                break
            key, p = self._next_pass(), start
        return out

    def _pass_layout(self, key: tuple[int, ...]) -> _Layout:
        """The layout of another pass (kept beside the current one: a prefetch asks for it
        again at every shard of the pass's end)."""
        if self._next_layout is None or self._next_layout.key != key:
            self._next_layout = self._new_layout(key)
        return self._next_layout

    def _uneven_message(self) -> str:
        world, total = self.worker_config.world_size, self.total
        layout = _Layout(self.unit_count, self.worker_config.seed, (0,), self.shuffle)
        base, extra = divmod(total, world)
        parts, start = [], 0
        for r in range(min(world, 8)):
            n = base + (1 if r < extra else 0)
            j0, _ = layout.locate(start) if n else (0, 0)
            j1, _ = layout.locate(start + n - 1) if n else (-1, 0)
            files = list(
                dict.fromkeys(
                    self.metadata.shards[int(self.unit_shard[layout.order[j]])].path
                    for j in range(j0, j1 + 1)
                    if self.unit_count[layout.order[j]]
                )
            )
            shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
            parts.append(f"rank {r} would read {n} samples (from {shown or 'no file'})")
            start += n
        if world > 8:
            parts.append(f"... ({world - 8} more ranks)")
        return (
            f"ShardedFileDataset({self.store.describe()!r}): {total} samples in {len(self.counts)} shards do not split "
            f"evenly over world_size={world} ranks with strategy='exact' (epoch 0): {'; '.join(parts)}. Use "
            f"strategy='oversampling' (repeat {world - extra} samples: {base + 1} per rank) or 'undersampling' "
            f"(skip {extra} samples per epoch: {base} per rank), or make the total a multiple of {world}"
        )

    # -- shards -----------------------------------------------------------------------

    def _reader(self, shard: int, whole: bool) -> ShardReader:
        """An open reader of ``shard``; ``whole``: for iteration (see ``sources/shards/store.py``)."""
        reader = self._readers.get(shard)
        if reader is not None and (shard in self._whole or not whole):
            self._readers.move_to_end(shard)
            return reader
        if reader is not None:
            self._drop(shard)
        reader = open_reader(self.store, self.metadata.shards[shard], whole, self.options)
        self.shards_opened += 1
        self._readers[shard] = reader
        if whole:
            self._whole.add(shard)
        while len(self._readers) > _MAX_OPEN:
            self._drop(next(iter(self._readers)))
        return reader

    def _drop(self, shard: int) -> None:
        self._whole.discard(shard)
        self._readers.pop(shard).close()

    def _read(self, shard: int, index: int, whole: bool = True) -> Any:
        sample = self._reader(shard, whole).read(index)
        self.samples_read += 1
        return sample

    def close(self) -> None:
        """Close the open shard files (they are reopened when needed) and stop prefetching."""
        while self._readers:
            self._drop(next(iter(self._readers)))
        self.store.close()

    def __getstate__(self) -> dict[str, Any]:
        # Open files and memory maps stay in the process that opened them.
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()
        state["_whole"] = set()
        state["_layout"] = None
        state["_next_layout"] = None
        return state

    # -- iteration --------------------------------------------------------------------

    def reset_state_own(self) -> None:
        self.epoch = [self.worker_config.active_epoch(), *active_repetitions()]
        self.position = 0

    def __iter__(self) -> Iterator[Any]:
        layout = self._get_layout(tuple(self.epoch))
        start, end = self.worker_range(layout=layout)
        if start >= end or layout.total == 0:
            return
        previous = -1
        while start + self.position < end:
            # Seek: the unit and the offset in it follow from the position.
            p = start + self.position
            lap, q = divmod(p, layout.total)
            j, offset = layout.locate(q)
            unit = int(layout.order[j])
            shard, first, count = int(self.unit_shard[unit]), int(self.unit_first[unit]), int(self.unit_count[unit])
            if previous in self._readers and previous != shard:
                self._drop(previous)
            moved = shard != previous and self.store.prefetch_depth > 0
            previous = shard
            order = layout.sample_order(unit, count)[offset : offset + min(count - offset, end - p)]
            # the last sample this worker reads of the unit (the unit's end or the end of
            # the worker's piece): a snapshot right after it lets a restore past this point
            # start after it, never reading (or downloading) this unit again
            last = first + int(order[-1])
            reader = None
            mark, readers = self.mark_sample, self._readers
            for index in (order + first).tolist():
                self.position += 1
                mark([shard, index, lap])
                if index == last:
                    self.request_snapshot()
                if reader is None or readers.get(shard) is not reader:  # (restore_sample may close it)
                    reader = self._reader(shard, True)
                    if moved:  # after the open: the shard is taken from the prefetcher before it is un-named
                        self._prefetch(shard)
                        moved = False
                sample = reader.read(index)
                self.samples_read += 1
                yield sample

    def _prefetch(self, current: int) -> None:
        """Name the shards read after ``current`` to the store (it downloads them ahead)."""
        depth = self.store.prefetch_depth
        ahead = [s for s in self.upcoming_shards(depth + 1) if s != current][:depth]
        self.store.prefetch([self.metadata.shards[s] for s in ahead])

    # -- restore keys -----------------------------------------------------------------

    def restore_sample(self, key: Any) -> Any:
        """Sample ``[shard, index, lap]``, read alone (its shard is opened if needed)."""
        if (
            not isinstance(key, (list, tuple))
            or len(key) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in key)
        ):
            raise RestoreKeyError(f"ShardedFileDataset key must be [shard, index, lap], got {key!r}")
        shard, index, lap = key
        if not 0 <= shard < len(self.counts):
            raise RestoreKeyError(f"ShardedFileDataset key {key!r}: shard {shard} is not in [0, {len(self.counts)})")
        if not 0 <= index < self.counts[shard]:
            raise RestoreKeyError(
                f"ShardedFileDataset key {key!r}: index {index} is not in [0, {int(self.counts[shard])}) "
                f"(shard {self.metadata.shards[shard].path})"
            )
        self.mark_sample([shard, index, lap])
        return self._read(shard, index, whole=False)

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "metadata": self.digest,
            "shards": len(self.counts),
            "samples": self.total,
            "strategy": self.strategy,
            "shuffle": self.shuffle,
        }
        if self.columns is not None:
            config["columns"] = list(self.columns)
        if self.split is not None:
            config["split"] = self.split
        if self.rank_layout != "contiguous":  # (absent by default: states made before it stay valid)
            config["rank_layout"] = self.rank_layout
        if self.files is not None:
            config["files"] = files_config(self.files)
        if self.decode is not None and self.decode is not False:
            config["decode"] = self.decode
        return config


#: Words that name a held-out file (``val-0.parquet``, ``test/part-3.tar``).
_HELD_OUT = frozenset({"val", "valid", "validation", "test", "eval", "evaluation", "dev", "heldout"})


def _warn_held_out(metadata: Metadata, where: str) -> None:
    """Warn when every file is read (no ``files=``) and some are named for validation:
    training on them would go unnoticed."""
    named = [s.path for s in metadata.shards if _HELD_OUT & set(re.split(r"[^a-z]+", s.path.lower()))]
    if named and len(named) < len(metadata.shards):
        shown = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
        warnings.warn(
            f"ShardedFileDataset({where!r}) reads every file of the folder, {shown} included, whose name says "
            "it is held out (validation or test): pass files= to choose, e.g. files='train*' or "
            "files=slice(None, -1) (all but the last)",
            UserWarning,
            stacklevel=3,
        )


def _check_columns(columns: Sequence[str] | None) -> tuple[str, ...] | None:
    if columns is None:
        return None
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns) or not columns:
        raise LoaderUsageError(f"ShardedFileDataset columns must be a non-empty list of names, got {columns!r}")
    if len(set(columns)) != len(columns):
        raise LoaderUsageError(f"ShardedFileDataset columns lists a name twice: {list(columns)!r}")
    return tuple(columns)


def _decoders(
    decode: bool | Mapping[str, Callable[[bytes], Any]] | None,
) -> Mapping[str, Callable[[bytes], Any]] | None:
    if decode is None or decode is False:
        return None
    if decode is True:
        return DEFAULT_DECODERS
    if isinstance(decode, Mapping) and all(isinstance(k, str) and callable(v) for k, v in decode.items()):
        return dict(decode)
    raise LoaderUsageError(
        f"ShardedFileDataset decode must be None, True or a mapping from extension to decoder, got {decode!r}"
    )
