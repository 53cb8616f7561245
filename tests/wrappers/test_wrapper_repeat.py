"""RepeatDataset: N passes, a fresh shuffle per pass, an end on an empty source, and a
resume at the boundary between two passes."""

from __future__ import annotations

import itertools

import pytest

import savable_loader as sl
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

PER_WORKER = 5
REPEATS = 3


def repeat_loader(num_workers: int, repeats: int | None = REPEATS, per_worker: int = PER_WORKER):
    wc = make_wc(num_workers)
    return make_loader(RepeatDataset(EpochShuffledSource(per_worker * max(num_workers, 1), wc), repeats))


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    # with "every", saves land right after the last sample of a pass
    set_snapshot_policy(monkeypatch, policy)
    epoch_len = PER_WORKER * max(num_workers, 1) * REPEATS
    steps = resume_steps(num_workers, epoch_len)
    if steps is not None:  # and at a boundary between passes
        steps = sorted({*steps, PER_WORKER * num_workers, PER_WORKER * num_workers + 1})
    assert check_resume_everywhere(lambda: repeat_loader(num_workers), 2, steps=steps) >= 9


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_endless_repeat_cut_by_limit(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    wc = make_wc(num_workers)
    workers = max(num_workers, 1)
    length = 3 * workers * 4 + 2
    factory = lambda: make_loader(LimitDataset(RepeatDataset(RangeSource(3 * workers, wc)), length))
    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, length)) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_repeats_n_times(num_workers):
    wc = make_wc(num_workers)
    workers = max(num_workers, 1)
    n = 4 * workers
    got = [[int(x[0]) for x in e] for e in epochs_of(make_loader(RepeatDataset(RangeSource(n, wc), 3)), 2)]
    want = round_robin([worker_values(n, w, workers) * 3 for w in range(workers)])
    assert got == [want, want]
    if num_workers == 0:
        assert want == list(range(n)) * 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_pass_is_reshuffled(num_workers):
    workers = max(num_workers, 1)
    epochs = epochs_of(repeat_loader(num_workers, per_worker=8), 2)
    all_passes = []
    for epoch in epochs:
        assert len(epoch) == 8 * workers * REPEATS
        for w, mine in enumerate(split_by_worker(epoch, workers)):
            passes = [mine[i : i + 8] for i in range(0, len(mine), 8)]
            assert len(passes) == REPEATS
            for p in passes:
                assert sorted(p) == worker_values(8 * workers, w, workers)
            # the source seeds from worker_config.epoch_seed(): a new order every pass
            assert len({tuple(p) for p in passes}) == REPEATS
            all_passes.extend(tuple(p) for p in passes)
    # and every epoch starts with other orders than the last one
    assert len(set(all_passes)) == len(all_passes)
    assert epochs_of(repeat_loader(num_workers, per_worker=8), 2) == epochs


def test_endless_repeat():
    wc = make_wc(0)
    head = [int(x[0]) for x in itertools.islice(iter(make_loader(RepeatDataset(RangeSource(3, wc)))), 20)]
    assert head == ([0, 1, 2] * 7)[:20]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_empty_source_ends_instead_of_hanging(num_workers):
    wc = make_wc(num_workers)
    assert epochs_of(make_loader(RepeatDataset(RangeSource(0, wc))), 2) == [[], []]
    assert epochs_of(make_loader(RepeatDataset(RangeSource(0, wc), repeats=1000)), 1) == [[]]
    # zero repeats: nothing, even from a non-empty source
    assert list(make_loader(RepeatDataset(RangeSource(5, wc), repeats=0))) == []


@pytest.mark.timeout(30)
def test_worker_with_empty_share_ends():
    # one value for two workers: worker 1's share is empty, worker 0's repeats
    wc = make_wc(2)
    loader = make_loader(LimitDataset(RepeatDataset(RangeSource(1, wc)), 8))
    got = [int(x[0]) for x in loader]
    assert got == [0] * 4  # worker 0's share of the limit (8 // 2); worker 1 ends at once


def test_restore_right_after_the_last_sample_of_a_pass():
    # Directly on the dataset: a state saved after the last sample of a pass must go on
    # with the next pass, not take the exhausted pass for an empty source.
    wc = make_wc(0)

    def make() -> sl.SavableDataset:
        return LimitDataset(RepeatDataset(EpochShuffledSource(3, wc)), 8)

    reference = list(make())
    for k in range(len(reference) + 1):
        ds = make()
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        fresh = make()
        fresh.restore_state(ds.save_state())
        assert head + list(fresh) == reference, f"saved after {k} samples"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_repeats(bad):
    wc = make_wc(0)
    with pytest.raises(
        LoaderUsageError, match=rf"RepeatDataset repeats must be None or a non-negative int, got {bad!r}"
    ):
        RepeatDataset(RangeSource(3, wc), bad)


def test_other_arguments():
    with pytest.raises(LoaderUsageError, match="RepeatDataset wraps a SavableDataset, got range"):
        RepeatDataset(range(3))
    wc = make_wc(0)
    assert RepeatDataset(RangeSource(3, wc)).config() == {"repeats": None}
    assert RepeatDataset(RangeSource(3, wc), 4).config() == {"repeats": 4}
