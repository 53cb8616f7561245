"""FilterDataset: exactly the accepted samples, in order; resumable with random predicates."""

from __future__ import annotations

import random

import pytest
import torch

from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers import FilterDataset
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    make_loader,
    make_wc,
    resume_steps,
    round_robin,
    set_snapshot_policy,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 30


def not_multiple_of_3(x: torch.Tensor) -> bool:
    return int(x[0]) % 3 != 0


def random_loader(num_workers: int):
    wc = make_wc(num_workers)
    # keeps a sample when a fresh draw from the global RNG says so: about half of them
    return make_loader(FilterDataset(RangeSource(N, wc), lambda x: random.random() < 0.6))


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    epoch_len = len(list(random_loader(num_workers)))
    assert 5 < epoch_len < N
    steps = resume_steps(num_workers, epoch_len)
    checked = check_resume_everywhere(lambda: random_loader(num_workers), 2, steps=steps)
    # every step is a save point (the epoch ends count twice: in the epoch and between
    # epochs), except 2n beyond a shorter second epoch: the draws decide the lengths
    assert checked >= (9 if steps is None else len(steps) - 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_keeps_exactly_the_accepted_samples(num_workers):
    wc = make_wc(num_workers)
    workers = wc.workers_per_rank
    got = epochs_of(make_loader(FilterDataset(RangeSource(N, wc), not_multiple_of_3)), 2)
    want = round_robin([[v for v in worker_values(N, w, workers) if v % 3 != 0] for w in range(workers)])
    assert len(want) == 20
    for epoch in got:
        assert [int(x[0]) for x in epoch] == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_accept_all_is_the_source(num_workers):
    wc = make_wc(num_workers)
    # one source sample per output sample: even the RNG draws of the source are the same
    plain = epochs_of(make_loader(RangeSource(N, wc)), 2)
    filtered = epochs_of(make_loader(FilterDataset(RangeSource(N, wc), lambda x: True)), 2)
    for e, (a, b) in enumerate(zip(filtered, plain)):
        assert_streams(a, b, f"epoch {e}")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reject_all_gives_empty_epochs(num_workers):
    wc = make_wc(num_workers)
    loader = make_loader(FilterDataset(RangeSource(N, wc), lambda x: False))
    assert epochs_of(loader, 2) == [[], []]
    state = loader.save_state_rank()
    assert state.position.epoch == 2


def test_random_predicate_is_reproducible_and_varies_per_epoch():
    a = epochs_of(random_loader(2), 2)
    b = epochs_of(random_loader(2), 2)
    for e, (x, y) in enumerate(zip(a, b)):
        assert_streams(x, y, f"second run, epoch {e}")
    kept = [[int(x[0]) for x in epoch] for epoch in a]
    assert kept[0] != kept[1]
    for epoch in kept:  # still each worker's samples in source order, none twice
        assert len(set(epoch)) == len(epoch)
        for w in range(2):
            mine = [v for v in epoch if v % 2 == w]
            assert mine == sorted(mine)


def test_arguments():
    wc = make_wc(0)
    with pytest.raises(TypeError, match="FilterDataset predicate must be callable, got 'even'"):
        FilterDataset(RangeSource(3, wc), "even")
    with pytest.raises(LoaderUsageError, match="FilterDataset wraps a SavableDataset, got range"):
        FilterDataset(range(3), not_multiple_of_3)
    ds = FilterDataset(RangeSource(3, wc), not_multiple_of_3)
    assert ds.config_tree()["predicate"] == f"{__name__}.not_multiple_of_3"
