"""LimitDataset: the per-worker split of the limit, and fixed-length epochs over a
RepeatDataset."""

from __future__ import annotations

from collections import Counter

import pytest

from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers import LimitDataset, RepeatDataset
from tests.common import RangeSource, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    EpochShuffledSource,
    make_loader,
    make_wc,
    resume_steps,
    round_robin,
    set_snapshot_policy,
    split_by_worker,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 30
LENGTH = 13


def worker_limit(length: int, worker: int, workers: int) -> int:
    """The documented split of a limit: worker ``w`` of ``W`` yields at most
    ``length // W + (w < length % W)`` samples (the first ``length % W`` workers one more),
    so the rank yields ``length`` samples in all when every worker has enough data."""
    return length // workers + (worker < length % workers)


def limited_ids(num_workers: int, length: int, n: int = N) -> list[list[int]]:
    wc = make_wc(num_workers)
    return [[int(x[0]) for x in e] for e in epochs_of(make_loader(LimitDataset(RangeSource(n, wc), length)), 2)]


def test_split_rule():
    assert [worker_limit(13, w, 1) for w in range(1)] == [13]
    assert [worker_limit(13, w, 2) for w in range(2)] == [7, 6]
    assert [worker_limit(10, w, 3) for w in range(3)] == [4, 3, 3]
    assert [worker_limit(1, w, 2) for w in range(2)] == [1, 0]
    assert all(sum(worker_limit(L, w, W) for w in range(W)) == L for L in range(20) for W in range(1, 5))


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    wc = make_wc(num_workers)
    steps = resume_steps(num_workers, LENGTH)
    factory = lambda: make_loader(LimitDataset(RangeSource(N, wc), LENGTH))
    assert check_resume_everywhere(factory, 2, steps=steps) >= 9


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_fixed_length_epochs_over_repeat(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    wc = make_wc(num_workers)
    length = 17
    steps = resume_steps(num_workers, length)
    factory = lambda: make_loader(LimitDataset(RepeatDataset(EpochShuffledSource(5 * max(num_workers, 1), wc)), length))
    assert check_resume_everywhere(factory, 2, steps=steps) >= 9


@pytest.mark.parametrize(("num_workers", "length"), [(0, 13), (2, 13), (3, 10), (2, 1), (3, 2)])
def test_per_worker_split(num_workers, length):
    workers = max(num_workers, 1)
    want = round_robin([worker_values(N, w, workers)[: worker_limit(length, w, workers)] for w in range(workers)])
    got = limited_ids(num_workers, length)
    assert got == [want, want]
    assert len(want) == length
    assert [len(mine) for mine in split_by_worker(want, workers)] == [
        worker_limit(length, w, workers) for w in range(workers)
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_limit_beyond_the_data_and_zero(num_workers):
    workers = max(num_workers, 1)
    everything = round_robin([worker_values(N, w, workers) for w in range(workers)])
    assert limited_ids(num_workers, N + 7) == [everything, everything]
    assert limited_ids(num_workers, 0) == [[], []]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fixed_length_epochs_over_repeat(num_workers):
    wc = make_wc(num_workers)
    workers = max(num_workers, 1)
    n, length = 4 * workers, 11 * workers  # each worker: 4 values, 11 samples an epoch
    loader = make_loader(LimitDataset(RepeatDataset(EpochShuffledSource(n, wc)), length))
    epochs = epochs_of(loader, 3)
    assert [len(e) for e in epochs] == [length] * 3
    for e in epochs:
        for w, mine in enumerate(split_by_worker(e, workers)):
            assert len(mine) == 11
            # passes of 4 (each a fresh shuffle of the worker's values), the third cut short
            passes = [mine[0:4], mine[4:8], mine[8:]]
            assert all(sorted(p) == worker_values(n, w, workers) for p in passes[:2])
            assert set(passes[2]) < set(worker_values(n, w, workers))
            assert passes[0] != passes[1]
            assert Counter(mine) == Counter({v: 3 if v in passes[2] else 2 for v in worker_values(n, w, workers)})
    # every epoch starts over with its own shuffle
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3", None])
def test_bad_length(bad):
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match=rf"LimitDataset length must be a non-negative int, got {bad!r}"):
        LimitDataset(RangeSource(3, wc), bad)


def test_other_arguments():
    with pytest.raises(LoaderUsageError, match="LimitDataset wraps a SavableDataset, got tuple"):
        LimitDataset((1, 2), 2)
    assert LimitDataset(RangeSource(3, make_wc(0)), 2).config() == {"length": 2}
