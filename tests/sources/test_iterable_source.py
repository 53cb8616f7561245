"""IterableSource: resume at every step by seek and by replay (with a ReplayWarning that
says the cost), the stream split over ranks and workers, restore keys."""

from __future__ import annotations

import json
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.errors import DataError, LoaderUsageError, RestoreKeyError
from savable_loader.sources import IterableSource, ReplayWarning, StreamInfo
from tests.common import assert_same, assert_streams, check_resume_everywhere
from tests.wrapper_common import RESUME_CASES, make_loader, resume_steps, set_snapshot_policy

pytestmark = pytest.mark.timeout(120)

N = 23
CALLS: list[tuple[str, int]] = []  # ("fn", 0) / ("seek", position) / ("item", value), in-process only


def build(value: int, epoch: int) -> torch.Tensor:
    """A sample that draws from the three global RNGs while it is produced."""
    return torch.tensor(
        [
            value + 1000 * epoch,
            random.randint(0, 10**6),
            int(np.random.randint(0, 10**6)),
            int(torch.randint(0, 10**6, ())),
        ]
    )


def numbers(info: StreamInfo, n: int = N):
    CALLS.append(("fn", 0))
    for v in info.split(range(n)):
        CALLS.append(("item", v))
        yield build(v, info.epoch)


def numbers_from(info: StreamInfo, position: int, n: int = N):
    CALLS.append(("seek", position))
    for v in range(info.global_worker + position * info.num_global_workers, n, info.num_global_workers):
        CALLS.append(("item", v))
        yield build(v, info.epoch)


def wconf(rank: int = 0, world: int = 1, workers: int = 0) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=9)


def source(wc: sl.WorkerConfig, seek: bool = True) -> IterableSource:
    return IterableSource(numbers, wc, seek=numbers_from if seek else None)


def stream(ds: IterableSource, worker: int, epoch: int) -> tuple[list[Any], list[Any]]:
    out, keys = [], []
    with _ActiveWorker(worker, epoch):
        ds.reset_state_deep()
        for s in ds:
            out.append((s, torch.rand(1)))  # a draw after the yield: re-seeded per sample
            keys.append(ds.sample_key)
    return out, keys


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step_with_seek(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: make_loader(source(wconf(1, 2, num_workers)))
    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, 11)) >= 9


@pytest.mark.filterwarnings("ignore::savable_loader.sources.ReplayWarning")
@pytest.mark.parametrize(("num_workers", "policy"), [RESUME_CASES[1], RESUME_CASES[2]])
def test_resume_at_every_step_by_replay(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: make_loader(source(wconf(0, 1, num_workers), seek=False))
    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, N)) >= 7


def test_split_over_ranks_and_workers():
    seen = []
    for rank in range(2):
        ds = source(wconf(rank, 2, 2))
        for worker in range(2):
            samples, keys = stream(ds, worker, 4)
            assert keys == [[worker, i] for i in range(len(samples))]
            values = [int(s[0]) - 4000 for s, _ in samples]
            assert values == list(range(rank * 2 + worker, N, 4))
            seen += values
    assert sorted(seen) == list(range(N))
    info = source(wconf(1, 2, 2)).info(worker=1)
    assert (info.global_worker, info.num_global_workers, info.epoch, info.seed) == (3, 4, 0, 9)


def _restored(ds: IterableSource, k: int, epoch: int = 1) -> tuple[list[Any], list[Any]]:
    """The rest of worker 0's epoch after restoring a state saved at k samples."""
    ref, _ = stream(source(ds.worker_config), 0, epoch)
    with _ActiveWorker(0, epoch):
        ds.reset_state_deep()
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = ds.save_state()
        assert state.fields == {"epoch": [epoch], "position": k}
        fresh = IterableSource(ds.fn, ds.worker_config, seek=ds.seek)
        fresh.restore_state(state)
        CALLS.clear()
        rest = [(s, torch.rand(1)) for s in fresh]
    return rest, ref[k:]


