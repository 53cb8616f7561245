"""Tests for savable_loader.config: WorkerConfig defaults, validation, worker ids and seeds."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import cloudpickle
import pytest
import torch.distributed as dist

import savable_loader.config as config_mod
from savable_loader.config import WorkerConfig, _ActiveWorker, _Repetition
from savable_loader.errors import LoaderUsageError
from savable_loader.rng import derive_seed

# -- defaults and validation ------------------------------------------------------------


def test_defaults_without_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    # other test modules of the same session may have initialised a process group
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    wc = WorkerConfig()
    assert (wc.rank, wc.world_size, wc.num_workers, wc.seed, wc.data_parallel_group) == (0, 1, 0, 0, None)
    assert wc.workers_per_rank == 1
    assert wc.fingerprint() == {"rank": 0, "world_size": 1, "num_workers": 0, "seed": 0}


def test_defaults_follow_torch_distributed_when_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    assert config_mod._dist_defaults() == (2, 4)
    wc = WorkerConfig(num_workers=3)
    assert (wc.rank, wc.world_size) == (2, 4)
    # explicit values win over torch.distributed's
    assert WorkerConfig(rank=1).rank == 1 and WorkerConfig(rank=1).world_size == 4
    assert WorkerConfig(world_size=8).rank == 2 and WorkerConfig(world_size=8).world_size == 8


def test_explicit_values() -> None:
    wc = WorkerConfig(rank=3, world_size=4, num_workers=2, seed=-5)
    assert (wc.rank, wc.world_size, wc.num_workers, wc.seed) == (3, 4, 2, -5)
    assert wc.workers_per_rank == 2
    assert wc.fingerprint() == {"rank": 3, "world_size": 4, "num_workers": 2, "seed": -5}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=-1, world_size=2), r"WorkerConfig.rank must be in \[0, world_size=2\), got -1"),
        (dict(rank=2, world_size=2), r"WorkerConfig.rank must be in \[0, world_size=2\), got 2"),
        (dict(rank=5), r"WorkerConfig.rank must be in \[0, world_size=1\), got 5"),
        (dict(rank=0, world_size=0), "WorkerConfig.world_size must be >= 1, got 0"),
        (dict(rank=0, world_size=-3), "WorkerConfig.world_size must be >= 1, got -3"),
        (dict(num_workers=-1), "WorkerConfig.num_workers must be >= 0, got -1"),
        (dict(rank=0.0, world_size=1), "WorkerConfig.rank must be an int, got 0.0"),
        (dict(rank="0", world_size=1), "WorkerConfig.rank must be an int, got '0'"),
        (dict(rank=0, world_size=1.0), "WorkerConfig.world_size must be an int, got 1.0"),
        (dict(num_workers=2.0), "WorkerConfig.num_workers must be an int, got 2.0"),
        (dict(num_workers=None), "WorkerConfig.num_workers must be an int, got None"),
        (dict(seed=1.5), "WorkerConfig.seed must be an int, got 1.5"),
        (dict(seed="0"), "WorkerConfig.seed must be an int, got '0'"),
        (dict(seed=None), "WorkerConfig.seed must be an int, got None"),
        (dict(rank=True, world_size=2), "WorkerConfig.rank must be an int, got True"),
        (dict(rank=0, world_size=True), "WorkerConfig.world_size must be an int, got True"),
        (dict(num_workers=False), "WorkerConfig.num_workers must be an int, got False"),
        (dict(seed=True), "WorkerConfig.seed must be an int, got True"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_validation_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LoaderUsageError, match=f"^{message}$"):
        WorkerConfig(**kwargs)


def test_validation_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        WorkerConfig(num_workers=-2)


def test_equality_ignores_the_process_group() -> None:
    assert WorkerConfig(rank=0, world_size=1, seed=3) == WorkerConfig(rank=0, world_size=1, seed=3)
    assert WorkerConfig(rank=0, world_size=1, seed=3) != WorkerConfig(rank=0, world_size=1, seed=4)
    assert WorkerConfig(rank=0, world_size=1, data_parallel_group=object()) == WorkerConfig(rank=0, world_size=1)


# -- worker ids -------------------------------------------------------------------------


def test_ids_outside_a_worker() -> None:
    wc = WorkerConfig(rank=2, world_size=3, num_workers=4)
    assert wc.rank_worker_id() == 0
    assert wc.global_worker_id() == 8
    assert wc.active_epoch() == 0
    in_process = WorkerConfig(rank=2, world_size=3, num_workers=0)
    assert in_process.global_worker_id() == 2


def test_ids_inside_a_worker() -> None:
    wc = WorkerConfig(rank=2, world_size=3, num_workers=4)
    with _ActiveWorker(3, 7) as active:
        assert isinstance(active, _ActiveWorker)
        assert wc.rank_worker_id() == 3
        assert wc.global_worker_id() == 2 * 4 + 3
        assert wc.active_epoch() == 7
    assert (wc.rank_worker_id(), wc.global_worker_id(), wc.active_epoch()) == (0, 8, 0)


def test_global_worker_ids_are_unique_across_ranks() -> None:
    ids = []
    for rank in range(3):
        wc = WorkerConfig(rank=rank, world_size=3, num_workers=4)
        for worker in range(4):
            with _ActiveWorker(worker, 0):
                ids.append(wc.global_worker_id())
    assert ids == list(range(12))


def test_nested_active_worker_restores_outer() -> None:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=4)
    with _ActiveWorker(1, 5):
        with _ActiveWorker(2, 6):
            assert (wc.rank_worker_id(), wc.active_epoch()) == (2, 6)
        assert (wc.rank_worker_id(), wc.active_epoch()) == (1, 5)
    assert (wc.rank_worker_id(), wc.active_epoch()) == (0, 0)


def test_active_worker_is_left_on_exception() -> None:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=4)
    with pytest.raises(KeyError):
        with _ActiveWorker(3, 2):
            raise KeyError("boom")
    assert (wc.rank_worker_id(), wc.active_epoch()) == (0, 0)


def test_active_worker_is_thread_local() -> None:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=4)
    seen: list[tuple[int, int, int]] = []
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        inside.wait(5)
        seen.append((wc.rank_worker_id(), wc.active_epoch(), wc.worker_seed()))
        release.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with _ActiveWorker(3, 9):
        inside.set()
        release.wait(5)
    t.join(5)
    assert seen == [(0, 0, WorkerConfig(rank=0, world_size=1, num_workers=4).worker_seed())]


# -- seeds ------------------------------------------------------------------------------


def test_worker_seed_matches_derive_seed() -> None:
    wc = WorkerConfig(rank=1, world_size=2, num_workers=3, seed=17)
    assert wc.worker_seed() == derive_seed(17, "worker", 1, 0)
    with _ActiveWorker(2, 4):
        assert wc.worker_seed() == derive_seed(17, "worker", 1, 2)
        assert wc.epoch_seed() == derive_seed(17, "worker-epoch", 1, 2, 4)


def test_worker_seed_differs_across_seed_rank_and_worker() -> None:
    seeds = {}
    for seed in (0, 1, 2):
        for rank in range(3):
            wc = WorkerConfig(rank=rank, world_size=3, num_workers=4, seed=seed)
            for worker in range(4):
                with _ActiveWorker(worker, 0):
                    seeds[(seed, rank, worker)] = wc.worker_seed()
    assert len(set(seeds.values())) == len(seeds) == 36


def test_worker_seed_does_not_depend_on_epoch() -> None:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=5)
    with _ActiveWorker(1, 0):
        a = wc.worker_seed()
    with _ActiveWorker(1, 3):
        b = wc.worker_seed()
    assert a == b


def test_worker_seed_is_deterministic_across_instances() -> None:
    a = WorkerConfig(rank=1, world_size=2, num_workers=2, seed=9)
    b = pickle.loads(pickle.dumps(a))
    with _ActiveWorker(1, 0):
        assert a.worker_seed() == b.worker_seed() == derive_seed(9, "worker", 1, 1)


def test_epoch_seed_differs_across_epochs_workers_and_ranks() -> None:
    seeds = {}
    for rank in range(2):
        wc = WorkerConfig(rank=rank, world_size=2, num_workers=2, seed=1)
        for worker in range(2):
            for epoch in range(5):
                with _ActiveWorker(worker, epoch):
                    seeds[(rank, worker, epoch)] = wc.epoch_seed()
    assert len(set(seeds.values())) == 20
    wc = WorkerConfig(rank=0, world_size=1)
    assert wc.epoch_seed() == derive_seed(0, "worker-epoch", 0, 0, 0)


def test_epoch_seed_differs_across_repetitions() -> None:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=1, seed=3)
    with _ActiveWorker(0, 2):
        plain = wc.epoch_seed()
        seen = {plain}
        for n in range(4):
            with _Repetition(n):
                s = wc.epoch_seed()
                assert s == derive_seed(3, "worker-epoch", 0, 0, 2, n)
                assert s not in seen
                seen.add(s)
                for m in range(3):
                    with _Repetition(m):
                        inner = wc.epoch_seed()
                        assert inner == derive_seed(3, "worker-epoch", 0, 0, 2, n, m)
                        assert inner not in seen
                        seen.add(inner)
                assert wc.epoch_seed() == s  # the inner level was left
        assert wc.epoch_seed() == plain
    assert len(seen) == 1 + 4 + 4 * 3


def test_repetition_does_not_collide_with_next_epoch() -> None:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=1, seed=0)
    with _ActiveWorker(0, 0):
        with _Repetition(1):
            rep = wc.epoch_seed()
    with _ActiveWorker(0, 1):
        nxt = wc.epoch_seed()
    assert rep != nxt


def test_repetition_is_left_on_exception() -> None:
    wc = WorkerConfig(rank=0, world_size=1)
    before = wc.epoch_seed()
    with pytest.raises(RuntimeError):
        with _Repetition(4):
            raise RuntimeError
    assert wc.epoch_seed() == before


# -- pickling ---------------------------------------------------------------------------


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("process groups cannot be pickled")


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_pickling_drops_the_process_group(dumps) -> None:
    group = _Unpicklable()
    wc = WorkerConfig(rank=1, world_size=2, num_workers=3, seed=4, data_parallel_group=group)
    back = pickle.loads(dumps(wc))
    assert back.data_parallel_group is None
    assert (back.rank, back.world_size, back.num_workers, back.seed) == (1, 2, 3, 4)
    assert back == wc
    # the original keeps its group
    assert wc.data_parallel_group is group
