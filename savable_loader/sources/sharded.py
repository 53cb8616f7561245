"""ShardedFileDataset: samples from a folder of shard files, split over ranks and workers.

The folder format (``metadata.json`` plus ``.npy`` / ``.pt`` / ``.jsonl`` shards) is
described in ``savable_loader/sources/_shard_io.py``; ``write_shards`` writes one.

How an epoch is laid out (the same computation on every rank and worker):

1. The epoch key is ``(epoch, *repetitions)``: the loader epoch and, inside a
   ``RepeatDataset``, the pass numbers, so every pass is shuffled anew.
2. With ``shuffle`` the shard order is a permutation drawn from ``(seed, epoch key)``,
   and the samples inside shard ``s`` are a permutation drawn from
   ``(seed, epoch key, s)``; without it both are the metadata order.
3. The shards, in that order, form the epoch's global sequence of ``N`` samples. Rank
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
one shard come out together (shuffled inside the shard): put a ``ShuffleBufferDataset``
after the source to mix shards.

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
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from savable_loader._seeds import shard_order_seed, shard_samples_seed
from savable_loader.config import WorkerConfig, active_repetitions
from savable_loader.dataset import SavableDataset
from savable_loader.errors import DataError, LoaderUsageError, RestoreKeyError
from savable_loader.sources._shard_io import Metadata, ShardReader, open_shard, read_metadata

__all__ = ["STRATEGIES", "ShardedFileDataset"]

STRATEGIES = ("exact", "oversampling", "undersampling")
_MAX_OPEN = 2


class _Layout:
    """One epoch's shard order and where each shard starts in the global sequence."""

    def __init__(self, counts: np.ndarray, seed: int, key: tuple[int, ...], shuffle: bool) -> None:
        self.seed, self.key, self.shuffle = seed, key, shuffle
        if shuffle:
            rng = np.random.Generator(np.random.PCG64(shard_order_seed(seed, tuple(key))))
            self.order = rng.permutation(len(counts))
        else:
            self.order = np.arange(len(counts))
        self.starts = np.concatenate([[0], np.cumsum(counts[self.order])]).astype(np.int64)
        self.total = int(self.starts[-1])

    def locate(self, q: int) -> tuple[int, int]:
        """``(position in the shard order, offset in that shard)`` of global position ``q``."""
        j = int(np.searchsorted(self.starts, q, side="right")) - 1
        return j, q - int(self.starts[j])

    def sample_order(self, shard: int, count: int) -> np.ndarray:
        """The order in which the rows of ``shard`` are read in this epoch."""
        if not self.shuffle:
            return np.arange(count)
        rng = np.random.Generator(np.random.PCG64(shard_samples_seed(self.seed, tuple(self.key), shard)))
        return rng.permutation(count)