@pytest.mark.parametrize("k", [1, 5, 11])
def test_restore_calls_seek(k):
    rest, want = _restored(source(wconf(0, 1, 2)), k)
    assert_streams(rest, want, f"after restore at {k}")
    assert CALLS[0] == ("seek", k) and ("fn", 0) not in CALLS
    assert next(c for c in CALLS if c[0] == "item") == ("item", 2 * k)


@pytest.mark.parametrize("k", [1, 5, 11])
def test_restore_without_seek_replays_and_says_so(k):
    with pytest.warns(ReplayWarning) as record:
        rest, want = _restored(source(wconf(0, 1, 2), seek=False), k)
    assert_streams(rest, want, f"after replay to {k}")
    assert len(record) == 1
    assert str(record[0].message) == (
        f"IterableSource(numbers): worker 0 of rank 0 resumes at sample {k} of its stream by replaying {k} "
        "samples through the function (no seek callback was given), which costs as long as producing them "
        "did; pass seek=... to jump there directly"
    )
    assert CALLS[0] == ("fn", 0) and [c for c in CALLS if c[0] == "item"][: k + 1] == [
        ("item", 2 * i) for i in range(k + 1)
    ]


def test_no_warning_without_restore():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(make_loader(source(wconf(), seek=False)))


def test_replay_of_a_shorter_stream_is_an_error():
    ds = IterableSource(lambda info: iter(range(3)), wconf())
    state = ds.save_state()
    state.fields["position"] = 5
    ds.restore_state(state)
    with pytest.warns(ReplayWarning), pytest.raises(DataError, match="stream ended after 3 samples while replaying"):
        list(ds)


def test_restore_sample_rebuilds_samples_and_their_random_draws():
    wc = wconf(1, 2, 2)
    rng = random.Random(1)
    rebuild = source(wc)
    for worker, epoch in [(0, 0), (1, 2)]:
        samples, keys = stream(source(wc), worker, epoch)
        for i in rng.sample(range(len(samples)), 4) + [len(samples) - 1]:
            with _ActiveWorker(worker, epoch):
                again = rebuild.restore_sample(json.loads(json.dumps(keys[i])))
                assert_same((again, torch.rand(1)), samples[i], f"key {keys[i]}")


def test_restore_sample_needs_seek():
    ds = source(wconf(), seek=False)
    assert not ds.can_restore_sample()
    with pytest.raises(RestoreKeyError, match=r"IterableSource\(numbers\) has no seek callback"):
        ds.restore_sample([0, 0])


@pytest.mark.parametrize("key", [None, [0], [0, 1, 2], [2, 0], [0, -1], [True, 0], "0"])
def test_bad_restore_keys(key):
    with pytest.raises(RestoreKeyError, match="IterableSource key"):
        source(wconf(0, 1, 2)).restore_sample(key)


def test_seek_past_the_end():
    with pytest.raises(RestoreKeyError, match="returned an empty stream at position 99"):
        source(wconf()).restore_sample([0, 99])


def test_bad_arguments():
    with pytest.raises(LoaderUsageError, match="fn must be callable"):
        IterableSource([1, 2], wconf())
    with pytest.raises(LoaderUsageError, match="seek must be None or callable"):
        IterableSource(numbers, wconf(), seek=3)
    with pytest.raises(
        LoaderUsageError, match=r"fn test_bad_arguments.<locals>.<lambda> must return an iterable, got int"
    ):
        list(IterableSource(lambda info: 3, wconf()))
    assert IterableSource(numbers, wconf()).config() == {"fn": numbers}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_restore_sample(num_workers):
    def build(seek: bool = True):
        return make_loader(sl.wrappers.BatchDataset(source(wconf(0, 1, num_workers), seek=seek), 3))

    loader = build()
    seen = [(batch, str(loader.restore_key)) for _ in range(2) for batch in loader]
    other = build()
    for batch, key in random.Random(3).sample(seen, 4) + [seen[-1]]:
        assert_same(other.restore_sample(key), batch, key)
    with pytest.raises(RestoreKeyError, match="no seek callback"):
        build(seek=False).restore_sample(key)
