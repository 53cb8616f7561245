"""BlendDataset: weighted random choice with its own savable RNG, exhausted branches
dropped or ending the epoch, resume and restore keys."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers import BlendDataset, MapDataset, RepeatDataset
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES_FAST,
    check_restore_samples,
    iterate_with_keys,
    make_loader,
    make_wc,
    resume_steps,
    set_snapshot_policy,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

OFFSET = 1000  # samples of branch 1 have ids >= OFFSET


def branches(wc, n0: int = 10, n1: int = 6):
    return [RangeSource(n0, wc), MapDataset(RangeSource(n1, wc), lambda x: x + OFFSET)]


def blended(num_workers: int, weights=(2.0, 1.0), exhausted: str = "drop", **kw):
    wc = make_wc(num_workers)
    return make_loader(BlendDataset(branches(wc, **kw), list(weights), exhausted=exhausted))


def ids(epoch) -> list[int]:
    return [int(x[0]) for x in epoch]


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES_FAST)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    steps = resume_steps(num_workers, 16)
    assert check_resume_everywhere(lambda: blended(num_workers), 2, steps=steps) >= 9


def test_resume_stop_policy():
    assert check_resume_everywhere(lambda: blended(0, exhausted="stop"), 2) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_yields_every_sample_once_in_branch_order(num_workers):
    workers = max(num_workers, 1)
    a = epochs_of(blended(num_workers), 3)
    for epoch in map(ids, a):
        for w in range(workers):
            mine = [v for v in epoch if (v % OFFSET) % workers == w]
            assert [v for v in mine if v < OFFSET] == worker_values(10, w, workers)
            assert [v - OFFSET for v in mine if v >= OFFSET] == worker_values(6, w, workers)
    # a new mix every epoch, the same mix on every run
    assert ids(a[0]) != ids(a[1]) and ids(a[1]) != ids(a[2])
    for x, y in zip(a, epochs_of(blended(num_workers), 3)):
        assert_streams(x, y, "second run")


def test_stop_ends_at_the_first_exhausted_branch():
    lengths = []
    for epoch in map(ids, epochs_of(blended(0, exhausted="stop"), 4)):
        lengths.append(len(epoch))
        zeros = [v for v in epoch if v < OFFSET]
        ones = [v - OFFSET for v in epoch if v >= OFFSET]
        # one branch was read to its end; the other is a prefix of its data
        assert (zeros == list(range(10)) and ones == list(range(len(ones)))) or (
            ones == list(range(6)) and zeros == list(range(len(zeros)))
        )
        # (all 16 only if both branches ran out before an exhausted one was picked)
        assert len(epoch) <= 16
    assert min(lengths) < 16, lengths


def test_mix_follows_the_weights():
    wc = make_wc(0)
    weights = [1.0, 3.0, 0.5]
    ds = BlendDataset([MapDataset(RepeatDataset(RangeSource(4, wc)), lambda x, i=i: i) for i in range(3)], weights)
    counts = Counter()
    it = iter(ds)
    total = 3000
    for _ in range(total):
        counts[next(it)] += 1
    for i, w in enumerate(weights):
        p = w / sum(weights)
        assert abs(counts[i] / total - p) < 4 * math.sqrt(p * (1 - p) / total), (counts, weights)


def test_renormalised_after_a_branch_is_dropped():
    # branch 0 has 2 samples, the others are endless with weights 1 : 3
    wc = make_wc(0)
    ds = BlendDataset(
        [
            MapDataset(RangeSource(2, wc), lambda x: 0),
            MapDataset(RepeatDataset(RangeSource(3, wc)), lambda x: 1),
            MapDataset(RepeatDataset(RangeSource(3, wc)), lambda x: 2),
        ],
        [100.0, 1.0, 3.0],
    )
    it = iter(ds)
    got = [next(it) for _ in range(2002)]
    assert got.count(0) == 2 and 0 not in got[-2000:]  # read out at once, then left out
    ones = got[-2000:].count(1) / 2000
    assert abs(ones - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 2000)


def test_rng_is_state_not_global():
    # the choices do not depend on the global RNGs (the loader re-seeds those per sample)
    wc = make_wc(0)
    torch.manual_seed(1)
    a = [k[0] for _, k in iterate_with_keys(BlendDataset(branches(wc), [1.0, 1.0]))]
    torch.manual_seed(2)
    b = [k[0] for _, k in iterate_with_keys(BlendDataset(branches(wc), [1.0, 1.0]))]
    assert a == b and sorted(a) == [0] * 10 + [1] * 6


def test_restore_sample():
    wc = make_wc(0)
    assert check_restore_samples(lambda: BlendDataset(branches(wc), [2.0, 1.0]), epochs=2) == 8
    ds = BlendDataset(branches(wc), [2.0, 1.0])
    for bad in (5, [2, 3], [-1, 3], ["0", 3], [0]):
        with pytest.raises(RestoreKeyError, match="BlendDataset key must be"):
            ds.restore_sample(bad)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, 0.0], r"weights\[1\] must be a positive finite number, got 0.0"),
        ([-1, 2], r"weights\[0\] must be a positive finite number, got -1"),
        ([1.0, float("nan")], r"weights\[1\] must be a positive finite number, got nan"),
        ([float("inf"), 1.0], r"weights\[0\] must be a positive finite number, got inf"),
        ([True, 1.0], r"weights\[0\] must be a positive finite number, got True"),
        ([1.0, "2"], r"weights\[1\] must be a positive finite number, got '2'"),
        ([1.0], r"weights must be a list of 2 numbers \(one per dataset\), got \[1.0\]"),
    ],
)
def test_bad_weights(weights, message):
    with pytest.raises(LoaderUsageError, match=message):
        BlendDataset(branches(make_wc(0)), weights)


def test_other_arguments():
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match="exhausted must be one of"):
        BlendDataset(branches(wc), exhausted="first")
    with pytest.raises(LoaderUsageError, match="datasets must be a non-empty list"):
        BlendDataset([])
    with pytest.raises(LoaderUsageError, match=r"datasets\[1\] must be a SavableDataset, got list"):
        BlendDataset([RangeSource(3, wc), [1, 2]])
    with pytest.raises(LoaderUsageError, match=r"datasets\[1\].worker_config is .*expected datasets\[0\]'s"):
        BlendDataset([RangeSource(3, wc), RangeSource(3, make_wc(2))])
    ds = BlendDataset(branches(wc))
    assert ds.config() == {"weights": [1.0, 1.0], "exhausted": "drop"}
    assert ds.can_restore_sample()
    assert "keyed=False" in BlendDataset([RangeSource(3, wc), RangeSource(3, wc, keyed=False)]).restore_sample_blocker()
