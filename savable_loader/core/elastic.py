"""Elastic resume: a saved position carried to another world size or batch size.

**World size (drop-in path).** An epoch starts as *stage 0*: the padded global order
(``ceil(N / W) * W`` positions, see ``sources/index.py``) with rank ``r`` taking
positions ``r, r + W, ...``. When a state saved on ``W`` ranks is restored on ``W'``,
the stage ends: rank ``r`` had consumed the first ``consumed[r]`` positions of its share
(ranks may differ). The next stage is made of the samples *no rank had consumed* — a
position ``p < N`` is left if neither ``p`` nor a padding copy of it (``p + N``,
``p + 2N``, ... below ``ceil(N / W) * W``) was consumed — in increasing position order, and new rank ``r'`` takes every ``W'``-th of them from
``r'`` on. Each is consumed exactly once; there is no padding, so ranks' shares of the
rest of that epoch differ by at most one sample (with ``drop_last`` every rank stops at
the full batches of the smallest share, so all take the same number of steps). A later change of world size in the
same epoch adds another stage the same way; the next epoch is an ordinary ``W'``-rank
epoch. A rank that had finished the epoch when the others were saved (its state says
the next epoch, nothing consumed) counts as having consumed what it yields of a whole
epoch (with ``drop_last`` the dropped tail is left to the new ranks). States saved
right after the epoch's last batch leave nothing: the restored position is the epoch's
empty rest, then the next epoch, as at the same world size (states saved after the loop
all point at the next epoch's start).

**Arithmetic, not arrays.** What a stage consumed is one arithmetic progression per
rank, so the positions left (:class:`Remaining`) and a rank's part of them
(:class:`Share`) are lazy sequences: their length, the ``k``-th entry and the count of
entries below a position are computed from the stages' ``consumed`` counts (see
``_Stage``), in memory and time that grow with the stages' world sizes, never with the
dataset. A billion-sample epoch resumed on another world size costs what a thousand-sample
one does.

**Batch size.** Drop-in positions count samples, so a batch size that divides the
saved one continues the same sample order. In a savable pipeline the state counts
items (batches) per worker: ``batch_rescale_factor`` finds a ``BatchDataset`` whose
``batch_size`` was divided by ``k`` (the only change), and the worker positions and skip
offsets are multiplied by ``k``.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from savable_loader.errors import ConfigMismatchError, StateError
from savable_loader.state.schema import IndexPosition, IndexStage, RankState

__all__ = [
    "ALL_CONSUMED",
    "Remaining",
    "Share",
    "batch_rescale_factor",
    "elastic_position",
    "epoch_length",
    "rank_share",
    "remaining_positions",
    "share_length",
]

_BATCH_TYPE = "savable_loader.wrappers.batch.BatchDataset"
_ONE_TO_ONE = {"savable_loader.wrappers.map.MapDataset"}


class _Stage:
    """The indices ``[0, size)`` that one stage left: rank ``r`` of ``world`` consumed the
    indices ``r, r + world, ..., r + (consumed[r] - 1) * world``.

    Residue ``r`` is kept from its *threshold* ``t_r = r + consumed[r] * world`` on. Sorting
    the thresholds cuts ``[0, size)`` into at most ``world + 1`` pieces; in the piece
    that starts at the ``j``-th smallest threshold exactly the residues of the ``j``
    smallest thresholds are kept, a pattern of period ``world``. ``kept_below`` and
    ``select`` use that structure: O(world) to build, O(log world) a query (plus
    O(world log world) the first time a piece is visited; one piece is cached).
    """

    def __init__(self, size: int, world: int, consumed: Sequence[int]) -> None:
        if len(consumed) != world:
            raise StateError(f"a stage of world_size {world} has {len(consumed)} consumed counts, expected {world}")
        for rank, count in enumerate(consumed):
            share = len(range(rank, size, world))
            if not 0 <= count <= share:
                raise StateError(f"stage rank {rank} consumed {count} samples of a share of {share}")
        self.size = size
        self.world = world
        self.counts = np.asarray(consumed, dtype=np.int64)
        self.thresholds = np.arange(world, dtype=np.int64) + self.counts * world
        self.order = np.argsort(self.thresholds, kind="stable")  # residues by threshold
        self.bounds = [0] + self.thresholds[self.order].tolist()  # piece j starts at bounds[j]
        # cum[j]: kept indices below bounds[j] (j active residues in piece j)
        done_counts = np.concatenate(([0], np.cumsum(self.counts[self.order]))).tolist()
        tree = [0] * (world + 1)  # Fenwick tree over residues: which are done (threshold passed)
        cum = [0]
        for j in range(1, world + 1):
            r = int(self.order[j - 1])
            i = r + 1
            while i <= world:
                tree[i] += 1
                i += i & -i
            b = self.bounds[j]
            q, s = divmod(b, world)
            done_below_s = 0
            i = s
            while i > 0:
                done_below_s += tree[i]
                i -= i & -i
            removed = done_counts[j] + q * (world - j) + (s - done_below_s)
            cum.append(b - removed)
        self.cum = cum
        self.total = self.kept_below(size)
        self._piece: tuple[int, list[int]] | None = None

    def kept_below(self, i: int) -> int:
        """How many kept indices are below ``i``."""
        i = min(max(i, 0), self.size)
        done = self.thresholds <= i
        q, s = divmod(i, self.world)
        undone_below_s = int(np.count_nonzero(~done[:s]))
        removed = int(self.counts[done].sum()) + q * int(np.count_nonzero(~done)) + undone_below_s
        return i - removed

    def select(self, k: int) -> int:
        """The ``k``-th kept index (from 0), for ``0 <= k < total``."""
        # the last piece starting at or before k (pieces that keep nothing have equal cum)
        j = bisect.bisect_right(self.cum, k) - 1
        shifted = self._shifted(j)
        off = k - self.cum[j]
        m = len(shifted)
        return self.bounds[j] + off // m * self.world + shifted[off % m]

    def select_many(self, ks: np.ndarray) -> np.ndarray:
        """:meth:`select` of every entry of ``ks`` (int64), vectorised piece by piece."""
        cum = np.asarray(self.cum, dtype=np.int64)
        js = np.searchsorted(cum, ks, side="right") - 1
        out = np.empty_like(ks)
        for j in np.unique(js).tolist():  # a chunk of a share spans few pieces
            mask = js == j
            shifted = np.asarray(self._shifted(j), dtype=np.int64)
            off = ks[mask] - self.cum[j]
            out[mask] = self.bounds[j] + off // len(shifted) * self.world + shifted[off % len(shifted)]
        return out

    def _shifted(self, j: int) -> list[int]:
        """The active residues of piece ``j`` as offsets from its start, ascending."""
        piece = self._piece  # one read: another thread may replace it
        if piece is None or piece[0] != j:
            active = self.order[:j]
            piece = (j, np.sort((active - self.bounds[j]) % self.world).tolist())
            self._piece = piece
        return piece[1]


class Remaining:
    """The global positions no rank consumed in ``stages``: ascending, all ``< dataset_len``.

    A lazy sequence: ``len``, indexing (``remaining[k]``, the ``k``-th left), slicing,
    iteration and :meth:`count_below`, all by arithmetic over the stages' consumed
    progressions (memory O(total world size of the stages), never O(dataset_len)).

    Stage 0 is the padded ``W``-rank epoch (``ceil(N / W) * W`` positions); a position
    ``p < N`` is left if neither ``p`` nor a padding copy of it (``p + N``, ``p + 2N``,
    ...) was consumed. Each
    later stage keeps the positions of the previous stage's list that its ranks did not
    take (rank ``r`` took the list's entries ``r, r + W', ...``).

    Example::

        left = Remaining(10, [IndexStage(world_size=2, consumed=[2, 1])])
        list(left)            # [3, 4, 5, 6, 7, 8, 9]: rank 0 took 0 and 2, rank 1 took 1
        left.count_below(5)   # 2
    """

    def __init__(self, dataset_len: int, stages: Sequence[IndexStage]) -> None:
        if not stages:
            raise ValueError("Remaining needs at least one stage")
        n = dataset_len
        first = stages[0]
        w0 = first.world_size
        total = math.ceil(n / w0) * w0 if n else 0
        self.dataset_len = n
        self._padded = _Stage(total, w0, first.consumed)
        pad = self._padded
        # samples a padding copy of which (at p + n, p + 2n, ... < total) was consumed
        # although p itself was not; fewer than w0 padding positions in all
        extra = [
            p
            for p in range(min(n, total - n))
            if _kept(pad, p) and not all(_kept(pad, c) for c in range(p + n, total, n))
        ]
        self._extra = extra
        # the i-th extra sample is skipped by select(k) iff its kept-index - i <= k
        self._extra_gaps = [pad.kept_below(p) - i for i, p in enumerate(extra)]
        length = pad.kept_below(n) - len(extra)
        self._stages: list[_Stage] = []
        for stage in stages[1:]:
            s = _Stage(length, stage.world_size, stage.consumed)
            self._stages.append(s)
            length = s.total
        self._len = length

    def __len__(self) -> int:
        return self._len

    def _stage0(self, k: int) -> int:
        return self._padded.select(k + bisect.bisect_right(self._extra_gaps, k))

    def position(self, k: int) -> int:
        """The ``k``-th remaining position (``0 <= k < len``)."""
        if not 0 <= k < self._len:
            raise IndexError(f"remaining position {k} out of range({self._len})")
        for stage in reversed(self._stages):
            k = stage.select(k)
        return self._stage0(k)

    def positions(self, ks: Any) -> np.ndarray:
        """The ``k``-th remaining position for every ``k`` of ``ks`` (vectorised), as int64."""
        k = np.asarray(ks, dtype=np.int64)
        if k.size and (int(k.min()) < 0 or int(k.max()) >= self._len):
            raise IndexError(f"remaining positions {int(k.min())}..{int(k.max())} out of range({self._len})")
        for stage in reversed(self._stages):
            k = stage.select_many(k)
        k = k + np.searchsorted(np.asarray(self._extra_gaps, dtype=np.int64), k, side="right")
        return self._padded.select_many(k)

    def count_below(self, p: int) -> int:
        """How many remaining positions are below ``p``."""
        pad = self._padded
        c = pad.kept_below(min(p, self.dataset_len)) - bisect.bisect_left(self._extra, p)
        for stage in self._stages:
            c = stage.kept_below(c)
        return c

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return self.positions(np.arange(*k.indices(self._len), dtype=np.int64)).tolist()
        k = operator.index(k)
        return self.position(k + self._len if k < 0 else k)

    def __iter__(self) -> Iterator[int]:
        return (self.position(i) for i in range(self._len))

    def __repr__(self) -> str:
        return f"Remaining({self._len} of {self.dataset_len} positions)"


def _kept(stage: _Stage, i: int) -> bool:
    return i >= int(stage.thresholds[i % stage.world])


class Share:
    """Rank ``rank``'s part of ``remaining``: its entries ``rank, rank + world_size, ...``.

    A lazy sequence of global positions (``len``, indexing, slicing, iteration).

    Example::

        share = Share(Remaining(45, stages), rank=1, world_size=3)
        share[:4]   # the rank's first four positions
    """

    def __init__(self, remaining: Remaining, rank: int, world_size: int) -> None:
        self.remaining = remaining
        self.rank = rank
        self.world_size = world_size
        self._index = range(rank, len(remaining), world_size)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            part = self._index[k]
            return self.remaining.positions(np.arange(part.start, part.stop, part.step, dtype=np.int64)).tolist()
        return self.remaining.position(self._index[k])

    def __iter__(self) -> Iterator[int]:
        return (self.remaining.position(i) for i in self._index)

    def __repr__(self) -> str:
        return f"Share(rank {self.rank} of {self.world_size}: {len(self)} positions)"


def remaining_positions(dataset_len: int, stages: Sequence[IndexStage]) -> Remaining:
    """Global positions (ascending, all ``< dataset_len``) that ``stages`` left unconsumed.

    The same (immutable) object for the same arguments while it is among the few used last.
    """
    return _remaining(dataset_len, tuple((s.world_size, tuple(s.consumed)) for s in stages))


@functools.lru_cache(maxsize=8)
def _remaining(dataset_len: int, stages: tuple[tuple[int, tuple[int, ...]], ...]) -> Remaining:
    return Remaining(dataset_len, [IndexStage(world_size=w, consumed=list(c)) for w, c in stages])


def rank_share(dataset_len: int, world_size: int, rank: int, stages: Sequence[IndexStage]) -> range | Share:
    """The global positions of ``rank``'s share of an epoch, in order (lazy)."""
    if not stages:
        total = math.ceil(dataset_len / world_size) * world_size if dataset_len else 0
        return range(rank, total, world_size)
    return Share(remaining_positions(dataset_len, stages), rank, world_size)