class ShardedFileDataset(SavableDataset):
    """Samples of a shard folder, split over ranks and workers, reshuffled every epoch.

    ``strategy`` says how ranks get equal sample counts (``"exact"``, ``"oversampling"``,
    ``"undersampling"``; see the module docstring for the layout). Samples are
    ``torch.Tensor`` rows (``.npy``, ``.pt``), dicts of tensor rows (``.pt`` holding a
    dict) or decoded JSON values (``.jsonl``). Missing or malformed metadata raises
    :class:`~savable_loader.errors.DataError` here; a shard that is unreadable or whose
    length disagrees with the metadata raises it when the shard is first opened.

    ``samples_read`` and ``shards_opened`` count reads and opens in this process (for
    monitoring; they are not state).

    Example::

        write_shards("data/train", [np.zeros((100, 16), np.float32)] * 8)
        wc = WorkerConfig(num_workers=4, seed=0)
        ds = ShardedFileDataset("data/train", wc, strategy="undersampling")
        loader = SavableDataLoader(BatchDataset(ds, 32), batch_size=None, worker_config=wc)
    """

    _savable_fields = ("epoch", "position")

    def __init__(
        self,
        folder: str | os.PathLike[str],
        worker_config: WorkerConfig,
        *,
        strategy: str = "exact",
        shuffle: bool = True,
    ) -> None:
        super().__init__(worker_config)
        if strategy not in STRATEGIES:
            raise LoaderUsageError(f"ShardedFileDataset strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not isinstance(shuffle, bool):
            raise LoaderUsageError(f"ShardedFileDataset shuffle must be a bool, got {shuffle!r}")
        self.folder = Path(folder)
        self.strategy = strategy
        self.shuffle = shuffle
        self.metadata: Metadata = read_metadata(self.folder)
        self.counts = np.array([s.samples for s in self.metadata.shards], dtype=np.int64)
        self.total = int(self.counts.sum())
        self.digest = hashlib.blake2b(msgspec.json.encode(self.metadata.shards), digest_size=12).hexdigest()
        world = worker_config.world_size
        if strategy == "exact" and self.total % world:
            raise DataError(self._uneven_message())
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._layout: _Layout | None = None
        self.samples_read = 0
        self.shards_opened = 0
        self.reset_state_own()

    # -- layout -----------------------------------------------------------------------

    def rank_length(self) -> int:
        """Samples every rank reads per epoch."""
        world = self.worker_config.world_size
        if self.strategy == "oversampling":
            return math.ceil(self.total / world)
        return self.total // world

    def worker_range(self, worker: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of a worker's piece in the epoch's global sequence
        (default: the calling worker); positions past the total wrap around."""
        wc = self.worker_config
        w = wc.rank_worker_id() if worker is None else worker
        k = wc.workers_per_rank
        length = self.rank_length()
        base, extra = divmod(length, k)
        start = wc.rank * length + w * base + min(w, extra)
        return start, start + base + (1 if w < extra else 0)

    def _get_layout(self, key: tuple[int, ...]) -> _Layout:
        if self._layout is None or self._layout.key != key:
            self._layout = _Layout(self.counts, self.worker_config.seed, key, self.shuffle)
        return self._layout

    def _uneven_message(self) -> str:
        world, total = self.worker_config.world_size, self.total
        layout = _Layout(self.counts, self.worker_config.seed, (0,), self.shuffle)
        base, extra = divmod(total, world)
        parts, start = [], 0
        for r in range(min(world, 8)):
            n = base + (1 if r < extra else 0)
            j0, _ = layout.locate(start) if n else (0, 0)
            j1, _ = layout.locate(start + n - 1) if n else (-1, 0)
            files = [self.metadata.shards[int(layout.order[j])].path for j in range(j0, j1 + 1)
                     if self.counts[layout.order[j]]]
            shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
            parts.append(f"rank {r} would read {n} samples (from {shown or 'no file'})")
            start += n
        if world > 8:
            parts.append(f"... ({world - 8} more ranks)")
        return (
            f"ShardedFileDataset({str(self.folder)!r}): {total} samples in {len(self.counts)} shards do not split "
            f"evenly over world_size={world} ranks with strategy='exact' (epoch 0): {'; '.join(parts)}. Use "
            f"strategy='oversampling' (repeat {world - extra} samples: {base + 1} per rank) or 'undersampling' "
            f"(skip {extra} samples per epoch: {base} per rank), or make the total a multiple of {world}"
        )

    # -- shards -----------------------------------------------------------------------

    def _reader(self, shard: int) -> ShardReader:
        reader = self._readers.get(shard)
        if reader is not None:
            self._readers.move_to_end(shard)
            return reader
        entry = self.metadata.shards[shard]
        reader = open_shard(self.folder / entry.path, expected=entry.samples)
        self.shards_opened += 1
        self._readers[shard] = reader
        while len(self._readers) > _MAX_OPEN:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

    def _read(self, shard: int, index: int) -> Any:
        sample = self._reader(shard).read(index)
        self.samples_read += 1
        return sample

    def close(self) -> None:
        """Close the open shard files (they are reopened when needed)."""
        while self._readers:
            self._readers.popitem()[1].close()

    def __getstate__(self) -> dict[str, Any]:
        # Open files and memory maps stay in the process that opened them.
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()
        state["_layout"] = None
        return state

    # -- iteration --------------------------------------------------------------------

    def reset_state_own(self) -> None:
        self.epoch = [self.worker_config.active_epoch(), *active_repetitions()]
        self.position = 0

    def __iter__(self) -> Iterator[Any]:
        start, end = self.worker_range()
        if start >= end or self.total == 0:
            return
        layout = self._get_layout(tuple(self.epoch))
        previous = -1
        while start + self.position < end:
            # Seek: the shard and the offset in it follow from the position.
            p = start + self.position
            lap, q = divmod(p, self.total)
            j, offset = layout.locate(q)
            shard = int(layout.order[j])
            count = int(self.counts[shard])
            if previous in self._readers and previous != shard:
                self._readers.pop(previous).close()
            previous = shard
            rows = layout.sample_order(shard, count)[offset : offset + min(count - offset, end - p)].tolist()
            for index in rows:
                self.position += 1
                self.mark_sample([shard, index, lap])
                yield self._read(shard, index)

    # -- restore keys -----------------------------------------------------------------

    def restore_sample(self, key: Any) -> Any:
        """Sample ``[shard, index, lap]``, read alone (its shard is opened if needed)."""
        if (
            not isinstance(key, (list, tuple)) or len(key) != 3
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
        return self._read(shard, index)

    def config(self) -> dict[str, Any]:
        return {
            "metadata": self.digest,
            "shards": len(self.counts),
            "samples": self.total,
            "strategy": self.strategy,
            "shuffle": self.shuffle,
        }
