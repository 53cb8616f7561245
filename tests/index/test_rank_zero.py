"""savable_loader/index/rank_zero.py: checkpoints that keep rank 0's loader state only.

In-process, without a process group: two loaders built as ranks 0 and 1 of a world of 2
stand for the two ranks of a data-parallel job stepping in lockstep. Rank 1 restores
from ``{"dp_rank_0": ...}`` (what Lightning, Fabric and Accelerate hand every rank) at
every step of two epochs and must continue exactly as its uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

import savable_loader as sl
from savable_loader.state.codec import decode, encode
from tests.common import RandomMapDataset, RangeSource, assert_streams

N = 24  # 3 batches of 4 per rank and epoch
EPOCHS = 2


def _loader(rank: int, kind: str, world: int = 2) -> sl.SavableDataLoader:
    ds = RandomMapDataset(N)
    wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=0, seed=3)
    if kind == "own":
        return sl.SavableDataLoader(ds, batch_size=4, shuffle=True, worker_config=wc)
    if kind == "distributed":
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
        return sl.SavableDataLoader(ds, batch_size=4, sampler=sampler, worker_config=wc)
    if kind == "random":
        return sl.SavableDataLoader(ds, batch_size=4, sampler=RandomSampler(ds), worker_config=wc)
    raise ValueError(kind)


def _epochs(loader: sl.SavableDataLoader) -> list[Any]:
    out: list[Any] = []
    for _ in range(EPOCHS):
        out.extend(loader)
    return out


def _rank0_entries(kind: str, steps: int) -> dict[str, Any]:
    """Rank 0's ``state_dict()`` after ``steps`` batches of the two epochs (ended ones
    ended as a ``for`` loop ends them)."""
    loader = _loader(0, kind)
    left = steps
    for _ in range(EPOCHS):
        it = iter(loader)
        while left:
            try:
                next(it)
            except StopIteration:
                break
            left -= 1
        else:
            return loader.state_dict()
    return loader.state_dict()


@pytest.mark.parametrize("kind", ["own", "distributed"])
def test_rank_1_resumes_from_rank_0s_entry_at_every_step(kind):
    want = _epochs(_loader(1, kind))
    per_epoch = len(want) // EPOCHS
    assert per_epoch == 3
    other = _epochs(_loader(0, kind))
    assert {int(i) for b in want[:per_epoch] for i in b[:, 0]}.isdisjoint(
        int(i) for b in other[:per_epoch] for i in b[:, 0]
    ), "the ranks share data"
    for steps in range(len(want)):
        entries = _rank0_entries(kind, steps)
        assert list(entries) == ["dp_rank_0"]
        loader = _loader(1, kind)
        loader.load_state_dict(entries)
        got: list[Any] = []
        for _ in range(EPOCHS + 1):  # the first iter() continues the saved epoch (maybe nothing left)
            if len(got) >= len(want) - steps:
                break
            got.extend(loader)
        assert_streams(got, want[steps:], f"{kind}, rank 1 resumed after {steps} batches")


def test_a_sampler_whose_order_on_another_rank_is_unknown_is_refused():
    entries = _rank0_entries("random", 2)
    loader = _loader(1, "random")
    with pytest.raises(sl.StateError, match="save_state_global"):
        loader.load_state_dict(entries)


def test_another_world_size_is_refused():
    entries = _rank0_entries("own", 2)
    with pytest.raises(sl.ConfigMismatchError, match="world_size"):
        _loader(1, "own", world=4).load_state_dict(entries)


def test_a_pipeline_rank_cannot_take_rank_0s_state():
    def pipeline(rank: int) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=rank, world_size=2, num_workers=0, seed=3)
        return sl.SavableDataLoader(RangeSource(16, wc), batch_size=None, worker_config=wc)

    loader = pipeline(0)
    it = iter(loader)
    next(it)
    entries = loader.state_dict()
    with pytest.raises(sl.StateError, match="save_state_global"):
        pipeline(1).load_state_dict(entries)


def test_an_entry_of_each_rank_is_taken_as_it_is():
    """DCP and gathered checkpoints carry every rank's entry: no derivation."""
    loader = _loader(1, "random")
    it = iter(loader)
    next(it)
    own = loader.state_dict()
    want = next(it)
    restored = _loader(1, "random")
    restored.load_state_dict({"dp_rank_0": b"not used", **own})
    assert torch.equal(next(iter(restored)), want)


class _Counting(torch.utils.data.IterableDataset):
    """A plain torch IterableDataset (no ``len()``, no ``state_dict()``)."""

    def __iter__(self):
        return iter(range(16))


@pytest.mark.parametrize("kind", ["own", "random", "pipeline", "iterable"])
def test_a_save_can_leave_out_the_item_the_caller_holds(kind):
    """What Lightning's prefetch needs: the state saved while the caller holds the item
    yielded last is the state saved before that item."""
    if kind == "iterable":
        loader = sl.SavableDataLoader(_Counting(), batch_size=2, seed=3)
    elif kind == "pipeline":
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
        loader = sl.SavableDataLoader(RangeSource(16, wc), batch_size=None, worker_config=wc)
    else:
        loader = _loader(0, kind, world=1)
    it = iter(loader)
    for _ in range(2):
        next(it)
    before = encode(loader.save_state_rank())
    next(it)
    assert decode(encode(loader._save(held=1))) == decode(before)
    with pytest.raises(sl.StateError):
        loader._save(held=2 if kind in ("pipeline", "iterable") else 5)