def share_length(dataset_len: int, world_size: int, rank: int, stages: Sequence[IndexStage]) -> int:
    """``len(rank_share(...))``, by arithmetic."""
    if not stages:
        return math.ceil(dataset_len / world_size) if dataset_len else 0
    return len(range(rank, len(remaining_positions(dataset_len, stages)), world_size))


def epoch_length(
    dataset_len: int, world_size: int, rank: int, stages: Sequence[IndexStage], batch_size: int | None, drop_last: bool
) -> int:
    """Samples ``rank`` yields in an epoch: its share, with ``drop_last`` cut to full
    batches — after a world-size change to the full batches of the *smallest* share, so
    that every rank takes the same number of steps."""
    if not stages:
        return _cut(share_length(dataset_len, world_size, rank, ()), batch_size, drop_last)
    left = len(remaining_positions(dataset_len, stages))
    return _cut(len(range(rank, left, world_size)), batch_size, drop_last, len(range(world_size - 1, left, world_size)))


def _cut(length: int, batch_size: int | None, drop_last: bool, smallest: int | None = None) -> int:
    """A share's length, with ``drop_last`` cut to full batches (of the smallest share)."""
    if not drop_last:
        return length
    step = batch_size or 1
    if smallest is not None:
        length = min(length, smallest)
    return length // step * step


