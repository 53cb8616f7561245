"""Elastic resume: a saved position carried to another world size or batch size.

**World size (drop-in path).** An epoch starts as *stage 0*: the padded global order
(``ceil(N / W) * W`` positions, see ``sources/index.py``) with rank ``r`` taking
positions ``r, r + W, ...``. When a state saved on ``W`` ranks is restored on ``W'``,
the stage ends: rank ``r`` had consumed the first ``consumed[r]`` positions of its share
(ranks may differ). The next stage is made of the samples *no rank had consumed* — a
position ``p < N`` is left if neither ``p`` nor its padding copy ``p + N`` was consumed
— in increasing position order, and new rank ``r'`` takes every ``W'``-th of them from
``r'`` on. Each is consumed exactly once; there is no padding, so ranks' shares of the
rest of that epoch differ by at most one sample (with ``drop_last`` every rank stops at
the full batches of the smallest share, so all take the same number of steps). A later change of world size in the
same epoch adds another stage the same way; the next epoch is an ordinary ``W'``-rank
epoch. A rank that had finished the epoch when the others were saved (its state says
the next epoch, nothing consumed) counts as having consumed what it yields of a whole
epoch (with ``drop_last`` the dropped tail is left to the new ranks).

**Batch size.** Drop-in positions count samples, so a batch size that divides the
saved one continues the same sample order. In a savable pipeline the state counts
items (batches) per worker: ``batch_rescale_factor`` finds a ``BatchDataset`` whose
``batch_size`` was divided by ``k`` (the only change), and the worker positions and skip
offsets are multiplied by ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from savable_loader.errors import ConfigMismatchError, StateError
from savable_loader.state.schema import IndexPosition, IndexStage, RankState

__all__ = [
    "batch_rescale_factor",
    "elastic_position",
    "epoch_length",
    "rank_share",
    "remaining_positions",
    "share_length",
]

_BATCH_TYPE = "savable_loader.wrappers.batch.BatchDataset"
_ONE_TO_ONE = {"savable_loader.wrappers.map.MapDataset"}


def remaining_positions(dataset_len: int, stages: Sequence[IndexStage]) -> np.ndarray:
    """Global positions (ascending, all ``< dataset_len``) that ``stages`` left unconsumed."""
    n = dataset_len
    first = stages[0]
    w0 = first.world_size
    total = math.ceil(n / w0) * w0 if n else 0
    consumed = np.zeros(total, dtype=bool)
    for rank, count in enumerate(first.consumed):
        consumed[rank : rank + count * w0 : w0] = True
    keep = ~consumed[:n]
    if total > n:  # a padding position consumed means its sample was consumed
        keep[: total - n] &= ~consumed[n:total]
    left = np.flatnonzero(keep)
    for stage in stages[1:]:
        mask = np.ones(len(left), dtype=bool)
        for rank, count in enumerate(stage.consumed):
            mask[rank : rank + count * stage.world_size : stage.world_size] = False
        left = left[mask]
    return left


def rank_share(dataset_len: int, world_size: int, rank: int, stages: Sequence[IndexStage]) -> range | np.ndarray:
    """The global positions of ``rank``'s share of an epoch, in order."""
    if not stages:
        total = math.ceil(dataset_len / world_size) * world_size if dataset_len else 0
        return range(rank, total, world_size)
    return remaining_positions(dataset_len, stages)[rank::world_size]


def share_length(dataset_len: int, world_size: int, rank: int, stages: Sequence[IndexStage]) -> int:
    """``len(rank_share(...))`` without building it for stage 0."""
    if not stages:
        return math.ceil(dataset_len / world_size) if dataset_len else 0
    left = len(remaining_positions(dataset_len, stages))
    return len(range(rank, left, world_size))


def epoch_length(
    dataset_len: int, world_size: int, rank: int, stages: Sequence[IndexStage], batch_size: int | None, drop_last: bool
) -> int:
    """Samples ``rank`` yields in an epoch: its share, with ``drop_last`` cut to full
    batches — after a world-size change to the full batches of the *smallest* share, so
    that every rank takes the same number of steps."""
    length = share_length(dataset_len, world_size, rank, stages)
    if not drop_last:
        return length
    step = batch_size or 1
    if stages:
        length = min(length, share_length(dataset_len, world_size, world_size - 1, stages))
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
                "world_size", old_world, new_world_size,
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
    consumed = []
    for rank, p in enumerate(positions):
        if p.epoch == epoch:
            consumed.append(p.consumed)  # type: ignore[union-attr]
        elif p.epoch == epoch + 1 and p.consumed == 0 and not p.stages:  # type: ignore[union-attr]
            consumed.append(epoch_length(n, old_world, rank, stages, first.batch_size, first.drop_last))
        else:
            raise StateError(
                f"rank {rank} was saved in epoch {p.epoch}, rank {positions.index(current[0])} in epoch {epoch}: "
                "the ranks were more than one epoch apart"
            )
    for rank, count in enumerate(consumed):
        share = share_length(n, old_world, rank, stages)
        if count > share:
            raise StateError(f"rank {rank} consumed {count} samples of a share of {share}")
    if not any(consumed):  # nothing consumed in this stage: it leaves what it was given
        return IndexPosition(epoch=epoch, consumed=0, dataset_len=n, stages=stages)
    stages.append(IndexStage(world_size=old_world, consumed=consumed))
    if len(remaining_positions(n, stages)) == 0:
        return IndexPosition(epoch=epoch + 1, consumed=0, dataset_len=n)
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
            "BatchDataset.batch_size", old, new,
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
