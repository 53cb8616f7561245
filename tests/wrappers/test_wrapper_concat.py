"""ConcatDataset: datasets one after another (per worker), resume, restore keys."""

from __future__ import annotations

import pytest

from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers import ConcatDataset, MapDataset
from tests.common import RangeSource, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES_FAST,
    check_restore_samples,
    make_loader,
    make_wc,
    resume_steps,
    round_robin,
    set_snapshot_policy,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)


def parts(wc):
    return [
        RangeSource(5, wc),
        MapDataset(RangeSource(0, wc), lambda x: x),
        MapDataset(RangeSource(6, wc), lambda x: x + 100),
    ]


def concat_loader(num_workers: int):
    return make_loader(ConcatDataset(parts(make_wc(num_workers))))


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES_FAST)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    steps = resume_steps(num_workers, 11)
    assert check_resume_everywhere(lambda: concat_loader(num_workers), 2, steps=steps) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_worker_reads_the_parts_in_turn(num_workers):
    workers = max(num_workers, 1)
    want = round_robin(
        [worker_values(5, w, workers) + [100 + v for v in worker_values(6, w, workers)] for w in range(workers)]
    )
    got = [[int(x[0]) for x in e] for e in epochs_of(concat_loader(num_workers), 2)]
    assert got == [want, want]


def test_restore_sample():
    wc = make_wc(0)
    assert check_restore_samples(lambda: ConcatDataset(parts(wc)), epochs=2) == 8
    ds = ConcatDataset(parts(wc))
    for bad in (1, [3, 0], [-1, 0], [None, 0]):
        with pytest.raises(RestoreKeyError, match=r"ConcatDataset key must be \[dataset index below 3, inner key\]"):
            ds.restore_sample(bad)


def test_arguments():
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match="ConcatDataset datasets must be a non-empty list"):
        ConcatDataset(())
    with pytest.raises(LoaderUsageError, match=r"datasets\[0\] must be a SavableDataset, got int"):
        ConcatDataset([3])
    with pytest.raises(LoaderUsageError, match=r"datasets\[1\].worker_config is"):
        ConcatDataset([RangeSource(3, wc), RangeSource(3, make_wc(1))])
    assert ConcatDataset(parts(wc)).config() == {"parts": 3}