def elastic_position(states: Sequence[RankState], new_world_size: int) -> IndexPosition:
    """The position every new rank starts from, given all old ranks' states (in order).

    The new ranks all get the same stages and ``consumed=0``: the loader takes its share
    of what is left by its own rank and world size.
    """
    old_world = len(states)
    positions = [s.position for s in states]
    for i, p in enumerate(positions):
        if not isinstance(p, IndexPosition):
            raise ConfigMismatchError(
                "world_size",
                old_world,
                new_world_size,
                "a savable pipeline's state is split per rank and worker: restore it on the same world size",
            )
        if i == 0:
            first_len = p.dataset_len
        elif p.dataset_len != first_len:
            raise StateError(f"entry {i} has dataset_len {p.dataset_len}, entry 0 has {first_len}")
    first = states[0].config
    for i, s in enumerate(states):
        for name in ("seed", "shuffle", "batch_size", "drop_last", "dataset_fingerprint"):
            if getattr(s.config, name) != getattr(first, name):
                raise StateError(
                    f"entry {i} was saved with {name}={getattr(s.config, name)!r}, entry 0 with {getattr(first, name)!r}"
                )
    epoch = min(p.epoch for p in positions)
    current = [p for p in positions if p.epoch == epoch]
    stages = list(current[0].stages)  # type: ignore[union-attr]
    n = positions[0].dataset_len  # type: ignore[union-attr]
    if any(p.stages != stages for p in current):  # type: ignore[union-attr]
        raise StateError(f"the ranks' states disagree on the earlier stages of epoch {epoch}")
    # every old rank's share (one arithmetic pass over the stages, whatever the world size)
    if stages:
        left = len(remaining_positions(n, stages))
        shares = [len(range(rank, left, old_world)) for rank in range(old_world)]
    else:
        shares = [share_length(n, old_world, rank, ()) for rank in range(old_world)]
    consumed = []
    for rank, p in enumerate(positions):
        if p.epoch == epoch:
            consumed.append(p.consumed)  # type: ignore[union-attr]
        elif p.epoch == epoch + 1 and p.consumed == 0 and not p.stages:  # type: ignore[union-attr]
            smallest = shares[-1] if stages else None
            consumed.append(_cut(shares[rank], first.batch_size, first.drop_last, smallest))
        else:
            raise StateError(
                f"rank {rank} was saved in epoch {p.epoch}, rank {positions.index(current[0])} in epoch {epoch}: "
                "the ranks were more than one epoch apart"
            )
    for rank, count in enumerate(consumed):
        share = shares[rank]
        if count > share:
            raise StateError(f"rank {rank} consumed {count} samples of a share of {share}")
    if not any(consumed):  # nothing consumed in this stage: it leaves what it was given
        return IndexPosition(epoch=epoch, consumed=0, dataset_len=n, stages=stages)
    stages.append(IndexStage(world_size=old_world, consumed=consumed))
    # Nothing left (a save right after the epoch's last batch): the epoch's empty rest,
    # then the next epoch, as at the same world size (torchdata's rule): a loop that
    # counts its epochs runs as many on any world size.
    return IndexPosition(epoch=epoch, consumed=0, dataset_len=n, stages=stages)


