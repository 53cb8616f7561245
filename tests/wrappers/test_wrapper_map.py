"""MapDataset: fn applied to every sample, RNG draws inside fn reproducible and resumable."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from savable_loader.errors import ConfigMismatchError, LoaderUsageError
from savable_loader.wrappers import MapDataset
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

N = 20


def triple(x: torch.Tensor) -> int:
    return int(x[0]) * 3


def other(x: torch.Tensor) -> int:
    return int(x[0]) * 3


def random_loader(num_workers: int, n: int = N):
    wc = make_wc(num_workers)
    # a lambda drawing from all three global RNGs
    ds = MapDataset(
        RangeSource(n, wc),
        lambda x: (int(x[0]) * 10, random.random(), float(np.random.rand()), torch.rand(2)),
    )
    return make_loader(ds)


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    # fn is a lambda drawing from random, NumPy and torch: the continuation is bit-exact
    set_snapshot_policy(monkeypatch, policy)
    steps = resume_steps(num_workers, N)
    assert check_resume_everywhere(lambda: random_loader(num_workers), 2, steps=steps) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_applies_fn_to_every_sample(num_workers):
    wc = make_wc(num_workers)
    workers = wc.workers_per_rank
    got = epochs_of(make_loader(MapDataset(RangeSource(N, wc), triple)), 2)
    # independent expectation: fn over each worker's share of the source, interleaved
    want = round_robin([[3 * v for v in worker_values(N, w, workers)] for w in range(workers)])
    assert got == [want, want]
    assert all(type(x) is int for x in got[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_fn_is_reproducible_and_varies(num_workers):
    a = epochs_of(random_loader(num_workers), 2)
    b = epochs_of(random_loader(num_workers), 2)
    for e, (x, y) in enumerate(zip(a, b)):
        assert_streams(x, y, f"second run, epoch {e}")
    workers = max(num_workers, 1)
    want_ids = round_robin([[10 * v for v in worker_values(N, w, workers)] for w in range(workers)])
    for epoch in a:
        assert [item[0] for item in epoch] == want_ids
        # every sample got its own draws from each RNG
        for column in (1, 2):
            assert len({item[column] for item in epoch}) == N
        assert len({tuple(item[3].tolist()) for item in epoch}) == N
    # and the draws differ between epochs
    assert [item[1] for item in a[0]] != [item[1] for item in a[1]]
    assert [item[2] for item in a[0]] != [item[2] for item in a[1]]
    assert not all(torch.equal(x[3], y[3]) for x, y in zip(a[0], a[1]))


def test_in_process_loader_leaves_caller_rng_untouched():
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    epochs_of(random_loader(0), 1)
    after = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1])
    assert torch.equal(before[2], after[2])


def test_local_function_in_workers():
    offset = 5

    def local(x: torch.Tensor) -> int:  # a closure: carried to the workers by cloudpickle
        return int(x[0]) + offset

    wc = make_wc(2)
    loader = make_loader(MapDataset(RangeSource(6, wc), local))
    assert list(loader) == round_robin([[v + 5 for v in worker_values(6, w, 2)] for w in range(2)])


def test_changed_fn_is_refused():
    wc = make_wc(0)
    loader = make_loader(MapDataset(RangeSource(N, wc), triple))
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    del it
    fresh = make_loader(MapDataset(RangeSource(N, wc), other))
    with pytest.raises(ConfigMismatchError, match="dataset_config"):
        fresh.restore_state_rank(state)


def test_arguments():
    wc = make_wc(0)
    with pytest.raises(TypeError, match="MapDataset fn must be callable, got 3"):
        MapDataset(RangeSource(3, wc), 3)
    with pytest.raises(LoaderUsageError, match="MapDataset wraps a SavableDataset, got list"):
        MapDataset([1, 2, 3], triple)
    ds = MapDataset(RangeSource(3, wc), triple)
    assert ds.config() == {"fn": triple}
    assert ds.config_tree()["fn"] == f"{__name__}.triple"