def batch_rescale_factor(saved: Any, current: Any) -> int | None:
    """``k`` if the pipeline configs differ only in one ``BatchDataset.batch_size``, which
    was divided by ``k``, with nothing but maps above it; None if they differ otherwise.

    Raises ConfigMismatchError for a batch size that grew or does not divide.
    """
    found: list[tuple[int, int]] = []
    if not _match(saved, current, found, above_ok=True):
        return None
    if len(found) != 1:
        return None
    old, new = found[0]
    if new > old or old % new:
        raise ConfigMismatchError(
            "BatchDataset.batch_size",
            old,
            new,
            "a restore may only divide the batch size (e.g. 8 -> 4 or 2)",
        )
    return old // new


def _match(saved: Any, current: Any, found: list[tuple[int, int]], above_ok: bool) -> bool:
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return False
    if saved.get("type") != current.get("type") or set(saved) != set(current):
        return False
    for key in saved:
        if key == "children":
            continue
        if saved[key] != current[key]:
            if not (saved.get("type") == _BATCH_TYPE and key == "batch_size" and above_ok):
                return False
            found.append((saved[key], current[key]))
    kids_s, kids_c = saved.get("children", []), current.get("children", [])
    if len(kids_s) != len(kids_c):
        return False
    below_ok = above_ok and saved.get("type") in _ONE_TO_ONE
    return all(_match(s, c, found, below_ok) for s, c in zip(kids_s, kids_c))


#: The key a worker's fields carry when it had ended its epoch (it consumed every entry of
#: its share up to the epoch's end).
ALL_CONSUMED = "__all_consumed__"
